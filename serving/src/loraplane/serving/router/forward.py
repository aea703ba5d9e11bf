"""Sending one API request to a replica and its answer back, with the failure rules of a proxy
that must not lose accepted work.

- Before the first byte of the answer nothing has been generated for the client, so a replica
  that refuses the connection, drops it, or sheds the request (502/503/504) costs only a retry
  on the next replica; a replica whose connection failed is marked down until it answers again.
  A replica sends a stream's headers when its first output exists and the first event just
  after, so a stream is committed to its replica only once that first chunk of body has come:
  a replica that dies between the two is retried like one that refused the connection.
- After the first byte the stream belongs to that replica. If it dies, the client gets one last
  server-sent event carrying an OpenAI error body (the official clients raise it as an APIError)
  rather than a stream that just stops.

Server-sent events pass through one event at a time, as they arrive. Streams are asked for
their usage chunk so the tenant's token quota can count them; a client that did not ask for it
does not see it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import Response

from loraplane.serving.http.cleanup_response import CleanupResponse
from loraplane.serving.http.errors import APIError, error_body
from loraplane.serving.router.metrics import RouterMetrics
from loraplane.serving.router.policy import Router
from loraplane.serving.router.response_homes import ResponseHomes
from loraplane.serving.router.table import Replica, ReplicaTable

RETRY_ELSEWHERE = {502, 503, 504}
PASSED_HEADERS = ("content-type", "retry-after")
REPLICA_HEADER = "x-loraplane-replica"
LOOKUP_TIMEOUT = 10.0  # seconds for a replica to answer about one stored response

Done = Callable[[dict[str, Any] | None], None]  # called once with the answer's usage (None if unknown)


class Forwarder:
    def __init__(self, table: ReplicaTable, router: Router, metrics: RouterMetrics, client: httpx.AsyncClient) -> None:
        self.table, self.router, self.metrics, self.client = table, router, metrics, client
        self._closing: set[asyncio.Task[None]] = set()  # upstream responses closing after their client left
        self.homes = ResponseHomes()  # the replica keeping each stored response it has seen

    async def _open(
        self, path: str, body: bytes, headers: dict[str, str], model: str, streaming: bool, prefer: str | None
    ) -> tuple[Replica, httpx.Response, AsyncIterator[bytes] | None]:
        """The replica that took the request, its response and, for a stream it accepted, the
        stream's body with its first chunk already read (None otherwise). ``prefer``: a replica
        tried first when it is up (the one keeping the stored response the request goes on from)."""
        tried: set[str] = set()
        failures: list[str] = []
        while True:
            left = [r for r in self.table.up() if r.name not in tried]
            preferred = [r for r in left if r.name == prefer]
            route = (preferred[0], "stored_response") if preferred else self.router.choose(model, left)
            if route is None:
                why = "; ".join(failures) or "none is up"
                raise APIError(503, f"no serving replica could take the request ({why})", type_="server_error",
                               code="no_replica", retry_after=1)  # fmt: skip
            replica, decision = route
            tried.add(replica.name)
            self.table.sent(replica, model)
            response: httpx.Response | None = None
            try:
                request = self.client.build_request("POST", f"{replica.url}{path}", content=body, headers=headers)
                response = await self.client.send(request, stream=True)
                body_stream = await _first_chunk_read(response) if streaming and response.status_code == 200 else None
            except httpx.TransportError as err:
                if response is not None:
                    await response.aclose()
                replica.in_flight -= 1
                self.table.mark_down(replica, repr(err))
                self.metrics.retries.labels(replica.name).inc()
                failures.append(f"{replica.name}: {type(err).__name__}{'' if response is None else ' before the first byte'}")
                continue
            except BaseException:  # cancelled (the client went away): give back what this attempt holds
                replica.in_flight -= 1  # first: a second cancel may land in the await below
                if response is not None:
                    await response.aclose()
                raise
            # The replica keeping a stored response is the only one that can answer a request going
            # on from it: its 5xx (busy, say) goes back to be retried, not elsewhere to be a 400.
            more = decision != "stored_response" and any(r.name not in tried for r in self.table.up())
            if response.status_code in RETRY_ELSEWHERE and more:
                await response.aclose()
                replica.in_flight -= 1
                if response.status_code != 503:  # 503 is a replica shedding load, not a broken one
                    self.table.mark_down(replica, f"answered {response.status_code}")
                self.metrics.retries.labels(replica.name).inc()
                failures.append(f"{replica.name}: {response.status_code}")
                continue
            self.metrics.routed.labels(replica.name, decision).inc()
            return replica, response, body_stream

    async def ask_any(self, path: str, headers: dict[str, str], body: bytes | None = None) -> httpx.Response | None:
        """A call that only reads (a GET, or with ``body`` a POST to vLLM's tokenizer routes),
        answered by one replica of the shared base that is up, the least busy first (every one
        serves the same adapters; the operator sees to it; a dedicated replica would list only its
        own model); None when none answers."""
        for replica in sorted(self.table.shared(), key=lambda r: r.in_flight):
            try:
                if body is not None:
                    return await self.client.post(f"{replica.url}{path}", headers=headers, content=body)
                return await self.client.get(f"{replica.url}{path}", headers=headers)
            except httpx.TransportError as err:
                self.table.mark_down(replica, repr(err))
        return None

    async def ask_each(
        self, method: str, path: str, headers: dict[str, str], first: str | None
    ) -> tuple[Replica, httpx.Response] | None:
        """A call about one stored response: the replica ``first`` (the one known to keep it),
        then the others that are up, until one answers below 400 or with a 4xx other than 404.
        The replica that answered and its answer; when none did, a 5xx if one answered so (the
        keeper may be busy: the caller retries), else the last 404; None when none answers.
        Each is given ``LOOKUP_TIMEOUT`` seconds, so one stuck replica does not hold the call."""
        replicas = sorted(self.table.up(), key=lambda r: (r.name != first, r.in_flight))
        failed = missing = None
        for replica in replicas:
            try:
                answer = await self.client.request(method, f"{replica.url}{path}", headers=headers, timeout=LOOKUP_TIMEOUT)
            except httpx.TransportError as err:
                self.table.mark_down(replica, repr(err))
                continue
            if answer.status_code == 404:
                missing = replica, answer
            elif answer.status_code >= 500:
                failed = failed or (replica, answer)
            else:
                return replica, answer
        return failed or missing

    async def home_of(self, response_id: str, headers: dict[str, str]) -> str | None:
        """The replica keeping a stored response: known, or found by asking (with the caller's
        key, so only the caller's own response is found)."""
        home = self.homes.home(response_id)
        if home is None:
            found = await self.ask_each("GET", f"/v1/responses/{quote(response_id, safe='')}", headers, None)
            if found is not None and found[1].status_code == 200:
                home = found[0].name
                self.homes.learn(response_id, home)
        return home

    async def post(
        self, path: str, payload: dict[str, Any], headers: dict[str, str], done: Done, *, ask_usage: bool = True,
        prefer: str | None = None,
    ) -> Response:  # fmt: skip
        """Forward a generation. ``ask_usage``: a stream carries its usage only when asked
        (chat and completions' ``stream_options``), so it is asked for, and the usage chunk
        relayed only to a caller that asked too; the Responses API's final event always has it.
        ``prefer``: the replica tried first. The ids of the Responses API's answers are learned
        (``homes``), for the requests that go on from them."""
        model = payload.get("model")
        if not isinstance(model, str):
            raise APIError(400, "model: a model name is required", code="invalid_request", param="model")
        streaming = payload.get("stream") is True
        strip_usage = False
        if ask_usage and streaming and isinstance(payload.get("stream_options") or {}, dict):
            options = dict(payload.get("stream_options") or {})
            strip_usage = not options.get("include_usage")
            payload = {**payload, "stream_options": {**options, "include_usage": True}}
        replica, response, body_stream = await self._open(path, json.dumps(payload).encode(), headers, model, streaming, prefer)
        passed = {k: v for k, v in response.headers.items() if k.lower() in PASSED_HEADERS}
        passed[REPLICA_HEADER] = replica.name
        if body_stream is not None:
            settlement = _Settlement(replica, done)

            def cleanup() -> None:  # after the response, however it ended (see CleanupResponse)
                settlement.settle()
                if not response.is_closed:
                    closing = asyncio.get_running_loop().create_task(response.aclose())
                    self._closing.add(closing)
                    closing.add_done_callback(self._closing.discard)

            events = self._relay(response, body_stream, strip_usage, settlement)
            return CleanupResponse(events, cleanup, status_code=200, headers=passed)
        try:
            content = await response.aread()
        except httpx.TransportError as err:
            self.table.mark_down(replica, repr(err))
            raise APIError(502, f"replica {replica.name} failed while answering", type_="server_error",
                           code="upstream_failed") from None  # fmt: skip
        finally:
            replica.in_flight -= 1
            await response.aclose()
        usage = None
        if response.status_code == 200:
            try:
                answer = json.loads(content)
                usage = answer.get("usage")
            except (ValueError, AttributeError):
                answer = None
            if isinstance(answer, dict) and answer.get("object") == "response" and isinstance(answer.get("id"), str):
                self.homes.learn(answer["id"], replica.name)
        done(usage)
        return Response(content, status_code=response.status_code, headers=passed)

    async def _relay(
        self, response: httpx.Response, body: AsyncIterator[bytes], strip_usage: bool, settlement: _Settlement
    ) -> AsyncIterator[bytes]:
        replica = settlement.replica
        pending = b""
        try:
            async for chunk in body:
                pending += chunk
                while b"\n\n" in pending:
                    event, pending = pending.split(b"\n\n", 1)
                    if event.startswith(CREATED_EVENT) and (rid := _response_id(event)) is not None:
                        self.homes.learn(rid, replica.name)
                    found = _usage_of(event)
                    if found is not None:
                        settlement.usage = found
                        if strip_usage and not event.startswith(ENDING_EVENTS):
                            continue
                    yield event + b"\n\n"
            if pending:
                yield pending
        except httpx.TransportError as err:
            self.table.mark_down(replica, repr(err))
            self.metrics.broken_streams.labels(replica.name).inc()
            failure = error_body(f"replica {replica.name} failed mid-stream ({type(err).__name__}); the answer is incomplete",
                                 "server_error", "upstream_failed")  # fmt: skip
            yield f"data: {json.dumps(failure)}\n\n".encode()
        finally:  # the bookkeeping first: a cancel (the client gone) may land in the await
            settlement.settle()
            await response.aclose()


class _Settlement:
    """A streamed answer's bookkeeping, done once however the stream ends: the replica's in-flight
    count and the caller's ``done`` with the usage relayed so far. The body's ``finally`` settles it
    when it ends; the response's cleanup when the body never started, or was left suspended at a
    ``yield`` (Starlette does not close a body it stopped sending), with the usage seen by then."""

    def __init__(self, replica: Replica, done: Done) -> None:
        self.replica, self.done = replica, done
        self.usage: dict[str, Any] | None = None
        self.settled = False

    def settle(self) -> None:
        if not self.settled:
            self.settled = True
            self.replica.in_flight -= 1
            self.done(self.usage)


async def _first_chunk_read(response: httpx.Response) -> AsyncIterator[bytes]:
    """The response's raw body with its first chunk read now: a transport error before any byte
    raises here, where the request can still go elsewhere."""
    raw = response.aiter_raw()
    try:
        head = await anext(raw)
    except StopAsyncIteration:
        head = b""

    async def rest() -> AsyncIterator[bytes]:
        if head:
            yield head
        async for chunk in raw:
            yield chunk

    return rest()


CREATED_EVENT = b"event: response.created\n"
ENDING_EVENTS = (b"event: response.completed\n", b"event: response.incomplete\n", b"event: response.failed\n")


def _response_id(event: bytes) -> str | None:
    """The id of the response a Responses stream's ``response.created`` event opens."""
    _, _, data_line = event.partition(b"\ndata: ")
    try:
        rid = json.loads(data_line)["response"]["id"]
    except (ValueError, KeyError, TypeError):
        return None
    return rid if isinstance(rid, str) else None


def _usage_of(event: bytes) -> dict[str, Any] | None:
    """The usage of a stream's final usage-only chunk, or of a Responses stream's last event
    (its response's), or None for any other event. Only the usage-only chunk is one a caller
    may not have asked for."""
    if event.startswith(ENDING_EVENTS):
        _, _, data_line = event.partition(b"\ndata: ")
        try:
            usage = json.loads(data_line).get("response", {}).get("usage")
        except (ValueError, AttributeError):
            return None
        return usage if isinstance(usage, dict) else None
    if not event.startswith(b"data: {") or b'"usage"' not in event:
        return None
    try:
        data = json.loads(event[6:])
    except ValueError:
        return None
    usage = data.get("usage")
    return usage if isinstance(usage, dict) and data.get("choices") == [] else None
