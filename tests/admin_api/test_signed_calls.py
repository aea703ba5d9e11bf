"""The operator's and the router's admin calls carry a signature, never the token.

The operator finds replicas by their labels, which any namespace user can put on a pod of their
own. What such a pod receives must not let it act as the operator: it gets a signature of one
request, for its own address, valid for a minute, and the real replica refuses it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import httpx
import pytest
from engine_helpers import Built, tiny_engine

from loraplane.admin_api import LoadLoraRequest
from loraplane.admin_api.auth import (
    SIGNATURE_WINDOW_SECONDS,
    bearer_matches,
    sign_request,
    signed_request_matches,
)
from loraplane.admin_api.client import AdminClient, ReplicaError
from loraplane.serving.api.app import create_app
from loraplane.serving.api.loopback import serve_app

ADMIN, STATS = "admin-secret-token", "stats-secret-token"


def test_a_signature_covers_the_method_the_address_the_path_the_body_and_the_time() -> None:
    header = sign_request(ADMIN, "POST", "10.0.0.7:8000", "/admin/adapters?x=1", b'{"a": 1}', at=1_000_000)
    assert ADMIN not in header
    ok = dict(method="POST", host="10.0.0.7:8000", target="/admin/adapters?x=1", body=b'{"a": 1}')
    assert signed_request_matches(header, ADMIN, **ok, now=1_000_010)  # type: ignore[arg-type]
    changed = [
        {"method": "GET"},
        {"host": "10.0.0.8:8000"},
        {"target": "/admin/adapters?x=2"},
        {"body": b'{"a": 2}'},
    ]
    for change in changed:
        assert not signed_request_matches(header, ADMIN, **{**ok, **change}, now=1_000_010), change  # type: ignore[arg-type]
    assert not signed_request_matches(header, "another-token", **ok, now=1_000_010)  # type: ignore[arg-type]
    late = 1_000_000 + SIGNATURE_WINDOW_SECONDS + 1
    assert not signed_request_matches(header, ADMIN, **ok, now=late)  # type: ignore[arg-type]
    # A replica that knows its own address takes only signatures made for it (any port).
    assert signed_request_matches(header, ADMIN, **ok, admin_hosts=frozenset({"10.0.0.7"}), now=1_000_010)  # type: ignore[arg-type]
    assert not signed_request_matches(header, ADMIN, **ok, admin_hosts=frozenset({"10.0.0.9"}), now=1_000_010)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "authorization",
    ["", "Bearer", "Bearer wrong", "Loraplane-HMAC-SHA256", "Loraplane-HMAC-SHA256 t=abc,sig=00", "Loraplane-HMAC-SHA256 sig=,t=",
     "Loraplane-HMAC-SHA256 t=1,sig=é", "Basic YWRtaW46YWRtaW4="],
)  # fmt: skip
def test_malformed_headers_are_refused_not_raised(authorization: str) -> None:
    assert not bearer_matches(authorization, ADMIN)
    assert not signed_request_matches(authorization, ADMIN, method="GET", host="h", target="/", body=b"")


class Rogue(BaseHTTPRequestHandler):
    """A pod wearing the serving labels: it records what it is sent and answers like a replica
    that failed."""

    seen: ClassVar[list[tuple[str, str, dict[str, str], bytes]]] = []

    def _record(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        Rogue.seen.append((self.command, self.path, dict(self.headers.items()), body))
        payload = json.dumps({"error": {"message": "no"}}).encode()
        self.send_response(500)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _record

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def rogue() -> Iterator[str]:
    """On another loopback address than the replica, as another pod has another IP."""
    server = ThreadingHTTPServer(("127.0.0.2", 0), Rogue)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Rogue.seen.clear()
    yield f"http://127.0.0.2:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def replica(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory) -> Iterator[str]:
    cache = tmp_path_factory.mktemp("signed-cache")
    built = Built(lambda: tiny_engine(tiny_llama, cache, {"qv4": tiny_adapters["qv4"]}, max_model_len=128))
    app = create_app(built, admin_token=ADMIN, stats_token=STATS, admin_hosts=frozenset({"127.0.0.1"}))
    with serve_app(app) as url:
        yield url


def test_the_admin_client_signs_and_a_replica_takes_its_calls(replica: str, tiny_adapters: dict[str, Path]) -> None:
    async def calls() -> None:
        admin = AdminClient(replica, ADMIN, http=httpx.AsyncClient())
        state = await admin.register(LoadLoraRequest(lora_name="ku2", lora_path=str(tiny_adapters["ku2"])))
        assert state.name == "ku2"
        assert "ku2" in (await admin.stats()).adapters
        reader = AdminClient(replica, STATS, http=httpx.AsyncClient())
        assert "ku2" in (await reader.stats()).adapters  # the router's token reads the figures
        with pytest.raises(ReplicaError) as refused:  # and can change nothing
            await reader.register(LoadLoraRequest(lora_name="all8", lora_path=str(tiny_adapters["all8"])))
        assert refused.value.status == 401
        assert (await admin.state("all8")) is None  # the refused registration changed nothing

    asyncio.run(calls())


def test_a_pod_posing_as_a_replica_gets_nothing_it_can_use(replica: str, rogue: str, tiny_adapters: dict[str, Path]) -> None:
    """The operator's client sends the rogue pod a call. The token appears nowhere in it, and
    replayed against the real replica (as sent, or readdressed) the call is refused."""
    body = LoadLoraRequest(lora_name="evil", lora_path=str(tiny_adapters["all8"]))

    async def call_the_rogue() -> None:
        with pytest.raises(ReplicaError):
            await AdminClient(rogue, ADMIN, http=httpx.AsyncClient()).register(body)

    asyncio.run(call_the_rogue())
    [(method, path, headers, content)] = Rogue.seen
    assert ADMIN not in json.dumps(headers) and ADMIN.encode() not in content
    assert headers["Authorization"].startswith("Loraplane-HMAC-SHA256 ")
    replayed = {k: v for k, v in headers.items() if k.lower() not in ("host", "content-length")}
    for host in (headers["Host"], replica.removeprefix("http://")):
        r = httpx.request(method, f"{replica}{path}", headers={**replayed, "Host": host}, content=content)
        assert r.status_code == 401, (host, r.text)
    state = httpx.get(f"{replica}/admin/adapters/evil", headers={"Authorization": f"Bearer {ADMIN}"})
    assert state.status_code == 404  # nothing was registered
