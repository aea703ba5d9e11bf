"""Run the engine on its own thread and hand results to asyncio request handlers.

The engine is single-threaded by design (its scheduler, slots and KV cache have one owner), so
every call, from adding a request to pinning an adapter, is posted to the engine thread and
awaited. The thread steps whenever there is work and sleeps on its inbox otherwise. Each request
gets an asyncio queue that receives its outputs as they are produced; a handler that goes away
(client disconnect) aborts its request, which frees its sequence and KV blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from loraplane.serving.engine.llm_engine import LLMEngine
from loraplane.serving.engine.outputs import RequestOutput
from loraplane.serving.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # engine thread --------------------------------------------------------------------------
    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as err:  # handed to the awaiting handler
                    future.set_exception(err)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_unfinished())
            if not self.engine.has_unfinished():
                if self.engine.adapters.loads_in_flight():
                    self.engine.adapters.poll()  # a prefetch lands in host memory with no request waiting for it
                continue
            try:
                outputs = self.engine.step()
            except Exception as err:  # a bug: fail the running requests rather than hang them
                log.exception("engine step failed")
                for rid in list(self._streams):
                    self._deliver(rid, err)
                    self.engine.abort(rid)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
            if not self.engine.ran and not outputs and not self.engine.adapters.loads_in_flight():
                # Requests wait with nothing to run and no load to land (a slot held by busy
                # adapters, a load backing off): sleep on the inbox rather than spin; a new call
                # wakes it at once. A load in flight is waited for inside the step instead, so the
                # step after it lands runs without this pause.
                self._drain(block=True)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, q = target
        if isinstance(item, BaseException) or item.finished:
            self._streams.pop(request_id, None)
        loop.call_soon_threadsafe(q.put_nowait, item)

    # callers --------------------------------------------------------------------------------
    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between steps and return its result (or raise its error)."""
        future: Future[T] = Future()
        self._inbox.put((fn, future))
        return await asyncio.wrap_future(future)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, adapter: str | None, request_id: str, tenant: str | None = None,
        after: str | None = None, cache_scope: str | None = None,
    ) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """Outputs of one request as the engine produces them; the last one has ``finished``.
        ``after`` and ``cache_scope`` are ``LLMEngine.add_request``'s."""
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def add() -> str:
            self._streams[request_id] = (loop, q)
            try:
                return self.engine.add_request(
                    prompt, params, adapter=adapter, request_id=request_id, tenant=tenant, after=after, cache_scope=cache_scope
                )
            except BaseException:
                self._streams.pop(request_id, None)
                raise

        await self.call(add)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # the client went away or the handler failed: free the sequence now
                self._streams.pop(request_id, None)
                self._inbox.put((lambda: self.engine.abort(request_id), Future()))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop after the requests in flight finish (or ``timeout`` passes)."""
        deadline = threading.Event()
        waited = 0.0
        while self._streams and waited < timeout:
            deadline.wait(0.1)
            waited += 0.1
        self._stop.set()
        self._thread.join(timeout=5)
        self.engine.adapters.close()
