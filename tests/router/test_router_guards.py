"""What the router refuses on its own, before any replica is chosen: its admin view without the
token, and bodies past the replicas' cap (so a huge body costs the edge, not a replica)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from loraplane.serving.http.body_limit import DEFAULT_MAX_BODY_BYTES
from loraplane.serving.http.loopback import serve_app
from loraplane.serving.http.tenants import Tenants, TenantsFile
from loraplane.serving.router.app import create_router_app
from loraplane.serving.router.config import RouterConfig

ADMIN = "router-admin"
TENANTS = TenantsFile.model_validate({"tenants": [{"name": "acme", "api_keys": ["key-acme"]}]}).tenants


@pytest.fixture(scope="module")
def router() -> Iterator[str]:
    # A replica address nothing listens on: every refusal below must come before forwarding.
    app = create_router_app(RouterConfig(replicas=["http://127.0.0.1:9"]), tenants=Tenants(TENANTS), admin_token=ADMIN)
    with serve_app(app, ready_path="/health") as url:
        yield url


def test_the_replica_table_needs_the_admin_token(router: str) -> None:
    for headers in ({}, {"Authorization": "Bearer key-acme"}, {"Authorization": f"Bearer {ADMIN}x"}):
        r = httpx.get(f"{router}/router/replicas", headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["type"] and "replicas" not in r.json()
    assert httpx.get(f"{router}/router/replicas", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200


def test_a_body_past_the_cap_is_refused_at_the_edge_with_413(router: str) -> None:
    headers = {"Authorization": "Bearer key-acme", "Content-Type": "application/json"}
    huge = b'{"model": "x", "prompt": "' + b"a" * (DEFAULT_MAX_BODY_BYTES + 1) + b'"}'
    r = httpx.post(f"{router}/v1/completions", content=huge, headers=headers, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text

    def chunks() -> Iterator[bytes]:  # no Content-Length: the cap counts what arrives
        yield b'{"model": "x", "prompt": "'
        for _ in range(DEFAULT_MAX_BODY_BYTES // (1 << 20) + 2):
            yield b"a" * (1 << 20)
        yield b'"}'

    r = httpx.post(f"{router}/v1/chat/completions", content=chunks(), headers=headers, timeout=60)
    assert r.status_code == 413, r.text


def test_a_model_name_past_its_bound_is_a_400_and_its_refusal_record_stays_small(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A refused request's usage record carries what it named: a client's multi-MiB ``model`` is
    refused by its field's bound first, so nothing of it reaches the billing spool."""
    import json

    from loraplane.usage import Metering

    usage = tmp_path / "usage"
    app = create_router_app(
        RouterConfig(replicas=["http://127.0.0.1:9"]), tenants=Tenants(TENANTS), metering=Metering.create("rtr", usage)
    )
    with serve_app(app, ready_path="/health") as url:
        headers = {"Authorization": "Bearer key-acme"}
        r = httpx.post(f"{url}/v1/completions", json={"model": "m" * 3_000_000, "prompt": "hi"}, headers=headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        r = httpx.post(f"{url}/tokenize", json={"model": "m" * 3_000_000, "prompt": "hi"}, headers=headers, timeout=60)
        assert r.status_code == 400, r.text
    written = sum(p.stat().st_size for p in usage.rglob("*") if p.is_file())
    assert written < 10_000, f"{written} bytes of usage records"
    for line in (line for p in usage.rglob("*.jsonl*") for line in p.read_text().splitlines()):
        assert len(json.loads(line).get("model", "")) <= 1024


def test_the_edge_reserves_what_a_request_may_really_use() -> None:
    """Without ``max_tokens`` a chat may write up to the context, and a Responses call going on
    from a stored response carries a conversation the edge cannot see: each reserves the context,
    not the few tokens its body shows (a tenant could otherwise run far past its quota)."""
    from loraplane.serving.http.protocol.chat import ChatCompletionRequest
    from loraplane.serving.http.protocol.completions import CompletionRequest
    from loraplane.serving.router.edge import estimate_tokens

    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi " * 40}]})
    assert estimate_tokens(chat, 4096) == 30 + (4096 - 30)
    assert estimate_tokens(chat.model_copy(update={"max_tokens": 10}), 4096) == 40
    assert estimate_tokens(CompletionRequest.model_validate({"model": "m", "prompt": "x" * 40}), 4096) == 10 + 16
    assert estimate_tokens(chat.model_copy(update={"n": 2, "max_tokens": 10}), 4096, going_on=True) == 2 * 4096
