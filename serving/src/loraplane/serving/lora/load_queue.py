"""The loader pool: loads from cold storage run on a few threads, one per adapter however many
requests wait for it, and a transient failure is retried with backoff when a request next needs
the adapter. The engine thread starts loads and collects finished ones between steps; the pool's
threads touch nothing but the loader."""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from loraplane.adapter_format import AdapterValidationError
from loraplane.serving.lora.entries import AdapterEntry, Fetched
from loraplane.serving.lora.loader import AdapterLoader

# A transient load failure (the store unreachable, a dropped connection) is retried after
# RETRY_BASE * 2**(failures - 1) seconds, at most RETRY_MAX, when a request next needs it.
RETRY_BASE, RETRY_MAX = 0.5, 60.0


class LoadQueue:
    def __init__(self, loader: AdapterLoader, max_loads_in_flight: int) -> None:
        self.loader = loader
        self.pool = ThreadPoolExecutor(max_workers=max_loads_in_flight, thread_name_prefix="adapter-load")

    def start(self, entry: AdapterEntry) -> None:
        """Start loading ``entry`` unless it is loaded, loading, refused, or backing off."""
        if entry.permanent or time.monotonic() < entry.retry_at:
            return
        if entry.loaded is None and entry.future is None:
            entry.error = None
            entry.future = self.pool.submit(self.loader.load, entry.spec)

    @staticmethod
    def in_flight(entries: Iterable[AdapterEntry]) -> int:
        return sum(1 for e in entries if e.future is not None)

    @staticmethod
    def wait(entries: Iterable[AdapterEntry], timeout: float) -> None:
        """Block until one load in flight finishes, or ``timeout`` seconds."""
        futures = [e.future for e in entries if e.future is not None]
        if futures:
            wait_futures(futures, timeout=timeout, return_when="FIRST_COMPLETED")

    @staticmethod
    def finished(entries: Iterable[tuple[str, AdapterEntry]]) -> list[tuple[str, AdapterEntry]]:
        """The entries whose load has finished (successfully or not), for ``collect``."""
        return [(n, e) for n, e in entries if e.future is not None and e.future.done()]

    @staticmethod
    def collect(entry: AdapterEntry) -> Fetched | None:
        """A finished load's result (see ``finished``); None when it failed, and then
        ``entry.error`` says why: refused files are permanent, anything else backs off before the
        next try."""
        future = entry.future
        assert future is not None and future.done()
        entry.future = None
        try:
            fetched = future.result()
        except AdapterValidationError as err:
            entry.error, entry.permanent = f"{err.code}: {err}", True
        except Exception as err:  # a network or disk failure: report it, retry later with backoff
            entry.error = f"{type(err).__name__}: {err}"
            entry.failures += 1
            entry.retry_at = time.monotonic() + min(RETRY_MAX, RETRY_BASE * 2 ** (entry.failures - 1))
        else:
            entry.failures = 0
            return fetched
        return None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
