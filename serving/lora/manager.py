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

import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path

from loraplane.adapter_format import AdapterValidationError, BaseShape, ValidationLimits, check_adapter_name
from loraplane.adapter_format.sources import S3Settings
from loraplane.admin_api import Tier as Residency
from loraplane.eviction import Tier, TierFullError, make_policy
from loraplane.serving.lora.demand import Demand
from loraplane.serving.lora.disk_cache import DiskCache
from loraplane.serving.lora.drain import SlotDrain, drain_victim
from loraplane.serving.lora.entries import (
    AdapterEntry,
    AdapterInfo,
    AdapterNotFound,
    AdapterSpec,
    AdapterUnavailable,
    Fetched,
    LoadFailure,
    PinLimitReached,
)
from loraplane.serving.lora.loader import AdapterLoader
from loraplane.serving.lora.peft_loader import LoadedAdapter
from loraplane.serving.lora.shared_pages import SharedPages
from loraplane.serving.lora.slot_store import slot_store
from loraplane.serving.lora.slot_table import SlotTable
from loraplane.serving.metrics import EngineMetrics

# A transient load failure (the store unreachable, a dropped connection) is retried after
# RETRY_BASE * 2**(failures - 1) seconds, at most RETRY_MAX, when a request next needs it.
RETRY_BASE, RETRY_MAX = 0.5, 60.0


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
        self.loader = AdapterLoader(base, limits, self.disk, s3)
        self.metrics = metrics or EngineMetrics()
        self.entries: dict[str, AdapterEntry] = {}
        self.retired: dict[str, AdapterEntry] = {}  # replaced versions still finishing running requests
        self._retired_count = 0
        self.queued = queued
        # "demand" places by demand: a hot set that keeps its slots, and drains chosen by demand.
        # The other policies keep their own order for both (lru: recency, as vLLM's slots do).
        self.follows_demand = policy == "demand"
        self.demands = Demand(queued)
        self.device = Tier(table.num_slots, make_policy(policy), name="device", in_use=self._held, on_evict=self._off_device)
        self.host = Tier(max_cpu_loras, make_policy(policy), name="host", in_use=self._busy, on_evict=self._off_host)
        self.pool = ThreadPoolExecutor(max_workers=max_loads_in_flight, thread_name_prefix="adapter-load")
        self.store = slot_store(table, pages)  # static slots or unified pages, fixed from here on
        self.store.on_kv_short(lambda: self._evict_idle(spare_hot=False))
        # The victim is the one in least demand outside the hot set, never the one that is simply
        # always busy (see drain.drain_victim).
        self.drain = SlotDrain()

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
        self.entries[spec.name] = AdapterEntry(spec, pinned=old.pinned if old else False)

    def unregister(self, name: str) -> None:
        """New requests stop finding the adapter at once; running ones finish on it first."""
        entry = self._get(name)
        if entry.running:
            self._retire(name)
        else:
            self._drop(name)
        del self.entries[name]
        self.demands.forget(name)

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

    def _get(self, name: str) -> AdapterEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise AdapterNotFound(name) from None

    # tier callbacks -------------------------------------------------------------------------
    def _lookup(self, key: object) -> AdapterEntry | None:
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
        self.demands.note_arrival(name)

    def demand(self, name: str, queued: Mapping[str, int] | None = None) -> float:
        return self.demands.of(name, queued)

    def hot_set(self) -> frozenset[str]:
        """The engine's own hot set (see ``demand``): as many adapters as half the device slots
        (rounded up) and never more than ``max_loras - 1`` less the pinned ones, so unpinned
        traffic always has a slot to share. They stay in their device slots: neither evicted
        while idle nor drained for a colder adapter."""
        if not self.follows_demand:
            return frozenset()
        slots = self.table.num_slots
        return self.demands.hot_set(min((slots + 1) // 2, slots - 1 - len(self.device.pinned)), self.entries)

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
    def start_load(self, name: str) -> None:
        entry = self._get(name)
        if entry.permanent or time.monotonic() < entry.retry_at:
            return
        if entry.loaded is None and entry.future is None:
            entry.error = None
            entry.future = self.pool.submit(self.loader.load, entry.spec)

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

    def fetch(self, spec: AdapterSpec) -> Fetched:
        """Fetch and validate a version on the calling thread, touching no engine state (the admin
        API runs it off the engine thread, so a slow fetch or a large file's hash stalls no
        step); returns what :meth:`prepare` takes as ``fetched``."""
        return self.loader.load(spec)

    def prepare(self, spec: AdapterSpec, fetched: Fetched | None = None) -> LoadedAdapter:
        """Fetch and validate a version (or take what :meth:`fetch` got) without registering it:
        nothing anyone is served changes, whatever the files turn out to be. ``install`` then
        gives it its name."""
        loaded, tier, seconds = fetched or self.loader.load(spec)
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
        if entry.slot is not None and self.drain.draining(name):
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
            self.drain.ask(name, self._on_device, self._drain_victim)
            return None
        self.drain.placed(name)
        entry.placement, entry.placed_at = self.store.place(entry.loaded), time.monotonic()
        slot = entry.placement.slot
        self.host.touch(name)
        if entry.pinned:
            self.device.pin(name)
        self.metrics.observe_load(name, entry.spec.tenant, "host", time.perf_counter() - start)
        return slot

    def overdue_drain(self) -> tuple[str, int] | None:
        """The drained adapter (and its slot) whose running requests the engine should preempt
        (see ``SlotDrain.overdue``); only under demand placement."""
        victim = self.drain.overdue() if self.follows_demand else None
        entry = self.entries.get(victim) if victim is not None else None
        if victim is None or entry is None or entry.slot is None or not entry.running:
            return None
        return victim, entry.slot

    def _drain_victim(self, waiter: str, now: float) -> str | None:
        if not self.follows_demand:  # the policy's own order, as the device tier would evict
            victim = self.device.policy.victim(lambda k: k in self.device.pinned)
            return None if victim is None else str(victim)
        queued = self.queued()
        return drain_victim(self.entries.items(), waiter, now, self.hot_set(), lambda n: self.demand(n, queued))

    def _on_device(self, name: str) -> bool:
        entry = self.entries.get(name)
        return entry is not None and entry.slot is not None

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
        assert isinstance(lease, AdapterEntry)
        return lease.spec.version, lease.loaded.digest if lease.loaded else lease.spec.digest

    def release(self, lease: object) -> None:
        assert isinstance(lease, AdapterEntry)
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
