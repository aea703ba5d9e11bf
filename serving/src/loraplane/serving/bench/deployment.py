"""What a benchmark talks to: a server already running somewhere, or one started here for the run.

Either way the result is the same small description (URL, one API key per tenant, the adapters
and their owners, the admin token when there is one), so the driver and the report do not care
which.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from loraplane.admin_api import LoadLoraRequest, ReplicaStats
from loraplane.serving.api.deps import ENGINE_FAILED
from loraplane.serving.config import EngineConfig
from loraplane.serving.http.loopback import free_port
from loraplane.serving.http.tenants import TenantConfig


@dataclass
class Deployment:
    url: str
    keys: dict[str | None, str]  # tenant -> API key; {None: key} for an open server
    models: list[str]  # adapters, in Zipf rank order
    owners: list[str | None]  # the tenant each adapter is called as
    admin_token: str | None = None
    tenants: list[str] = field(default_factory=list)

    def stats(self) -> ReplicaStats | None:
        """The server's ``/admin/stats``, or None when this deployment gives us no admin access."""
        if self.admin_token is None:
            return None
        r = httpx.get(f"{self.url}/admin/stats", headers={"Authorization": f"Bearer {self.admin_token}"}, timeout=60)
        r.raise_for_status()
        return ReplicaStats.model_validate(r.json())


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


@dataclass
class Fleet:
    """Serving replicas started here with one config, one tenants file and one admin token, as a
    Deployment's pods would be. ``kill`` and ``start`` let a test take one away and bring it back."""

    ports: list[int]
    adapters: Mapping[str, tuple[Path, str | None]]
    keys: dict[str | None, str]
    admin_token: str
    tenant_names: list[str]
    work: Path  # engine.yaml, tenants.yaml and each replica's log
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    replica_args: Callable[[int], list[str]] | None = None  # more flags for replica i (e.g. its usage spool)
    env: Mapping[str, str] | None = None  # more environment for every replica
    # The address replicas listen on and are reached at. Loopback unless a test publishes them in
    # EndpointSlices, which a real API server refuses to hold loopback addresses in.
    host: str = "127.0.0.1"

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{port}" for port in self.ports]

    @property
    def models(self) -> list[str]:
        return list(self.adapters)

    def deployment(self, url: str) -> Deployment:
        owners = [owner for _, owner in self.adapters.values()]
        return Deployment(url, self.keys, self.models, owners, self.admin_token, self.tenant_names)

    def start(self, i: int) -> None:
        """Launch replica ``i`` on its port (again, after a kill); ``ready`` waits for it."""
        args = ["serve", "--config", str(self.work / "engine.yaml"), "--host", self.host, "--port", str(self.ports[i])]
        args += ["--admin-token", self.admin_token]
        if self.tenant_names:
            args += ["--tenants", str(self.work / "tenants.yaml")]
        if self.replica_args is not None:
            args += self.replica_args(i)
        env = {**os.environ, **(self.env or {})}
        with (self.work / f"server-{i}.log").open("ab") as log:
            cmd = child_command(*args)
            self.procs[i] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def ready(self, i: int, timeout: float = 900) -> None:
        """Wait for replica ``i`` to answer, then register every adapter on it as an operator would."""
        url = self.urls[i]
        _wait_ready(url, self.procs[i], self.work / f"server-{i}.log", timeout)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {self.admin_token}"}, timeout=120) as admin:
            for name, (folder, owner) in self.adapters.items():
                req = LoadLoraRequest(lora_name=name, lora_path=str(folder), tenant=owner)
                r = admin.post("/admin/adapters", json=req.model_dump(mode="json", exclude_none=True))
                if r.status_code != 200:
                    raise RuntimeError(f"registering {name} on {url}: {r.status_code} {r.text}")

    def kill(self, i: int) -> None:
        """SIGKILL: the replica gets no chance to finish or refuse anything."""
        self.procs[i].kill()
        self.procs[i].wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


@contextmanager
def spawn_server(
    config: EngineConfig,
    adapters: Mapping[str, tuple[Path, str | None]],
    tenant_names: list[str],
    *,
    start_timeout: float = 900,
    server_args: list[str] | None = None,
) -> Iterator[Deployment]:
    """Run ``loraplane serve`` for ``config`` (and ``server_args``) as a child process on a free loopback port, register
    ``adapters`` (name -> (PEFT folder, owner)) through the admin API as an operator would, and
    yield the deployment; the server is stopped (SIGTERM: graceful) afterwards.

    A separate process rather than a thread: the client's event loop and the server's would
    otherwise share one interpreter lock, and every figure would include that contention.
    """
    extra = list(server_args or [])
    with spawn_replicas(config, adapters, tenant_names, 1, start_timeout=start_timeout, replica_args=lambda _: extra) as fleet:
        yield fleet.deployment(fleet.urls[0])


