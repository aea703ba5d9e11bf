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
