"""The forwarder's failure rules at the one moment the replica tests cannot hit on purpose: a replica
that has sent a stream's headers and dies before the first byte of its body. Replicas here are
httpx mock transports, so the moment of death is exact."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client import CollectorRegistry
from starlette.requests import ClientDisconnect

from loraplane.serving.router.forward import Forwarder
from loraplane.serving.router.metrics import RouterMetrics
from loraplane.serving.router.policy import Router
from loraplane.serving.router.table import ReplicaTable

EVENTS = [b'data: {"choices": [{"text": "hi"}]}\n\n', b"data: [DONE]\n\n"]


class DiesAfter(httpx.AsyncByteStream):
    """A body that yields ``sent`` events, then breaks like a killed replica's connection."""

    def __init__(self, sent: int) -> None:
        self.sent = sent

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in EVENTS[: self.sent]:
            yield event
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


def serve_stream(dying: dict[str, int]) -> tuple[Forwarder, ReplicaTable, list[str], CollectorRegistry]:
    """Two replicas, ``r0`` (tried first: round-robin) and ``r1``; a replica named in ``dying``
    answers 200 with the headers and dies after that many events, the others stream the whole
    answer. Also returns the registry of the router's metrics."""
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        name = request.url.host
        asked.append(name)
        stream = DiesAfter(dying[name]) if name in dying else httpx.ByteStream(b"".join(EVENTS))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)

    table, registry = ReplicaTable(), CollectorRegistry()
    table.set_members({"r0": "http://r0", "r1": "http://r1"})
    forwarder = Forwarder(
        table, Router("round-robin"), RouterMetrics(table, registry), httpx.AsyncClient(transport=httpx.MockTransport(handler))
    )
    return forwarder, table, asked, registry


async def read_stream(forwarder: Forwarder) -> bytes:
    payload = {"model": "m", "prompt": "p", "stream": True}
    response = await forwarder.post("/v1/completions", payload, {}, lambda usage: None)
    return b"".join([chunk async for chunk in response.body_iterator])  # type: ignore[attr-defined, misc]


def test_a_replica_that_dies_after_its_headers_but_before_any_byte_is_retried_elsewhere() -> None:
    forwarder, table, asked, registry = serve_stream({"r0": 0})
    body = asyncio.run(read_stream(forwarder))
    assert asked == ["r0", "r1"]
    assert body == b"".join(EVENTS), body  # the client sees one whole answer, no error event
    assert table.replicas["r0"].up is False and table.replicas["r0"].in_flight == 0
    assert registry.get_sample_value("loraplane_router_retries_total", {"replica": "r0"}) == 1


def test_a_replica_that_dies_after_the_first_byte_ends_the_stream_with_an_error_event() -> None:
    forwarder, table, asked, _ = serve_stream({"r0": 1})
    body = asyncio.run(read_stream(forwarder))
    assert asked == ["r0"]  # the answer had started: it cannot be sent twice
    events = body.split(b"\n\n")
    assert events[0] + b"\n\n" == EVENTS[0]
    error = json.loads(events[1].removeprefix(b"data: "))["error"]
    assert "failed mid-stream" in error["message"] and error["code"] == "upstream_failed"
    assert table.replicas["r0"].up is False and table.replicas["r0"].in_flight == 0


class Stalls(httpx.AsyncByteStream):
    """A body whose first byte never comes before the test gives up; notes that it was closed."""

    def __init__(self) -> None:
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        await asyncio.sleep(60)
        yield EVENTS[0]

    async def aclose(self) -> None:
        self.closed = True


def test_a_client_that_goes_away_before_the_answer_begins_leaves_nothing_held_on_the_replica() -> None:
    """Cancelled while the replica queues it (no headers yet), or after the headers but before the
    first byte: either way the replica's in-flight count comes back and the response is closed."""
    for stage in ("before the headers", "before the first byte"):
        body = Stalls()

        async def handler(request: httpx.Request, stage: str = stage, body: Stalls = body) -> httpx.Response:
            if stage == "before the headers":
                await asyncio.sleep(60)
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=body)

        table = ReplicaTable()
        table.set_members({"r0": "http://r0"})
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        forwarder = Forwarder(table, Router("round-robin"), RouterMetrics(table, CollectorRegistry()), client)

        async def scenario(forwarder: Forwarder = forwarder) -> None:
            task = asyncio.create_task(read_stream(forwarder))
            await asyncio.sleep(0.05)
            assert forwarder.table.replicas["r0"].in_flight == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(scenario())
        assert table.replicas["r0"].in_flight == 0, stage
        assert table.replicas["r0"].up, stage  # a client leaving says nothing about the replica
        assert body.closed == (stage == "before the first byte")


