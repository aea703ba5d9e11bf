"""One API request's choices: a batched prompt list and ``n`` samples each run as one engine
sequence per choice (indexed as OpenAI indexes them, prompt-major), and their outputs come back
as one stream or one list.

Settling is here because it must happen exactly once however the request ends: the usage record
is written before the last event of a finished request, and the request's quota slot and pending
count are released when the stream closes, finished, failed or abandoned by its client.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from loraplane.serving.api.metering import RequestMeter
from loraplane.serving.engine.llm_engine import RequestOutput


@dataclass
class Choice:
    index: int
    request_id: str  # the engine's id for this choice's sequence
    stream: AsyncIterator[RequestOutput]
    first: RequestOutput | None = None


async def close_all(choices: list[Choice]) -> None:
    """Abort every choice still running (an async generator's close runs its abort)."""
    for c in choices:
        aclose = getattr(c.stream, "aclose", None)
        if aclose is not None:
            await aclose()


async def drain(choices: list[Choice], meter: RequestMeter, release: Callable[[], None]) -> list[RequestOutput]:
    """Every choice's last output, in index order, once its usage record is written."""

    async def one(c: Choice) -> None:
        async for item in c.stream:
            meter.seen(item)

    try:
        await asyncio.gather(*(one(c) for c in choices))
        await meter.settle()
    finally:
        meter.settle_nowait()  # a cancelled request (its client went away) still leaves a record
        release()
    return [meter.outputs[c.request_id] for c in choices]


async def deltas(
    choices: list[Choice], meter: RequestMeter, release: Callable[[], None]
) -> AsyncIterator[tuple[Choice, RequestOutput, str]]:
    """Each choice's new text as its outputs arrive, interleaved across choices (empty only on a
    choice's final output). The engine's text never takes back what it showed, so a delta is the
    text past what was sent."""
    inbox: asyncio.Queue[tuple[Choice, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            if c.first is not None:
                inbox.put_nowait((c, c.first))
            async for item in c.stream:
                inbox.put_nowait((c, item))
        except Exception as err:  # handed to the consumer, which raises it in the response
            inbox.put_nowait((c, err))
        finally:
            inbox.put_nowait((c, None))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    sent = {c.index: "" for c in choices}
    running = {c.index for c in choices}
    try:
        while running:
            c, item = await inbox.get()
            if item is None:
                running.discard(c.index)
                continue
            if isinstance(item, BaseException):
                raise item
            meter.seen(item)
            if item.finished and running == {c.index}:
                await meter.settle()  # the last choice: its record before its last event
            text = item.text
            delta = text[len(sent[c.index]) :] if text.startswith(sent[c.index]) else ""
            sent[c.index] += delta
            if delta or item.finished:
                yield c, item, delta
            if item.finished:
                running.discard(c.index)
    finally:
        # Nothing here awaits: a client that hung up cancels this generator, and an await in its
        # cleanup would be cancelled in turn before the request is released. A cancelled pump
        # aborts its engine sequence on its own.
        meter.settle_nowait()
        release()
        for t in tasks:
            t.cancel()
