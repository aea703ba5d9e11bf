"""Where a replica's loader gets an adapter version's files: its own disk cache (``OwnCache``, a
process that fetches for itself, as on a laptop or without a node agent), or the node agent's
cache on this node (``NodeAgentFiles``), which the pod mounts read-only and which the agent alone
writes, with the object-store credentials the pod then does without. Either way the loader gets a
verified folder to read and hands it back when done."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from loraplane.adapter_format.sources import S3Settings
from loraplane.adapter_format.validation import MAX_WEIGHTS_BYTES
from loraplane.admin_api import DiskCacheStats
from loraplane.node_cache.client import AgentClient, AgentUnavailable
from loraplane.node_cache.fetch import acquire
from loraplane.node_cache.store import DiskCache


@dataclass(frozen=True)
class Held:
    folder: Path
    weights_digest: str
    tier: str  # "disk" or "cold", as the load metrics count it
    lease: str | None = None


class AdapterFiles(Protocol):
    def acquire(self, source: str, digest: str | None) -> Held: ...
    def release(self, held: Held) -> None: ...
    def pin(self, source: str) -> None: ...
    def unpin(self, source: str) -> None: ...
    def figures(self) -> DiskCacheStats: ...
    def close(self) -> None: ...


class OwnCache:
    def __init__(
        self, cache_dir: Path, *, max_bytes: int | None, policy: str, s3: S3Settings | None,
        max_weights_bytes: int = MAX_WEIGHTS_BYTES,
    ) -> None:  # fmt: skip
        self.store = DiskCache(cache_dir, max_bytes=max_bytes, policy=policy)
        self.s3, self.max_weights_bytes = s3, max_weights_bytes

    def acquire(self, source: str, digest: str | None) -> Held:
        got = acquire(self.store, source, digest, self.s3, self.max_weights_bytes)
        return Held(got.folder, got.weights_digest, got.tier)

    def release(self, held: Held) -> None:
        self.store.release(held.folder)

    def pin(self, source: str) -> None:
        self.store.pin(source)

    def unpin(self, source: str) -> None:
        self.store.unpin(source)

    def figures(self) -> DiskCacheStats:
        s = self.store
        return DiskCacheStats(bytes=s.used_bytes, max_bytes=s.max_bytes, entries=len(s), evictions=s.evictions)

    def close(self) -> None:
        pass


class NodeAgentFiles:
    """The node cache through its agent. Pins go to the agent (as this pod's whole set, so a
    restarted pod clears what its previous life pinned); the figures are the node's, refreshed
    every ``refresh_seconds`` off the request path."""

    def __init__(self, url: str, token: str | None, cache_dir: Path, client_id: str, refresh_seconds: float = 5.0) -> None:
        self.agent = AgentClient(url, token)
        self.adapters = cache_dir / "adapters"
        self.client_id = client_id
        self._pins: set[str] = set()
        self._lock = threading.Lock()
        self._figures = DiskCacheStats()
        self._stop = threading.Event()
        self._refresh = threading.Thread(
            target=self._refresh_loop, args=(refresh_seconds,), name="node-cache-figures", daemon=True
        )
        self._refresh.start()

    def acquire(self, source: str, digest: str | None) -> Held:
        got = self.agent.acquire(source, digest)
        return Held(self.adapters / got.content, got.weights_digest, got.tier, got.lease)

    def release(self, held: Held) -> None:
        if held.lease is not None:
            with contextlib.suppress(AgentUnavailable):  # the lease expires on its own; the folder was read
                self.agent.release(held.lease)

    def pin(self, source: str) -> None:
        self._send_pins(add=source)

    def unpin(self, source: str) -> None:
        self._send_pins(remove=source)

    def _send_pins(self, add: str | None = None, remove: str | None = None) -> None:
        with self._lock:
            if add:
                self._pins.add(add)
            if remove:
                self._pins.discard(remove)
            pins = sorted(self._pins)
        with contextlib.suppress(AgentUnavailable):  # sent again with the next figures refresh
            self.agent.set_pins(self.client_id, pins)

    def figures(self) -> DiskCacheStats:
        return self._figures

    def _refresh_loop(self, seconds: float) -> None:
        while True:
            self._send_pins()  # also keeps them from expiring, and an agent restarted since learns them again
            try:
                s = self.agent.state()
                self._figures = DiskCacheStats(bytes=s.bytes, max_bytes=s.max_bytes, entries=s.entries, evictions=s.evictions)
            except AgentUnavailable:
                pass  # the last figures stand
            if self._stop.wait(seconds):
                return

    def close(self) -> None:
        self._stop.set()
        self.agent.close()