def test_a_client_gone_before_the_stream_starts_leaves_nothing_held() -> None:
    """The handler has returned the stream, and the client leaves before Starlette sends a byte
    of it: Starlette then never starts the body, so a cleanup written only in the body would
    never run, and the replica's in-flight count and the tenant's reservation would stay taken."""
    forwarder, table, _, _ = serve_stream({})
    settled: list[object] = []

    async def gone() -> dict[str, str]:
        return {"type": "http.disconnect"}

    async def nowhere(message: object) -> None:
        await asyncio.sleep(0)

    async def scenario() -> None:
        payload = {"model": "m", "prompt": "p", "stream": True}
        response = await forwarder.post("/v1/completions", payload, {}, settled.append)
        assert table.replicas["r0"].in_flight == 1
        await response({"type": "http", "asgi": {"spec_version": "2.3"}}, gone, nowhere)

    asyncio.run(scenario())
    assert table.replicas["r0"].in_flight == 0
    assert len(settled) == 1  # the reservation went back, once


def test_a_stream_cut_off_in_a_send_settles_with_the_usage_relayed_so_far() -> None:
    """Starlette stops sending when a send fails (a server that says so with OSError) and leaves
    the body suspended at its ``yield``, not closed: the cleanup after the response settles it,
    with the usage the stream had carried, so the tenant's token quota counts what was used."""
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    events = [EVENTS[0], f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode(), EVENTS[1]]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=httpx.ByteStream(b"".join(events)))

    table = ReplicaTable()
    table.set_members({"r0": "http://r0"})
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    forwarder = Forwarder(table, Router("round-robin"), RouterMetrics(table, CollectorRegistry()), client)
    settled: list[object] = []
    sent: list[object] = []

    async def listening() -> dict[str, str]:
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    async def fails_at_the_third(message: object) -> None:
        sent.append(message)
        if len(sent) == 3:  # the headers, the first event, then the usage event's send fails
            raise OSError("the client's connection is gone")

    async def scenario() -> None:
        payload = {"model": "m", "prompt": "p", "stream": True, "stream_options": {"include_usage": True}}
        response = await forwarder.post("/v1/completions", payload, {}, settled.append)
        with pytest.raises(ClientDisconnect):
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, listening, fails_at_the_third)

    asyncio.run(scenario())
    assert table.replicas["r0"].in_flight == 0
    assert settled == [usage]


def keeper_and_other(answers: dict[str, int]) -> tuple[Forwarder, list[str]]:
    """Two replicas whose every answer has the status ``answers`` gives them (the body says which)."""
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.host)
        return httpx.Response(answers[request.url.host], json={"id": "resp_1", "object": "response", "replica": request.url.host})

    table = ReplicaTable()
    table.set_members({"r0": "http://r0", "r1": "http://r1"})
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return Forwarder(table, Router("round-robin"), RouterMetrics(table, CollectorRegistry()), client), asked


def test_a_busy_keeper_of_a_stored_response_is_answered_back_not_passed_over() -> None:
    """A request going on from a stored response goes to the replica keeping it. Its 503 (busy)
    goes back to the caller, who retries: any other replica would answer that the response does
    not exist, a 400 the caller would not retry. Without a keeper, a 503 is retried elsewhere."""
    payload = {"model": "m", "input": "more", "previous_response_id": "resp_1"}
    forwarder, asked = keeper_and_other({"r0": 200, "r1": 503})
    answer = asyncio.run(forwarder.post("/v1/responses", payload, {}, lambda usage: None, ask_usage=False, prefer="r1"))
    assert answer.status_code == 503 and asked == ["r1"]
    asked.clear()
    answer = asyncio.run(forwarder.post("/v1/responses", payload, {}, lambda usage: None, ask_usage=False))
    assert answer.status_code == 200 and asked[-1] == "r0"


def test_a_stored_response_is_looked_up_past_replicas_that_do_not_keep_it() -> None:
    """Which replica keeps an id it has not seen: the router asks each, the one answering 200
    keeps it (and is remembered); one busy replica's 5xx does not hide the keeper behind it, and
    when nobody answers 200 the busy one's 5xx is what the caller gets, to retry."""
    forwarder, asked = keeper_and_other({"r0": 503, "r1": 200})
    assert asyncio.run(forwarder.home_of("resp_1", {})) == "r1" and set(asked) == {"r0", "r1"}
    asked.clear()
    assert asyncio.run(forwarder.home_of("resp_1", {})) == "r1" and asked == []  # remembered
    forwarder, asked = keeper_and_other({"r0": 503, "r1": 404})
    found = asyncio.run(forwarder.ask_each("GET", "/v1/responses/resp_1", {}, None))
    assert found is not None and found[1].status_code == 503
    forwarder, _ = keeper_and_other({"r0": 404, "r1": 404})
    found = asyncio.run(forwarder.ask_each("GET", "/v1/responses/resp_1", {}, None))
    assert found is not None and found[1].status_code == 404
    assert asyncio.run(forwarder.home_of("resp_1", {})) is None
