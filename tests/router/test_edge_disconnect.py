"""A client that hangs up gives its quota back at the edge: the router reserves a tenant's
concurrency (and tokens) when it admits a request, and a client that leaves mid-stream, or
before the replica has answered at all, must not keep holding them. Real uvicorn servers on
loopback, so the disconnect is the one a client's socket makes, not a cancelled task."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from loraplane.serving.http.disconnect import cancel_on_disconnect
from loraplane.serving.http.loopback import serve_app
from loraplane.serving.http.tenants import Tenants, TenantsFile
from loraplane.serving.router.app import create_router_app
from loraplane.serving.router.config import RouterConfig

KEY = {"Authorization": "Bearer key-acme"}
TENANTS = TenantsFile.model_validate({"tenants": [{"name": "acme", "api_keys": ["key-acme"], "max_concurrent": 1}]}).tenants


def slow_replica(seen: dict[str, int]) -> FastAPI:
    """A replica that streams one event every 50 ms for a minute, or with ``"stall"`` as the
    prompt sends nothing at all for a minute, unless its client leaves (it cancels on disconnect,
    as a real replica does); a request that does not stream gets its answer at once. ``seen``
    counts the streams that ended and the stalls that were cancelled."""
    app = FastAPI()

    @app.get("/ready")
    async def ready() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models/{model}")
    async def model(model: str) -> dict[str, str]:
        return {"id": model, "object": "model"}

    @app.post("/v1/completions")
    @cancel_on_disconnect
    async def completions(body: dict[str, object], request: Request) -> Response:
        if body.get("prompt") == "stall":
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                seen["stalls cancelled"] = seen.get("stalls cancelled", 0) + 1
                raise
        if not body.get("stream"):
            usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
            return JSONResponse({"id": "cmpl-1", "object": "text_completion", "choices": [], "usage": usage})

        async def events() -> AsyncIterator[bytes]:
            try:
                for _ in range(1200):
                    yield b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
                    await asyncio.sleep(0.05)
            finally:
                seen["streams ended"] = seen.get("streams ended", 0) + 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def router() -> Iterator[tuple[str, dict[str, int]]]:
    seen: dict[str, int] = {}
    with serve_app(slow_replica(seen)) as replica:
        config = RouterConfig(replicas=[replica], stats_interval=0.2)
        with serve_app(create_router_app(config, tenants=Tenants(TENANTS), admin_token=None)) as url:
            yield url, seen


def admitted_again(url: str, timeout: float = 10.0) -> httpx.Response:
    """The tenant's next request, asked until it is not refused for concurrency (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 1}, headers=KEY, timeout=30)
        if r.status_code != 429 or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return check()


def test_a_client_that_hangs_up_mid_stream_gives_its_concurrency_back(router: tuple[str, dict[str, int]]) -> None:
    url, seen = router
    body = {"model": "m", "prompt": "p", "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", f"{url}/v1/completions", json=body, headers=KEY) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a line iterator dropped half-read closes the connection
        assert next(lines).startswith("data: ")
        # The one request the tenant may have in flight is this one.
        refused = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "p"}, headers=KEY, timeout=30)
        assert next(line for line in lines if line).startswith("data: ")  # still streaming
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "concurrency_limit"
    # The stream was closed with most of its minute to go: the slot comes back, and the
    # replica's stream is closed too, not left generating for nobody.
    r = admitted_again(url)
    assert r.status_code == 200, r.text
    assert eventually(lambda: seen.get("streams ended", 0) >= 1)


def test_a_client_that_hangs_up_before_the_replica_answers_gives_its_concurrency_back(
    router: tuple[str, dict[str, int]],
) -> None:
    url, seen = router
    with pytest.raises(httpx.ReadTimeout):  # the replica sends nothing for a minute; the client leaves after 1 s
        httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "stall", "stream": True}, headers=KEY, timeout=1)
    r = admitted_again(url)
    assert r.status_code == 200, r.text
    # The router closed its request to the replica, which let go of it in turn.
    assert eventually(lambda: seen.get("stalls cancelled") == 1)