@contextmanager
def spawn_replicas(
    config: EngineConfig,
    adapters: Mapping[str, tuple[Path, str | None]],
    tenant_names: list[str],
    count: int,
    *,
    start_timeout: float = 900,
    replica_args: Callable[[int], list[str]] | None = None,
    env: Mapping[str, str] | None = None,
    quotas: Mapping[str, Mapping[str, int]] | None = None,
    host: str = "127.0.0.1",
) -> Iterator[Fleet]:
    """``count`` replicas of ``loraplane serve``, each a child process with every adapter registered
    (``quotas``: tenant -> its ``max_concurrent``/``tokens_per_minute``; ``host``: the address they
    listen on)."""
    admin_token = secrets.token_hex(16)
    tenants = [
        TenantConfig(name=t, api_keys=[f"sk-{t}-{secrets.token_hex(8)}"], **dict((quotas or {}).get(t, {}))) for t in tenant_names
    ]
    keys: dict[str | None, str] = {t.name: t.api_keys[0] for t in tenants} if tenants else {None: "none"}
    with tempfile.TemporaryDirectory(prefix="loraplane-server-") as tmp:
        work = Path(tmp)
        (work / "engine.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
        (work / "tenants.yaml").write_text(yaml.safe_dump({"tenants": [t.model_dump() for t in tenants]}))
        fleet = Fleet([free_port() for _ in range(count)], adapters, keys, admin_token, tenant_names, work,
                      replica_args=replica_args, env=env, host=host)  # fmt: skip
        try:
            for i in range(count):
                fleet.start(i)
            for i in range(count):
                fleet.ready(i, start_timeout)
            yield fleet
        finally:
            fleet.stop()


@contextmanager
def spawn_router(
    fleet: Fleet,
    *,
    policy: str = "affinity",
    epsilon: float = 0.25,
    service: tuple[str, str] | None = None,
    kubeconfig: Path | None = None,
    start_timeout: float = 60,
    extra_args: list[str] | None = None,
) -> Iterator[str]:
    """``loraplane router`` in front of the fleet as a child process, with the fleet's tenants and
    admin token; yields its URL once it sees a replica. With ``service`` (namespace, name) it
    finds the replicas through that Service's EndpointSlices, in the cluster ``kubeconfig`` names."""
    port = free_port()
    args = ["router", "--port", str(port), "--policy", policy, "--epsilon", str(epsilon), "--admin-token", fleet.admin_token]
    if service is None:
        args += [a for url in fleet.urls for a in ("--replica", url)]
    else:
        args += ["--namespace", service[0], "--service", service[1], "--stats-interval", "0.5"]
    if fleet.tenant_names:
        args += ["--tenants", str(fleet.work / "tenants.yaml")]
    args += extra_args or []
    env = {**os.environ, **(fleet.env or {}), **({"KUBECONFIG": str(kubeconfig)} if kubeconfig else {})}
    log_path = fleet.work / f"router-{port}.log"
    with log_path.open("wb") as log:
        cmd = child_command(*args)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, log_path, start_timeout)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def child_command(*args: str) -> list[str]:
    """The command line that runs ``loraplane ARGS`` in a child process with this interpreter.

    ``-P`` keeps the working directory off the child's ``sys.path``: the child imports what is
    installed, whatever folder it was started from (the repository's root holds no packages
    either: each part lives in ``<part>/src/loraplane/<part>``)."""
    return [sys.executable, "-P", "-m", "loraplane.cli", *args]


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    """Until ``/ready`` answers 200; raises at once when the server exits or says its engine
    failed to start (it stays up to say why, and would otherwise be waited for to the timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            r = httpx.get(f"{url}/ready", timeout=5)
            if r.status_code == 200:
                return
            if r.status_code == 503 and r.json().get("error", {}).get("code") == ENGINE_FAILED:
                raise RuntimeError(f"{r.json()['error']['message']}\n{log.read_text()[-3000:]}")
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}/ready did not answer 200 within {timeout:.0f} s:\n{log.read_text()[-3000:]}")
