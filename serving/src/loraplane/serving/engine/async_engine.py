"""Run the engine on its own thread and hand results to asyncio request handlers.

The engine is single-threaded by design (its scheduler, slots and KV cache have one owner), so
every call, from adding a request to pinning an adapter, is posted to the engine thread and
awaited. The thread steps whenever there is work and sleeps on its inbox otherwise. New requests
have an inbox of their own, which the thread also reads between the layers of a step in flight:
a request of a tenant below its fair share can then run at once (``LLMEngine.interject``)
instead of waiting for a burster's step to end. Each request gets an asyncio queue that receives
its outputs as they are produced; a handler that goes away (client disconnect) aborts its
request, which frees its sequence and KV blocks at once.
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


def _wake() -> None:
    """Posted to the inbox beside an arrival: the thread's wait on the inbox ends at once."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        # ``add_request`` calls only: the one kind of call that is safe in the middle of a step
        # (it queues a sequence and may start its adapter's load, but changes no running
        # sequence, block or adapter slot).
        self._arrivals: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]] = {}
        engine.between_layers = self._between_layers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # engine thread --------------------------------------------------------------------------
    @staticmethod
    def _call(fn: Callable[[], Any], future: Future[Any]) -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as err:  # handed to the awaiting handler
                future.set_exception(err)

    def _drain_arrivals(self) -> bool:
        """Queue the requests that arrived; whether there were any."""
        arrived = False
        while True:
            try:
                fn, future = self._arrivals.get_nowait()
            except queue.Empty:
                return arrived
            self._call(fn, future)
            arrived = True

    def _drain(self, block: bool) -> None:
        """Run the calls waiting, arrivals first; with ``block``, wait a little for one (an
        arrival also posts a no-op to the inbox, to wake this wait)."""
        block = not self._drain_arrivals() and block
        while True:
            try:
                item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            except queue.Empty:
                break
            self._call(*item)
            block = False
        self._drain_arrivals()

    def _between_layers(self) -> None:
        """Inside a step, after one of its layers: queue the requests that arrived since it began
        and let the engine run those of tenants below their share now (``LLMEngine.interject``,
        which fails only the requests it ran if their forward pass fails; the engine also keeps
        an error here from reaching the step in flight)."""
        if not self._drain_arrivals():
            return
        for out in self.engine.interject():
            self._deliver(out.request_id, out)

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
    async def call(self, fn: Callable[[], T], *, arrival: bool = False) -> T:
        """Run ``fn`` on the engine thread between steps and return its result (or raise its
        error). An ``arrival`` (queueing a request, nothing else) may also run inside a step."""
        future: Future[T] = Future()
        if arrival:
            self._arrivals.put((fn, future))
            self._inbox.put((_wake, Future()))  # an idle engine thread sleeps on the inbox
        else:
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

        refused = False  # the engine refused the request: the id may be another request's

        def add() -> str:
            nonlocal refused
            self._streams[request_id] = (loop, q)
            try:
                return self.engine.add_request(
                    prompt, params, adapter=adapter, request_id=request_id, tenant=tenant, after=after, cache_scope=cache_scope
                )
            except BaseException:
                refused = True
                self._streams.pop(request_id, None)
                raise

        finished = False
        try:
            # Inside the try: a handler cancelled while its request is being added still aborts
            # it (the abort runs after the add on the engine thread; of a request never added,
            # it is a no-op).
            await self.call(add, arrival=True)
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished and not refused:  # the client went away or the handler failed: free it now
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
