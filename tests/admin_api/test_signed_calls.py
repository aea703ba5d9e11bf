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
    RESPONSE_HEADER,
    SIGNATURE_WINDOW_SECONDS,
    bearer_matches,
    response_signed,
    sign_request,
    sign_response,
    signed_request_matches,
)
from loraplane.admin_api.client import UNPROVEN, AdminClient, ReplicaError
from loraplane.operator.runtime import adapter_flow, cluster, replica_proof
from loraplane.serving.api.app import create_app
from loraplane.serving.http.loopback import serve_app

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


FAILED = (500, json.dumps({"error": {"message": "no"}}).encode(), {"content-type": "application/json"})


class Rogue(BaseHTTPRequestHandler):
    """A pod wearing the serving labels: it records what it is sent and gives ``answer`` (by
    default, that of a replica that failed)."""

    seen: ClassVar[list[tuple[str, str, dict[str, str], bytes]]] = []
    answer: ClassVar[tuple[int, bytes, dict[str, str]]] = FAILED

    def _record(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        Rogue.seen.append((self.command, self.path, dict(self.headers.items()), body))
        status, payload, headers = Rogue.answer
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
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
    Rogue.answer = FAILED
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


def test_an_answer_is_signed_for_its_call_its_status_and_its_body() -> None:
    call = sign_request(ADMIN, "GET", "10.0.0.7:8000", "/admin/base", b"", at=1_000_000)
    other_call = sign_request(ADMIN, "GET", "10.0.0.7:8000", "/admin/base", b"", at=1_000_001)
    header = sign_response(ADMIN, call, 200, b'{"name": "smollm2"}')
    assert ADMIN not in header
    assert response_signed(header, ADMIN, call, 200, b'{"name": "smollm2"}')
    assert not response_signed(header, ADMIN, other_call, 200, b'{"name": "smollm2"}')  # not replayable to another call
    assert not response_signed(header, ADMIN, call, 200, b'{"name": "other"}')
    assert not response_signed(header, ADMIN, call, 201, b'{"name": "smollm2"}')
    assert not response_signed(header, STATS, call, 200, b'{"name": "smollm2"}')
    assert not response_signed(None, ADMIN, call, 200, b'{"name": "smollm2"}')


@pytest.mark.parametrize("status", [200, 203, 300, 302])
def test_only_a_holder_of_the_token_can_prove_itself_a_replica(replica: str, rogue: str, status: int) -> None:
    """The rogue pod answers the way the real replica did, down to its signature header (copied
    from an answer the real one gave), as a success or as a redirect (which the clients do not
    follow): the client still refuses it, since that signature was for another call. Its data is
    never returned to the caller."""
    signed = sign_request(ADMIN, "GET", replica.removeprefix("http://"), "/admin/base", b"")
    real = httpx.get(f"{replica}/admin/base", headers={"Authorization": signed})
    assert RESPONSE_HEADER.lower() in real.headers
    copied = {k: v for k, v in real.headers.items() if k.lower() != "content-length"}
    Rogue.answer = (status, real.content, {**copied, "location": f"{replica}/admin/base"})

    async def calls() -> None:
        assert await AdminClient(replica, ADMIN, http=httpx.AsyncClient()).proven() is True
        assert (
            await AdminClient(replica, STATS, http=httpx.AsyncClient()).proven() is False
        )  # the stats token cannot read the base
        assert await AdminClient(replica, "a-guess", http=httpx.AsyncClient()).proven() is False
        assert await AdminClient(rogue, ADMIN, http=httpx.AsyncClient()).proven() is False
        with pytest.raises(ReplicaError) as refused:
            await AdminClient(rogue, ADMIN, http=httpx.AsyncClient()).base()
        assert refused.value.code == UNPROVEN
        assert await AdminClient("http://127.0.0.3:9", ADMIN, http=httpx.AsyncClient()).proven() is None  # nobody there

    asyncio.run(calls())


def test_the_operator_sends_registrations_only_to_pods_that_proved_themselves(
    replica: str, rogue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator lists pods by label; the rogue one wears the labels. It is asked to prove
    itself (a GET with no body) and, failing, is sent nothing more; the real replica proves
    itself once and is remembered."""
    pods = [cluster.Replica("serving-0", replica, uid="uid-0"), cluster.Replica("serving-evil", rogue, uid="uid-9")]

    async def ready_replicas(namespace: str, base: str) -> list[cluster.Replica]:
        return pods

    monkeypatch.setattr(cluster, "ready_replicas", ready_replicas)
    monkeypatch.setattr(replica_proof, "_proven", type(replica_proof._proven)())
    proven = asyncio.run(adapter_flow.proven_replicas("team-a", "smollm2", ADMIN))
    assert [p.name for p in proven] == ["serving-0"]
    assert [(method, path, body) for method, path, _, body in Rogue.seen] == [("GET", "/admin/base", b"")]
    assert ("uid-0", replica) in replica_proof._proven
    # Before the base's token Secret exists no replica can have started: no labelled pod is called.
    Rogue.seen.clear()
    assert asyncio.run(adapter_flow.proven_replicas("team-a", "smollm2", None)) == []
    assert Rogue.seen == []


def test_every_secret_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timing itself is a benchmark's to measure; what a test can hold is that each answer comes
    from ``hmac.compare_digest`` (whose time does not depend on where a guess goes wrong) and
    not from ``==``: with the comparison replaced by one that never agrees, nothing matches."""
    from loraplane.admin_api import auth

    compared: list[tuple[bytes, bytes]] = []

    def never_equal(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return False

    call = sign_request(ADMIN, "GET", "h", "/", b"")
    answer = sign_response(ADMIN, call, 200, b"{}")
    assert bearer_matches(f"Bearer {ADMIN}", ADMIN) and signed_request_matches(
        call, ADMIN, method="GET", host="h", target="/", body=b""
    )
    assert response_signed(answer, ADMIN, call, 200, b"{}")
    monkeypatch.setattr(auth.hmac, "compare_digest", never_equal)
    assert not bearer_matches(f"Bearer {ADMIN}", ADMIN)
    assert not signed_request_matches(call, ADMIN, method="GET", host="h", target="/", body=b"")
    assert not response_signed(answer, ADMIN, call, 200, b"{}")
    assert len(compared) == 3 and all(a == b for a, b in compared)  # each one the comparison that decided
