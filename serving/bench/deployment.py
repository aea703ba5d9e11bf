"""What a benchmark talks to: a server already running somewhere, or one started here for the run.

Either way the result is the same small description (URL, one API key per tenant, the adapters
and their owners, the admin token when there is one), so the driver and the report do not care
which.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from loraplane.serving.api.loopback import free_port
from loraplane.serving.api.tenants import TenantConfig
from loraplane.serving.config import EngineConfig


@dataclass
class Deployment:
    url: str
    keys: dict[str | None, str]  # tenant -> API key; {None: key} for an open server
    models: list[str]  # adapters, in Zipf rank order
    owners: list[str | None]  # the tenant each adapter is called as
    admin_token: str | None = None
    tenants: list[str] = field(default_factory=list)

    def admin_get(self, path: str) -> dict[str, object] | None:
        """An admin call's JSON, or None when this deployment gives us no admin access."""
        if self.admin_token is None:
            return None
        r = httpx.get(f"{self.url}{path}", headers={"Authorization": f"Bearer {self.admin_token}"}, timeout=60)
        r.raise_for_status()
        result: dict[str, object] = r.json()
        return result


def remote(url: str, tenants: list[TenantConfig] | None, api_key: str | None, admin_token: str | None) -> Deployment:
    """A running server: each tenant's adapters are what ``/v1/models`` lists for its key."""
    keys: dict[str | None, str] = {t.name: t.api_keys[0] for t in tenants} if tenants else {None: api_key or "none"}
    models: list[str] = []
    owners: list[str | None] = []
    for tenant, key in keys.items():
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=60)
        r.raise_for_status()
        for card in r.json()["data"]:
            if card.get("parent") and card["id"] not in models:  # adapters name their base as parent
                models.append(card["id"])
                owners.append(tenant)
    if not models:
        raise ValueError(f"{url} lists no adapters for the given keys")
    return Deployment(url, keys, models, owners, admin_token, [t for t in keys if t is not None])


@contextmanager
def spawn_server(
    config: EngineConfig,
    adapters: Mapping[str, tuple[Path, str | None]],
    tenant_names: list[str],
    *,
    start_timeout: float = 900,
) -> Iterator[Deployment]:
    """Run ``loraplane serve`` for ``config`` as a child process on a free loopback port, register
    ``adapters`` (name -> (PEFT folder, owner)) through the admin API as an operator would, and
    yield the deployment; the server is stopped (SIGTERM: graceful) afterwards.

    A separate process rather than a thread: the client's event loop and the server's would
    otherwise share one interpreter lock, and every figure would include that contention.
    """
    admin_token = secrets.token_hex(16)
    tenants = [TenantConfig(name=t, api_keys=[f"sk-{t}-{secrets.token_hex(8)}"]) for t in tenant_names]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="loraplane-server-") as tmp:
        work = Path(tmp)
        (work / "engine.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
        (work / "tenants.yaml").write_text(yaml.safe_dump({"tenants": [t.model_dump() for t in tenants]}))
        args = ["serve", "--config", str(work / "engine.yaml"), "--port", str(port), "--admin-token", admin_token]
        if tenants:
            args += ["--tenants", str(work / "tenants.yaml")]
        with (work / "server.log").open("wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "loraplane.cli", *args], stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_ready(url, proc, work / "server.log", start_timeout)
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_token}"}, timeout=120) as admin:
                for name, (folder, owner) in adapters.items():
                    r = admin.post("/admin/adapters", json={"lora_name": name, "lora_path": str(folder), "tenant": owner})
                    if r.status_code != 200:
                        raise RuntimeError(f"registering {name}: {r.status_code} {r.text}")
            keys: dict[str | None, str] = {t.name: t.api_keys[0] for t in tenants} if tenants else {None: "none"}
            yield Deployment(url, keys, list(adapters), [owner for _, owner in adapters.values()], admin_token, tenant_names)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}/ready did not answer 200 within {timeout:.0f} s:\n{log.read_text()[-3000:]}")
