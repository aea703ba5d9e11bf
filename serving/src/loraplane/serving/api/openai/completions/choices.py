"""One API request's choices: a batched prompt list and ``n`` samples each run as one engine
sequence per choice (indexed as OpenAI indexes them, prompt-major), and their outputs come back
as one stream or one list.

Settling is here because it must happen exactly once however the request ends: the usage record
is written before the last event of a finished request, and the request's quota slot and pending
count are released when it ends, finished, failed or abandoned by its client, even one that
leaves before its response starts (``cleanup_response.CleanupResponse``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from loraplane.serving.api.metering import RequestMeter
from loraplane.serving.engine.outputs import RequestOutput
from loraplane.serving.engine.sequence import FinishReason


@dataclass
class Choice:
    index: int
    request_id: str  # the engine's id for this choice's sequence
    stream: AsyncIterator[RequestOutput]
    first: RequestOutput | None = None


class _ChoiceFailed(Exception):
    """One choice ended in an error: the others of a non-streamed request need not finish."""


@dataclass
class Choices:
    choices: list[Choice]
    meter: RequestMeter
    release: Callable[[], None]
    pumps: list[asyncio.Task[None]] = field(default_factory=list)
    closed: bool = False

    def close(self) -> None:
        """Settle and release the request, and abort every choice still running. Synchronous and
        idempotent: it runs in cleanup paths that a client's disconnect has cancelled, where an
        await would be cancelled in turn before anything is released."""
        if self.closed:
            return
        self.closed = True
        self.meter.settle_nowait()
        self.release()
        if self.pumps:  # a cancelled pump's generator aborts its sequence
            for t in self.pumps:
                t.cancel()
        else:  # nobody iterates the streams: close them in a task of their own
            asyncio.get_running_loop().create_task(close_all(self.choices))

    async def drain(self) -> list[RequestOutput]:
        """Every choice's last output, in index order, once its usage record is written. The
        first choice to fail ends the wait: the others are aborted."""

        async def one(c: Choice) -> None:
            async for item in c.stream:
                self.meter.seen(item)
                if item.finish_reason is FinishReason.ERROR:
                    raise _ChoiceFailed

        try:
            async with asyncio.TaskGroup() as group:
                for c in self.choices:
                    group.create_task(one(c))
            await self.meter.settle()
        except* _ChoiceFailed:
            pass
        finally:
            self.close()
        return [self.meter.outputs[c.request_id] for c in self.choices]

    async def deltas(self) -> AsyncIterator[tuple[Choice, RequestOutput, str]]:
        """Each choice's new text as its outputs arrive, interleaved across choices (empty only on
        a choice's final output). The engine's text never takes back what it showed, so a delta
        is the text past what was sent."""
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

        self.pumps = [asyncio.create_task(pump(c)) for c in self.choices]
        sent = {c.index: "" for c in self.choices}
        running = {c.index for c in self.choices}
        try:
            while running:
                c, item = await inbox.get()
                if item is None:
                    running.discard(c.index)
                    continue
                if isinstance(item, BaseException):
                    raise item
                self.meter.seen(item)
                if item.finished and running == {c.index}:
                    await self.meter.settle()  # the last choice: its record before its last event
                text = item.text
                delta = text[len(sent[c.index]) :] if text.startswith(sent[c.index]) else ""
                sent[c.index] += delta
                if delta or item.finished:
                    yield c, item, delta
                if item.finished:
                    running.discard(c.index)
        finally:
            self.close()


async def close_all(choices: list[Choice]) -> None:
    """Abort every choice still running (an async generator's close runs its abort)."""
    for c in choices:
        aclose = getattr(c.stream, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(RuntimeError):  # being iterated: closed by whoever iterates it
                await aclose()
