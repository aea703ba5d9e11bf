"""The node agent: the only writer of a node's cache, serving the pods on its node.

Serving pods mount the cache read-only and ask the agent for an adapter version
(:meth:`NodeAgent.acquire`): a verified hit, or a fetch from the source with the agent's own
object-store credentials, after which the pod reads the folder under a lease that keeps it from
eviction until released (or until the lease expires, so a pod that dies mid-read does not hold it
forever). The leases are kept in a file beside the cache, so they outlive the agent's restart: a pod
reading a folder across it keeps the folder, and its release reaches the next agent. One fetch per
source at a time, however many pods ask at once.

The operator tells the agent what the node should hold (:meth:`stage`: the hot set, pinned and
prefetch-marked adapters, next versions, most wanted first) and reads back what it holds
(:meth:`state`). A background thread fetches what is staged and missing, in that order, until the
staged set would exceed the byte bound (reported, so the operator can say the hot set does not
fit), retries transient failures with backoff, and copies the base once (``base_copy``), and so
the merged models of the base's dedicated deployments the operator stages (deleted when unstaged).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from loraplane.adapter_format import AdapterValidationError
from loraplane.adapter_format.sources import S3Settings, under_prefix
from loraplane.node_cache.base_copy import BaseDigestMismatch, BaseStore
from loraplane.node_cache.fetch import acquire
from loraplane.node_cache.models import (
    Acquired,
    BaseState,
    NodeCacheState,
    StagedAdapter,
    StagedBase,
    StagedState,
)
from loraplane.node_cache.store import BoundFull, DiskCache

log = logging.getLogger("loraplane.node_agent")

RETRY_BASE, RETRY_MAX = 1.0, 300.0  # a failed staging fetch or base copy is retried after this, doubling


BASE_MISMATCH_RETRY_MAX = 3600.0  # a base whose files differ from its digest: fixed files are found within the hour
PIN_CLIENT_TTL = 30.0  # a pod resends its pins every few seconds; one silent this long is gone (a rollout renames pods)
MAX_PIN_CLIENTS = 256
NO_ROOM: Final = "no room"
LEASES_FILE = "leases.json"  # in the cache's root, beside adapters/: the leases given out, for the next agent
MAX_LEASES = 100_000  # far beyond the loads a node's pods run at once; a bigger file is not ours


def lease_key(lease: str) -> str:
    """What a lease is kept under, in memory and in its file: a digest, since the file lies in the
    folder every serving pod on the node mounts, and a lease is what releases a folder."""
    return hashlib.sha256(lease.encode()).hexdigest()


class TooManyPinClients(RuntimeError):
    """More pods pin adapters on this node than any node runs."""


class SourceNotAllowed(ValueError):
    """A source outside the prefixes the agent was started with."""


@dataclass
class _Retry:
    error: str
    permanent: bool
    failures: int = 1
    at: float = field(default_factory=time.monotonic)
    most: float = RETRY_MAX

    def due(self) -> bool:
        return not self.permanent and time.monotonic() >= self.at + min(self.most, RETRY_BASE * 2 ** (self.failures - 1))


class NodeAgent:
    def __init__(
        self,
        root: Path,
        node: str,
        *,
        max_bytes: int | None,
        s3: S3Settings | None = None,
        policy: str = "demand",
        lease_seconds: float = 300.0,
        base_source: str | None = None,
        base_digest: str | None = None,
        allowed_sources: list[str] | None = None,
        on_fetch: Callable[[float], None] | None = None,
    ) -> None:
        """``allowed_sources``: URI prefixes a pod may have fetched (the BaseModel's tenants'); none:
        any the agent's credentials can read. After a restart onto a non-empty cache the bound is
        kept only once the pins are known again (``_run``), so a restart does not evict them."""
        self.store = DiskCache(root, max_bytes=max_bytes, policy=policy, enforce_now=False, sole_writer=True)
        if len(self.store) == 0:  # nothing adopted from a previous life: nothing a restart could wrongly evict
            self.store.enforce()
        self.allowed_sources = list(allowed_sources or [])
        self.bases = BaseStore(root)
        self.node, self.s3, self.lease_seconds, self.on_fetch = node, s3, lease_seconds, on_fetch
        self.hits = self.misses = 0
        self.fetch_seconds_total = 0.0
        self.staged_bytes, self.staged_fit = 0, True
        self._lock = threading.Lock()
        self._source_locks: dict[str, threading.Lock] = {}
        self._leases_file = root / LEASES_FILE
        self._leases: dict[str, tuple[Path, float]] = {}  # lease_key(lease) -> (folder, monotonic expiry)
        self._lease_changes = self._leases_written = 0
        self._leases_write_lock = threading.Lock()
        self._staging: list[StagedAdapter] = []
        self._retries: dict[tuple[str, str], _Retry] = {}
        self._sizes: dict[tuple[str, str], int] = {}  # bytes of staged versions fetched before
        self._pod_pins: dict[str, tuple[set[str], float]] = {}  # pod -> (its pinned sources, when it last said)
        self._head: set[str] = set()  # the staged sources that fit the bound: kept like pins
        self._pinned: set[str] = set()
        self._pin_lock = threading.Lock()  # the store's pins follow _pinned in the order they were decided
        self._started = time.monotonic()
        self._staged_once = False
        self.base = BaseState(source=base_source) if base_source else None
        self._base_digest = base_digest
        self._base_retry_state: _Retry | None = None
        self._staged_bases: list[StagedBase] = []
        self._staged_base_states: dict[str, BaseState] = {}
        self._staged_base_retries: dict[tuple[str, str], _Retry] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-agent-staging", daemon=True)
        self._leases = self._adopt_leases()

    # serving pods ---------------------------------------------------------------------------
    def acquire(self, source: str, digest: str | None, *, counted: bool = True) -> Acquired:
        """A verified copy of the version on this node (fetched if need be), held under a lease.
        ``counted``: a pod's read, which the hit rate is about (staging's own reads are not)."""
        if self.allowed_sources and not any(under_prefix(source, p) for p in self.allowed_sources):
            raise SourceNotAllowed(f"{source[:256]} is under none of this node cache's allowed sources")
        with self._lock:
            source_lock = self._source_locks.setdefault(source, threading.Lock())
        start = time.perf_counter()
        with source_lock:
            got = acquire(self.store, source, digest, self.s3)
        seconds = time.perf_counter() - start
        lease = secrets.token_hex(16)
        with self._lock:
            if got.tier != "disk":
                self.fetch_seconds_total += seconds
            if counted and got.tier == "disk":
                self.hits += 1
            elif counted:
                self.misses += 1
            self._leases[lease_key(lease)] = (got.folder, time.monotonic() + self.lease_seconds)
            changed = self._leases_changed()
        self._write_leases(*changed)
        if got.tier != "disk" and self.on_fetch is not None:
            self.on_fetch(seconds)
        return Acquired(lease=lease, content=got.folder.name, weights_digest=got.weights_digest, tier=got.tier)

    def release(self, lease: str) -> None:
        """The pod has read the folder. An unknown lease (expired, or released twice) is no error."""
        self._end_lease(lease_key(lease))

    def _end_lease(self, key: str) -> None:
        with self._lock:
            held = self._leases.pop(key, None)
            if held is None:
                return
            changed = self._leases_changed()
        self._write_leases(*changed)
        self.store.release(held[0])

    def _adopt_leases(self) -> dict[str, tuple[Path, float]]:
        """The leases a previous agent gave out that have not run out, each folder held for reading
        again as when it was given: a pod still reading it keeps it from eviction across the
        restart, and its release, now sent here, ends the hold. A file that is not ours is ignored."""
        try:
            saved = json.loads(self._leases_file.read_text())
        except (OSError, ValueError):
            return {}
        wall, now = time.time(), time.monotonic()
        leases: dict[str, tuple[Path, float]] = {}
        for key, record in list(saved.items())[:MAX_LEASES] if isinstance(saved, dict) else []:
            try:
                content, until = str(record["content"]), float(record["until"])
            except (KeyError, TypeError, ValueError):
                continue
            if until > wall and (folder := self.store.hold(content)) is not None:
                leases[str(key)] = (folder, now + min(until - wall, self.lease_seconds))
        if leases:
            log.info("adopted %d leases from before the restart", len(leases))
        return leases

    def _leases_changed(self) -> tuple[int, dict[str, dict[str, float | str]]]:
        """(change number, the leases as their file holds them), taken with ``_lock`` held; the
        expiry as wall time, which a restart keeps counting."""
        wall, now = time.time(), time.monotonic()
        self._lease_changes += 1
        records: dict[str, dict[str, float | str]] = {
            key: {"content": f.name, "until": wall + until - now} for key, (f, until) in self._leases.items()
        }
        return self._lease_changes, records

    def _write_leases(self, change: int, records: dict[str, dict[str, float | str]]) -> None:
        """The leases' file, atomically replaced, outside ``_lock`` (a pod's acquire does not wait on
        another's write); a write older than the one on disk is skipped. A failed write leaves the
        leases good for this process."""
        with self._leases_write_lock:
            if change <= self._leases_written:
                return
            scratch = self._leases_file.with_name(f".{LEASES_FILE}.tmp")
            try:
                scratch.write_text(json.dumps(records))
                os.replace(scratch, self._leases_file)
                self._leases_written = change
            except OSError as err:
                log.warning("leases not saved (%s): a restart now would forget them", err)

    def set_pins(self, client: str, sources: list[str]) -> None:
        """One pod's pinned sources, replacing what it said before; forgotten when it stops saying."""
        with self._lock:
            if client not in self._pod_pins and len(self._pod_pins) >= MAX_PIN_CLIENTS:
                raise TooManyPinClients(f"{MAX_PIN_CLIENTS} pods already pin adapters on this node")
            self._pod_pins[client] = (set(sources), time.monotonic())
        self._apply_pins()

    def _expire_pins(self) -> None:
        now = time.monotonic()
        with self._lock:
            gone = [c for c, (_, said) in self._pod_pins.items() if now - said > PIN_CLIENT_TTL]
            for client in gone:
                del self._pod_pins[client]
        if gone:
            self._apply_pins()

    # the operator ---------------------------------------------------------------------------
    def stage(self, adapters: list[StagedAdapter], bases: list[StagedBase] | None = None) -> None:
        """``bases``: the merged models to hold besides the node's own base; one that was staged
        and is no longer is deleted from the node by the background thread."""
        with self._lock:
            self._staged_bases = list(bases or [])
            wanted_bases = {(b.source, b.digest) for b in self._staged_bases}
            self._staged_base_retries = {k: r for k, r in self._staged_base_retries.items() if k in wanted_bases}
            self._staging = list(adapters)
            wanted = {(a.source, a.digest) for a in adapters}
            self._retries = {k: r for k, r in self._retries.items() if k in wanted}
            self._head &= {a.source for a in adapters}
            self._sizes = {k: n for k, n in self._sizes.items() if k in wanted}
            self._staged_once = True
        self._apply_pins()
        self._wake.set()

    def state(self) -> NodeCacheState:
        with self._lock:
            staging, retries = list(self._staging), dict(self._retries)
            staged_bases, bases = list(self._staged_bases), dict(self._staged_base_states)
        staged = []
        for a in staging:
            retry = retries.get((a.source, a.digest))
            cached = self.store.cached_bytes(a.source, a.digest) is not None
            staged.append(StagedState(source=a.source, digest=a.digest, cached=cached, error=retry.error if retry else None))
        return NodeCacheState(
            node=self.node, bytes=self.store.used_bytes, max_bytes=self.store.max_bytes, entries=len(self.store),
            hits=self.hits, misses=self.misses, evictions=self.store.evictions,
            fetch_seconds_total=round(self.fetch_seconds_total, 6), staged=staged, staged_bytes=self.staged_bytes,
            staged_fit=self.staged_fit, base=self.base.model_copy() if self.base else None,
            bases=[bases.get(b.source) or BaseState(source=b.source) for b in staged_bases],
        )  # fmt: skip

    def _apply_pins(self) -> None:
        """The store keeps: every pod's pins, the operator's pinned versions, and the staged head."""
        with self._pin_lock:
            with self._lock:
                wanted = set().union(*(p for p, _ in self._pod_pins.values())) | self._head
                wanted |= {a.source for a in self._staging if a.pinned}
                added, removed = wanted - self._pinned, self._pinned - wanted
                self._pinned = wanted
            for source in added:
                self.store.pin(source)
            for source in removed:
                self.store.unpin(source)

    # the background thread ------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self, interval: float = 5.0) -> None:
        while not self._stop.is_set():
            self._reap_leases()
            self._expire_pins()
            self._copy_base()
            self._copy_staged_bases()
            self._fill()
            # The bound is kept from when the pins are known: the pods have resent theirs (they do
            # every few seconds) and the operator's staging has been counted (or never came).
            up = time.monotonic() - self._started
            if up > PIN_CLIENT_TTL and (self._staged_once or up > 2 * PIN_CLIENT_TTL):
                self.store.enforce()
            self._wake.wait(interval)
            self._wake.clear()

    def _reap_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [(key, folder.name) for key, (folder, until) in self._leases.items() if until < now]
        for key, content in expired:
            log.warning("a lease on %s expired unreleased: it may be evicted again", content)
            self._end_lease(key)

    def _copy_base(self) -> None:
        if self.base is None or self.base.ready:
            return
        if self._base_retry_state is not None and not self._base_retry_state.due():
            return
        self.base, self._base_retry_state = self._ensure_copy(self.base.source, self._base_digest, self._base_retry_state)

    def _ensure_copy(self, source: str, digest: str | None, retry: _Retry | None) -> tuple[BaseState, _Retry | None]:
        """One copy to the node (``BaseStore.ensure``), the base's or a staged merged model's: its
        state, and the retry to wait for when it failed (wrong files are retried too, rarely:
        someone fixes the bucket, not the DaemonSet)."""
        try:
            got, _ = self.bases.ensure(source, digest, self.s3)
        except Exception as err:  # reported in state, retried with backoff
            message = f"{type(err).__name__}: {err}"[:1024]
            most = BASE_MISMATCH_RETRY_MAX if isinstance(err, BaseDigestMismatch) else RETRY_MAX
            log.warning("%s not copied: %s", source, message)
            return BaseState(source=source, error=message), _Retry(message, False, retry.failures + 1 if retry else 1, most=most)
        return BaseState(source=source, digest=got, ready=True), None

    def _copy_staged_bases(self) -> None:
        """The staged merged models, each copied as the base is (verified against its digest,
        published whole), in the background thread alone, as the base copy, so no copy is deleted
        while it is being published. What is no longer staged goes once the operator has spoken
        since this agent started (before that, an empty list means not yet told, not nothing)."""
        with self._lock:
            wanted, told = list(self._staged_bases), self._staged_once
        states: dict[str, BaseState] = {}
        for b in wanted:
            if self._stop.is_set():
                return
            key = (b.source, b.digest)
            current = self.bases.published(b.source)
            if current is not None and current[0] == b.digest:
                states[b.source] = BaseState(source=b.source, digest=b.digest, ready=True)
                continue
            with self._lock:
                retry = self._staged_base_retries.get(key)
            if retry is not None and not retry.due():
                states[b.source] = BaseState(source=b.source, error=retry.error)
                continue
            try:
                self.bases.record_staged(b.source)  # before the copy: a crash mid-way leaves it deletable
            except OSError as err:  # a full or read-only disk: reported, tried again next pass
                states[b.source] = BaseState(source=b.source, error=f"{type(err).__name__}: {err}"[:1024])
                continue
            states[b.source], again = self._ensure_copy(b.source, b.digest, retry)
            with self._lock:
                if again is None:
                    self._staged_base_retries.pop(key, None)
                else:
                    self._staged_base_retries[key] = again
        with self._lock:
            self._staged_base_states = states
            # What is staged now, not when this pass began (a copy may have taken hours since).
            keep = {b.source for b in self._staged_bases} | ({self.base.source} if self.base else set())
        if told:
            for folder in self.bases.keep_only(keep):
                log.info("deleted %s: no longer staged", folder.name)

    def _fill(self) -> None:
        """Fetch staged versions in the operator's order while the staged set fits the bound. The
        head that fits is kept like a pin, each as soon as it is counted, so fetching the next one
        evicts what nobody staged rather than the staged head (a fetch that evicted its own head
        would refetch it on the next pass, and so on forever)."""
        with self._lock:
            staging = list(self._staging)
        total, fit, head = 0, True, set()
        for a in staging:
            if self._stop.is_set():
                return
            key = (a.source, a.digest)
            size = self.store.cached_bytes(a.source, a.digest)
            room = self.store.max_bytes
            if size is None:
                # A version fetched before and evicted since: if it cannot fit behind the ones
                # ahead of it, fetching it again would only evict one of them. Its size is known.
                if room is not None and total + self._sizes.get(key, 0) > room:
                    fit = False
                    break
                held = self._stage_one(a)
                if held == NO_ROOM:  # its bytes met the bound as they landed: it does not fit behind the head
                    self._sizes[key] = max(self._sizes.get(key, 0), (room or 0) - total + 1)
                    fit = False
                    break
                if held is None or isinstance(held, str):
                    continue
                lease, size = held
                self._sizes[key] = size
                fits = room is None or total + size <= room
                if fits:  # kept before the lease ends, or the release's own eviction could take it
                    head.add(a.source)
                    self._set_head(head, keep_previous=True)
                self.release(lease)
                if not fits:
                    fit = False
                    break
                total += size
                continue
            if room is not None and total + size > room:
                fit = False
                break
            total += size
            head.add(a.source)
            self._set_head(head, keep_previous=True)
        self._set_head(head)
        self.staged_bytes, self.staged_fit = total, fit

    def _set_head(self, head: set[str], keep_previous: bool = False) -> None:
        """``keep_previous``: during a pass, last pass's head stays kept (but only what is still
        staged) until the pass has counted its own."""
        with self._lock:
            staged = {a.source for a in self._staging}
            self._head = (self._head & staged) | head if keep_previous else head
        self._apply_pins()

    def _stage_one(self, a: StagedAdapter) -> tuple[str, int] | Literal["no room"] | None:
        """Fetch one staged version; its (lease, bytes), held until the caller releases it, or
        ``NO_ROOM`` when what is kept left no room for its bytes as they landed."""
        key = (a.source, a.digest)
        retry = self._retries.get(key)
        if retry is not None and not retry.due():
            return None
        try:
            got = self.acquire(a.source, a.digest, counted=False)
        except Exception as err:  # reported in state; refused files wait for a new digest
            if isinstance(err, BoundFull):  # the bound, not the disk: a full disk is reported and retried below
                return NO_ROOM
            message = f"{type(err).__name__}: {err}"[:1024]
            with self._lock:
                self._retries[key] = _Retry(message, isinstance(err, AdapterValidationError), retry.failures + 1 if retry else 1)
            return None
        with self._lock:
            self._retries.pop(key, None)
        if got.tier == "cold" and not self._digest_matches(a, got):  # first: it records why, so it is not refetched
            self.release(got.lease)
            return None
        size = self.store.cached_bytes(a.source, a.digest)
        if size is None:
            self.release(got.lease)
            return None
        return got.lease, size

    def _digest_matches(self, a: StagedAdapter, got: Acquired) -> bool:
        """A fetch stores whatever the source holds now; a staged digest it does not match is the
        operator's to know (a source overwritten in place), not a reason to drop the files."""
        if a.digest in (got.weights_digest, f"sha256:{got.content}"):
            return True
        with self._lock:
            self._retries[(a.source, a.digest)] = _Retry(f"DigestMismatch: {a.source} now holds sha256:{got.content}", True)
        return False
