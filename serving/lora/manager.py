"""Adapter tiers: device slots <- host memory <- node disk cache <- cold storage.

The engine thread asks :meth:`AdapterManager.ensure_device` when it wants to admit a request;
the answer is a slot index, or ``None`` while the adapter is still on its way. Bringing an
adapter from cold storage (fetch, validate, read tensors) runs on a small thread pool, off the
request path, one load per adapter however many requests wait for it. Placing a host-resident
adapter into a device slot is a memory copy done on the engine thread between forward passes,
because the forward pass reads the slots.

Both tiers use the eviction policies of ``loraplane sim`` (one implementation for the simulator
and the engine); pinned adapters and adapters with running sequences are never evicted. The host
tier always holds every device-resident adapter (as vLLM requires ``max_cpu_loras >= max_loras``),
so a device eviction never costs a cold load, and a host eviction takes an idle adapter off the
device as well.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path

from loraplane.adapter_format import AdapterValidationError, BaseShape, ValidationLimits, check_adapter_name
from loraplane.adapter_format.sources import S3Settings, open_source
from loraplane.admin_api import Tier as Residency  # what stats report is what the manager tracks
from loraplane.eviction import Tier, TierFullError, make_policy
from loraplane.eviction.demand import DecayedCounts
from loraplane.serving.lora.disk_cache import DiskCache
from loraplane.serving.lora.peft_loader import LoadedAdapter, load_peft_adapter
from loraplane.serving.lora.shared_pages import SharedPages
from loraplane.serving.lora.slot_store import Placement, slot_store
from loraplane.serving.lora.slot_table import SlotTable
from loraplane.serving.metrics import EngineMetrics

# A drained slot's waiter asks again every scheduling step; a drain it stopped asking about (the
# request was aborted) lapses after this long rather than holding the victim back for good.
DRAIN_LAPSE_SECONDS = 1.0
# An adapter placed in a slot keeps it at least this long before a drain may pick it: two adapters
# sharing one slot then take turns long enough to serve their queues, instead of paying a drain
# (the victim's running requests finishing while its new ones wait) for every request.
SLOT_HOLD_SECONDS = 1.0
# A drained adapter's running requests get this long to finish; then they are preempted (and
# resume later from the prefix cache). On a CPU a 32-token answer can take ten seconds inside a
# busy batch, and waiting for it is what made the demo's colder adapters wait longest.
DRAIN_PREEMPT_SECONDS = 1.0
# Demand (requests per adapter, decayed with this half-life in wall time, plus the requests queued
# for it) decides which adapter is drained and which form the hot set. Short enough to follow a
# shift in traffic within a minute, long enough that at a fraction of a request per second the
# hot adapter's lead is not lost to the noise of a few arrivals.
DEMAND_HALF_LIFE_SECONDS = 30.0
HOT_SET_MARGIN = 1.5
# ... and no adapter is hot on fewer decayed requests than this: at startup the first adapter to
# arrive would otherwise hold the hot set before the real favourite has shown itself.
HOT_SET_MIN = 4.0


class AdapterNotFound(KeyError):
    def __str__(self) -> str:
        return f"adapter {self.args[0]!r} is not registered"


class AdapterBusy(RuntimeError):
    pass


class PinLimitReached(RuntimeError):
    """Pinning one more adapter would leave unpinned traffic without a device slot."""


class AdapterUnavailable(RuntimeError):
    """The adapter's files were refused (a permanent failure): requests fail at once until a new
    version is registered, instead of fetching the same bad files again for each."""


# A transient load failure (the store unreachable, a dropped connection) is retried after
# RETRY_BASE * 2**(failures - 1) seconds, at most RETRY_MAX, when a request next needs it.
RETRY_BASE, RETRY_MAX = 0.5, 60.0


@dataclass(frozen=True)
class AdapterSpec:
    """What a registration says: where the adapter lives and what it must hash to."""

    name: str
    source: str
    digest: str | None = None
    tenant: str | None = None
    allow_rank_truncation: bool = False
    version: str | None = None  # the registrant's label for this revision (e.g. a date); shown, not interpreted


@dataclass
class _Entry:
    spec: AdapterSpec
    loaded: LoadedAdapter | None = None
    placement: Placement | None = None  # its device slot (and pages), while on the device
    future: Future[tuple[LoadedAdapter, str, float]] | None = None
    error: str | None = None
    pinned: bool = False
    running: int = 0
    permanent: bool = False  # its files were refused: no refetch until a new version is registered
    failures: int = 0  # transient failures in a row
    retry_at: float = 0.0  # no new load before this (monotonic seconds)
    retired_key: str | None = None  # set once a new version took its name (see _retire)
    placed_at: float = 0.0  # when it last took a device slot (monotonic seconds)

    @property
    def slot(self) -> int | None:
        return self.placement.slot if self.placement is not None else None

    @property
    def residency(self) -> Residency:
        if self.placement is not None:
            return Residency.DEVICE
        if self.loaded is not None:
            return Residency.HOST
        if self.future is not None:
            return Residency.LOADING
        return Residency.FAILED if self.error else Residency.COLD


@dataclass
class _Drain:
    """``victim`` admits nothing new until its slot frees for ``waiter``."""

    victim: str
    waiter: str
    started: float  # monotonic seconds
    asked: float  # when the waiter last asked; the drain lapses if it stops asking


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    source: str
    version: str | None
    tenant: str | None
    residency: Residency
    pinned: bool
    running: int
    digest: str | None
    rank: int | None
    slot: int | None
    truncation_error: float | None
    error: str | None
    folder: Path | None


@dataclass
class LoadFailure:
    name: str
    message: str


class AdapterManager:
    def __init__(
        self,
        table: SlotTable,
        base: BaseShape,
        limits: ValidationLimits,
        *,
        cache_dir: Path,
        max_cpu_loras: int,
        disk_cache_max_bytes: int | None = None,
        max_loads_in_flight: int = 2,
        policy: str = "demand",
        s3: S3Settings | None = None,
        metrics: EngineMetrics | None = None,
        pages: SharedPages | None = None,
        queued: Callable[[], Mapping[str, int]] = dict,
    ) -> None:
        """With ``pages`` (and a :class:`PagedSlotTable`), adapters live in the KV block pool:
        each takes the pages its rank needs, and KV pressure evicts idle adapters. ``queued``
        counts the requests waiting per adapter (the scheduler's queue), part of their demand."""
        if max_cpu_loras < table.num_slots:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({table.num_slots})")
        self.table, self.base, self.limits, self.s3 = table, base, limits, s3
        self.disk = DiskCache(cache_dir, max_bytes=disk_cache_max_bytes, policy=policy)
        self.metrics = metrics or EngineMetrics()
        self.entries: dict[str, _Entry] = {}
        self.retired: dict[str, _Entry] = {}  # replaced versions still finishing running requests
        self._retired_count = 0
        self.queued = queued
        # "demand" places by demand: a hot set that keeps its slots, and drains chosen by demand.
        # The other policies keep their own order for both (lru: recency, as vLLM's slots do).
        self.follows_demand = policy == "demand"
        # Requests per adapter on arrival, decayed in wall time: what placement follows (see hot_set).
        self.arrivals = DecayedCounts(DEMAND_HALF_LIFE_SECONDS, clock=time.monotonic)
        self._hot: frozenset[str] = frozenset()
        self._hot_at = -1.0
        self.device = Tier(table.num_slots, make_policy(policy), name="device", in_use=self._held, on_evict=self._off_device)
        self.host = Tier(max_cpu_loras, make_policy(policy), name="host", in_use=self._busy, on_evict=self._off_host)
        self.pool = ThreadPoolExecutor(max_workers=max_loads_in_flight, thread_name_prefix="adapter-load")
        self.store = slot_store(table, pages)  # static slots or unified pages, fixed from here on
        self.store.on_kv_short(lambda: self._evict_idle(spare_hot=False))
        # Slot draining, against starvation: when an adapter is loaded and waiting but every
        # device slot is held by adapters with running requests, one of those stops admitting new
        # requests until its running ones finish and the slot frees. Without it a steadily busy
        # adapter keeps its slot for as long as its traffic lasts and the waiting one starves (the
        # demo showed 18 s waits with 2 slots and 3 busy adapters). The victim is the one in least
        # demand outside the hot set, never the one that is simply always busy (see _drain_victim).
        # (victim, waiter, when the waiter last asked): the drain lapses if the waiter stops asking.
        self._drain: _Drain | None = None

    # registration ---------------------------------------------------------------------------
    def register(self, spec: AdapterSpec) -> None:
        """Declare an adapter (or a new version of one: a new source or digest). Nothing is loaded."""
        check_adapter_name(spec.name)
        old = self.entries.get(spec.name)
        if old is not None:
            if old.spec == spec:
                return
            if old.running:
                self._retire(spec.name)  # its running requests finish on it; new ones get this spec
            else:
                self._drop(spec.name)
        self.entries[spec.name] = _Entry(spec, pinned=old.pinned if old else False)

    def unregister(self, name: str) -> None:
        """New requests stop finding the adapter at once; running ones finish on it first."""
        entry = self._get(name)
        if entry.running:
            self._retire(name)
        else:
            self._drop(name)
        del self.entries[name]
        self.arrivals.forget(name)

    def _retire(self, name: str) -> None:
        """Move a replaced (or removed) version with running requests aside under a private key: it
        keeps its device slot and weights until its last running request releases it, while the
        name is free for the new version. This is how a promotion never fails a request in flight."""
        entry = self.entries[name]
        self._retired_count += 1
        key = f"{name}#retired-{self._retired_count}"
        entry.retired_key = key
        self.retired[key] = entry
        if entry.slot is not None:
            self.device.remove(name)
            self.device.insert(key)  # the room it just left: nothing is evicted
        self.host.remove(name)

    def _drop(self, name: str) -> None:
        self.device.remove(name)
        self._off_device(name)
        self.host.remove(name)
        self.entries[name].loaded = None

    def _get(self, name: str) -> _Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise AdapterNotFound(name) from None

    # tier callbacks -------------------------------------------------------------------------
    def _lookup(self, key: object) -> _Entry | None:
        return self.entries.get(str(key)) or self.retired.get(str(key))

    def _busy(self, name: object) -> bool:
        entry = self._lookup(name)
        return bool(entry and entry.running)

    def _held(self, name: object) -> bool:
        """What the device tier may not evict: adapters with running requests, and the hot set."""
        return self._busy(name) or name in self.hot_set()

    # demand ---------------------------------------------------------------------------------
    def note_arrival(self, name: str) -> None:
        """A request for ``name`` arrived (whether or not it can run yet)."""
        self.arrivals.add(name)

    def demand(self, name: str, queued: Mapping[str, int] | None = None) -> float:
        """Decayed arrivals plus the requests queued now (``queued``: the scheduler's counts, when
        the caller already has them)."""
        return self.arrivals.value(name) + (self.queued() if queued is None else queued).get(name, 0)

    def hot_set(self) -> frozenset[str]:
        """The engine's own hot set: the adapters with the highest decayed arrival rate, as many
        as half the device slots (rounded up) and never more than ``max_loras - 1`` less the
        pinned ones, so unpinned traffic always has a slot to share. They stay in their device
        slots: neither evicted while idle nor drained for a colder adapter. Recomputed at most
        every 50 ms (it is asked on every eviction decision)."""
        now = time.monotonic()
        if not self.follows_demand or now - self._hot_at < 0.05:
            return self._hot
        self._hot_at = now
        slots = self.table.num_slots
        room = min((slots + 1) // 2, slots - 1 - len(self.device.pinned))
        # Hysteresis: a member stays until a newcomer's demand is HOT_SET_MARGIN times its own,
        # so two adapters of similar demand do not trade the hot set back and forth on noise.
        contenders = {
            n for n in [*self.arrivals.top(room), *self._hot] if n in self.entries and self.arrivals.value(n) >= HOT_SET_MIN
        }
        margin = math.log2(HOT_SET_MARGIN)
        ranked = sorted(contenders, key=lambda n: self.arrivals.rank_key(n) + (margin if n in self._hot else 0.0))
        self._hot = frozenset(ranked[-room:] if room > 0 else [])
        return self._hot

    def _off_device(self, name: object) -> None:
        entry = self._lookup(name)
        if entry is not None and entry.placement is not None:
            self.store.clear(entry.placement)
            entry.placement = None

    def _evict_idle(self, *, spare_hot: bool) -> bool:
        """Take the policy's choice among idle, unpinned device adapters off the device (sparing
        the hot set when another adapter wants the pages; KV pressure spares only pinned ones)."""
        hot = self.hot_set() if spare_hot else frozenset()
        victim = self.device.policy.victim(lambda k: k in self.device.pinned or self._busy(k) or k in hot)
        if victim is None:
            return False
        self.device.remove(victim)
        self._off_device(victim)
        return True

    def _off_host(self, name: object) -> None:
        """Leaving host memory means leaving the device too: the host tier holds every
        device-resident adapter, so an idle one evicted from host gives up its slot as well."""
        entry = self.entries.get(str(name))
        if entry is not None:
            entry.loaded = None
            self.device.remove(str(name))
            self._off_device(name)

    # loading --------------------------------------------------------------------------------
    def _load(self, spec: AdapterSpec) -> tuple[LoadedAdapter, str, float]:
        """Worker thread: cold or disk -> validated tensors in host memory."""
        start = time.perf_counter()
        folder = self.disk.get(spec.source, spec.digest) if spec.digest else None
        tier, weights = "disk", spec.digest  # a hit was verified against this digest
        if folder is None:
            tier = "cold"
            staged = self.disk.staging()
            try:
                open_source(spec.source, self.s3).fetch(staged)
                weights, folder = self.disk.commit(staged, spec.source)
            except BaseException:
                self.disk.discard(staged)
                raise
        limits = ValidationLimits(
            max_lora_rank=self.limits.max_lora_rank,
            max_bytes=self.limits.max_bytes,
            allow_rank_truncation=spec.allow_rank_truncation,
            supported_modules=self.limits.supported_modules,
        )
        try:
            # The cache hashed the weights as it wrote or verified the folder: not hashed twice.
            loaded = load_peft_adapter(folder, self.base, limits, expected_digest=spec.digest, weights_digest=weights)
        finally:
            self.disk.release(folder)
        return loaded, tier, time.perf_counter() - start

    def start_load(self, name: str) -> None:
        entry = self._get(name)
        if entry.permanent or time.monotonic() < entry.retry_at:
            return
        if entry.loaded is None and entry.future is None:
            entry.error = None
            entry.future = self.pool.submit(self._load, entry.spec)

    def check_available(self, name: str) -> None:
        """Raise ``AdapterUnavailable`` for an adapter whose files were refused."""
        entry = self._get(name)
        if entry.permanent:
            raise AdapterUnavailable(f"adapter {name!r} failed to load: {entry.error}")

    def loads_in_flight(self) -> int:
        return sum(1 for e in self.entries.values() if e.future is not None)

    def wait_for_loads(self, timeout: float) -> None:
        futures = [e.future for e in self.entries.values() if e.future is not None]
        if futures:
            wait_futures(futures, timeout=timeout, return_when="FIRST_COMPLETED")

    def poll(self) -> list[LoadFailure]:
        """Engine thread: move finished loads into the host tier; report the failed ones."""
        failures = []
        for name, entry in self.entries.items():
            future = entry.future
            if future is None or not future.done():
                continue
            entry.future = None
            try:
                loaded, tier, seconds = future.result()
            except AdapterValidationError as err:
                entry.error, entry.permanent = f"{err.code}: {err}", True
            except Exception as err:  # a network or disk failure: report it, retry later with backoff
                entry.error = f"{type(err).__name__}: {err}"
                entry.failures += 1
                entry.retry_at = time.monotonic() + min(RETRY_MAX, RETRY_BASE * 2 ** (entry.failures - 1))
            else:
                entry.failures = 0
                self.metrics.observe_load(name, entry.spec.tenant, tier, seconds)
                try:
                    self.host.insert(name)
                except TierFullError as err:
                    entry.error = str(err)
                else:
                    entry.loaded = loaded
                    if entry.pinned:
                        self.host.pin(name)
                    continue
            failures.append(LoadFailure(name, f"adapter {name!r} failed to load: {entry.error}"))
        return failures

    def fetch(self, spec: AdapterSpec) -> tuple[LoadedAdapter, str, float]:
        """Fetch and validate a version on the calling thread, touching no engine state (the admin
        API runs it off the engine thread, so a slow fetch or a large file's hash stalls no
        step); returns what :meth:`prepare` takes as ``fetched``."""
        return self._load(spec)

    def prepare(self, spec: AdapterSpec, fetched: tuple[LoadedAdapter, str, float] | None = None) -> LoadedAdapter:
        """Fetch and validate a version (or take what :meth:`fetch` got) without registering it:
        nothing anyone is served changes, whatever the files turn out to be. ``install`` then
        gives it its name."""
        loaded, tier, seconds = fetched or self._load(spec)
        self.metrics.observe_load(spec.name, spec.tenant, tier, seconds)
        return loaded

    def install(self, spec: AdapterSpec, loaded: LoadedAdapter) -> None:
        """Register ``spec`` with weights ``prepare`` already loaded (a promotion, as ``register``)."""
        self.register(spec)
        self._hold(spec.name, loaded)

    def _hold(self, name: str, loaded: LoadedAdapter) -> None:
        """Weights loaded outside the pool's ``poll`` enter the host tier (unless already there)."""
        entry = self._get(name)
        if entry.loaded is None:
            self.host.insert(name)
            entry.loaded = loaded
            if entry.pinned:
                self.host.pin(name)

    def load_now(self, name: str) -> LoadedAdapter:
        """Load synchronously (startup and explicit loads); raises the load's own error."""
        entry = self._get(name)
        if entry.loaded is None:
            self._hold(name, self.prepare(entry.spec))
        assert entry.loaded is not None
        return entry.loaded

    # device placement -----------------------------------------------------------------------
    def ensure_device(self, name: str) -> int | None:
        """The adapter's slot, placing it from host memory if needed; None while it is not ready
        (a load is started) or no slot can be freed (every slot pinned or running)."""
        entry = self._get(name)
        if entry.slot is not None and self._draining(name):
            return None
        if entry.slot is not None:
            self.device.touch(name)
            self.host.touch(name)
            return entry.slot
        if entry.loaded is None:
            self.start_load(name)
            return None
        start = time.perf_counter()
        if not self.store.make_room(entry.loaded, lambda: self._evict_idle(spare_hot=True)):
            return None  # KV and busy adapters hold the pool; retry after sequences finish
        try:
            self.device.insert(name)
        except TierFullError:
            self._start_drain(name)
            return None
        if self._drain is not None and self._drain.waiter == name:
            self._drain = None
        entry.placement, entry.placed_at = self.store.place(entry.loaded), time.monotonic()
        slot = entry.placement.slot
        self.host.touch(name)
        if entry.pinned:
            self.device.pin(name)
        self.metrics.observe_load(name, entry.spec.tenant, "host", time.perf_counter() - start)
        return slot

    def _start_drain(self, waiter: str) -> None:
        now, current = time.monotonic(), self._drain
        if current is not None and current.waiter != waiter and now - current.asked < DRAIN_LAPSE_SECONDS:
            return  # one drain at a time; the next waiter's turn comes after this one's
        if current is not None and current.waiter == waiter and self._on_device(current.victim):
            current.asked = now  # still draining for this waiter
            return
        victim = self._drain_victim(waiter, now)
        self._drain = _Drain(victim, waiter, now, now) if victim is not None else None

    def overdue_drain(self) -> tuple[str, int] | None:
        """The drained adapter (and its slot) whose running requests have held the slot for
        DRAIN_PREEMPT_SECONDS since the drain began: the engine preempts them (they resume later,
        mostly from the prefix cache), so a waiter's wait is bounded by the hold and this, not by
        the longest request the victim happens to be running. Only under demand placement."""
        d = self._drain
        if not self.follows_demand or d is None or not self._draining(d.victim):
            return None
        entry = self.entries.get(d.victim)
        if entry is None or entry.slot is None or not entry.running:
            return None
        if time.monotonic() - d.started < DRAIN_PREEMPT_SECONDS:
            return None
        return d.victim, entry.slot

    def _drain_victim(self, waiter: str, now: float) -> str | None:
        """The slot holder to drain for ``waiter``: the one in least demand among those neither
        pinned, nor hot, nor placed within SLOT_HOLD_SECONDS; the fewest running requests break
        ties (its slot frees soonest). None when every holder is protected: the waiter asks again
        next step. A waiter therefore gets a slot within SLOT_HOLD_SECONDS plus the victim's
        longest running request, and the hot set is never its price."""
        if not self.follows_demand:
            victim = self.device.policy.victim(lambda k: k in self.device.pinned)
            return None if victim is None else str(victim)
        hot = self.hot_set()
        candidates = [
            e
            for name, e in self.entries.items()
            if e.slot is not None
            and not e.pinned
            and name not in hot
            and name != waiter
            and now - e.placed_at >= SLOT_HOLD_SECONDS
        ]
        if not candidates:
            return None
        queued = self.queued()
        victim = min(candidates, key=lambda e: (self.demand(e.spec.name, queued), e.running))
        return victim.spec.name

    def _on_device(self, name: str) -> bool:
        entry = self.entries.get(name)
        return entry is not None and entry.slot is not None

    def _draining(self, name: str) -> bool:
        if self._drain is None or self._drain.victim != name:
            return False
        if time.monotonic() - self._drain.asked > DRAIN_LAPSE_SECONDS:  # the waiter went away
            self._drain = None
            return False
        return True

    def residency(self, name: str) -> Residency:
        return self._get(name).residency

    def cache_key(self, name: str) -> str:
        entry = self._get(name)
        assert entry.loaded is not None
        return f"{name}@{entry.loaded.digest}"

    def acquire(self, name: str) -> object:
        """Count a running request against the adapter; returns the lease to release, which stays
        with this version even if the name is re-registered meanwhile."""
        entry = self._get(name)
        entry.running += 1
        return entry

    @staticmethod
    def lease_version(lease: object) -> tuple[str | None, str | None]:
        """The version label and weights digest a lease runs on."""
        assert isinstance(lease, _Entry)
        return lease.spec.version, lease.loaded.digest if lease.loaded else lease.spec.digest

    def release(self, lease: object) -> None:
        assert isinstance(lease, _Entry)
        lease.running -= 1
        key = lease.retired_key
        if key is not None and lease.running == 0 and key in self.retired:
            self.device.remove(key)
            self._off_device(key)
            del self.retired[key]
            lease.loaded = None

    # pinning and prefetch -------------------------------------------------------------------
    @property
    def max_pins(self) -> int:
        """Pins leave one device slot to the adapters nobody pinned, or their requests would wait
        for ever; pinned adapters must also fit in host memory beside it."""
        return min(self.table.num_slots, self.host.capacity) - 1

    def pin(self, name: str) -> None:
        """Keep the adapter resident in both tiers; loads it now if it is cold. Raises
        ``PinLimitReached`` beyond :attr:`max_pins`, changing nothing."""
        entry = self._get(name)
        if not entry.pinned:
            pinned = sorted(n for n, e in self.entries.items() if e.pinned)
            if len(pinned) >= self.max_pins:
                raise PinLimitReached(
                    f"cannot pin {name!r}: {len(pinned)} adapters are pinned ({', '.join(pinned) or 'none'}) and "
                    f"max_loras is {self.table.num_slots}; at most max_loras - 1 = {self.max_pins} may be, so that "
                    "unpinned adapters keep a device slot"
                )
        entry.pinned = True
        self.disk.pin(entry.spec.source)
        if name in self.host:
            self.host.pin(name)
        if name in self.device:
            self.device.pin(name)
        if entry.loaded is None:
            self.start_load(name)

    def unpin(self, name: str) -> None:
        entry = self._get(name)
        entry.pinned = False
        self.disk.unpin(entry.spec.source)
        self.host.unpin(name)
        self.device.unpin(name)

    def prefetch(self, name: str) -> None:
        """Start bringing the adapter into host memory; the device slot follows on first use."""
        self.start_load(name)

    def info(self, name: str) -> AdapterInfo:
        e = self._get(name)
        return AdapterInfo(
            name=name,
            source=e.spec.source,
            version=e.spec.version,
            tenant=e.spec.tenant,
            residency=e.residency,
            pinned=e.pinned,
            running=e.running,
            digest=e.loaded.digest if e.loaded else e.spec.digest,
            rank=e.loaded.rank if e.loaded else None,
            slot=e.slot,
            truncation_error=e.loaded.truncation_error if e.loaded else None,
            error=e.error,
            folder=e.loaded.folder if e.loaded else None,
        )

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
