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

The manager composes the parts that do each job: names and versions (``registry``), loads
(``load_queue`` and ``loader``), device slots (``placement``, with its drain and demand), and the
host tier itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from loraplane import eviction
from loraplane.adapter_format import BaseShape, ValidationLimits
from loraplane.admin_api import Tier
from loraplane.eviction import TierFullError, make_policy
from loraplane.serving.lora.adapter_files import AdapterFiles
from loraplane.serving.lora.entries import (
    AdapterEntry,
    AdapterInfo,
    AdapterSpec,
    AdapterUnavailable,
    Fetched,
    LoadFailure,
    PinLimitReached,
)
from loraplane.serving.lora.load_queue import LoadQueue
from loraplane.serving.lora.loader import AdapterLoader
from loraplane.serving.lora.peft_loader import LoadedAdapter
from loraplane.serving.lora.placement import DevicePlacement
from loraplane.serving.lora.registry import AdapterRegistry
from loraplane.serving.lora.shared_pages import SharedPages
from loraplane.serving.lora.slot_table import SlotTable
from loraplane.serving.metrics import EngineMetrics


class AdapterManager:
    def __init__(
        self,
        table: SlotTable,
        base: BaseShape,
        limits: ValidationLimits,
        files: AdapterFiles,
        *,
        max_cpu_loras: int,
        max_loads_in_flight: int = 2,
        policy: str = "demand",
        metrics: EngineMetrics | None = None,
        pages: SharedPages | None = None,
        queued: Callable[[], Mapping[str, int]] = dict,
        owed: Callable[[], Mapping[str, int]] = dict,
    ) -> None:
        """With ``pages`` (and a :class:`PagedSlotTable`), adapters live in the KV block pool:
        each takes the pages its rank needs, and KV pressure evicts idle adapters. ``queued``
        counts the requests waiting per adapter (the scheduler's queue), part of their demand, and
        ``owed`` those of them and of the batch still owed their first token (see ``DevicePlacement``).
        ``max_cpu_loras >= max_loras`` is the config's rule (``EngineConfig``), not checked again.
        ``files``: where adapter files come from (``engine.builder.adapter_files``: the node
        agent's cache or the process's own), the same a dedicated replica's merged adapter came from."""
        self.table, self.base, self.limits, self.files = table, base, limits, files
        self.loader = AdapterLoader(base, limits, self.files)
        self.loads = LoadQueue(self.loader, max_loads_in_flight)
        self.metrics = metrics or EngineMetrics()
        self.registry = AdapterRegistry(on_drop=self._drop, on_retire=self._retire, on_retired_done=self._free_retired)
        self.entries, self.retired = self.registry.entries, self.registry.retired  # read live, never rebound
        self.placement = DevicePlacement(table, policy, self.entries, self.registry.lookup, pages=pages, queued=queued, owed=owed)
        busy, on_evict = self.placement.busy, self._off_host
        self.host = eviction.Tier(max_cpu_loras, make_policy(policy), name="host", in_use=busy, on_evict=on_evict)
        self.device_prefetches = 0  # adapters placed ahead of their request's turn (prefetch_device)

    @property
    def device(self) -> eviction.Tier:
        """The device tier (the placement's own)."""
        return self.placement.tier

    @property
    def catalog(self) -> Mapping[str, AdapterSpec]:
        """The registry's immutable snapshot of names and specs, safe to read off the engine thread."""
        return self.registry.catalog

    # registration (names and versions live in the registry; their residency here) -----------
    def register(self, spec: AdapterSpec) -> None:
        """Declare an adapter (or a new version of one: a new source or digest). Nothing is loaded."""
        self.registry.register(spec)

    def unregister(self, name: str) -> None:
        """New requests stop finding the adapter at once; running ones finish on it first."""
        self.registry.unregister(name)
        self.placement.demands.forget(name)

    def _retire(self, name: str, key: str, entry: AdapterEntry) -> None:
        """A replaced version with running requests keeps its device slot and weights under its
        private key until its last request releases it."""
        if entry.slot is not None:
            self.device.remove(name)
            self.device.insert(key)  # the room it just left: nothing is evicted
        self.host.remove(name)

    def _drop(self, name: str) -> None:
        self.placement.remove(name)
        self.host.remove(name)

    def _free_retired(self, key: str) -> None:
        self.placement.remove(key)

    def _get(self, name: str) -> AdapterEntry:
        return self.registry.get(name)

    # demand ---------------------------------------------------------------------------------
    def note_arrival(self, name: str) -> None:
        """A request for ``name`` arrived (whether or not it can run yet)."""
        self.placement.demands.note_arrival(name)

    def hot_set(self) -> frozenset[str]:
        return self.placement.hot_set()

    def _off_host(self, name: object) -> None:
        """Leaving host memory means leaving the device too: the host tier holds every
        device-resident adapter, so an idle one evicted from host gives up its slot as well."""
        entry = self.entries.get(str(name))
        if entry is not None:
            entry.loaded = None
            self.placement.remove(str(name))

    # loading --------------------------------------------------------------------------------
    def start_load(self, name: str) -> None:
        self.loads.start(self._get(name))

    def check_available(self, name: str) -> None:
        """Raise ``AdapterUnavailable`` for an adapter whose files were refused."""
        entry = self._get(name)
        if entry.permanent:
            raise AdapterUnavailable(f"adapter {name!r} failed to load: {entry.error}")

    def loads_in_flight(self) -> int:
        return self.loads.in_flight(self.entries.values())

    def wait_for_loads(self, timeout: float) -> None:
        self.loads.wait(self.entries.values(), timeout)

    def poll(self) -> list[LoadFailure]:
        """Engine thread: move finished loads into the host tier; report the failed ones."""
        failures = []
        for name, entry in self.loads.finished(self.entries.items()):
            fetched = self.loads.collect(entry)
            if fetched is not None:
                loaded, tier, seconds = fetched
                self.metrics.observe_load(name, entry.spec.tenant, tier, seconds)
                try:
                    self._hold(name, loaded)
                    continue
                except TierFullError as err:
                    entry.error = str(err)
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
        """Loaded weights enter the host tier (unless already there); raises ``TierFullError`` when
        every host slot is pinned or busy."""
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
        if entry.slot is not None and not self.placement.admits(name):
            return None
        if entry.slot is not None:
            self.device.touch(name)
            self.host.touch(name)
            return entry.slot
        if entry.loaded is None:
            self.start_load(name)
            return None
        return self._place(name, entry)

    def _place(self, name: str, entry: AdapterEntry, prefetch_sparing: frozenset[str] | None = None) -> int | None:
        """Host -> device, timed as a host-tier load (its count is the swaps); see ``DevicePlacement.place``."""
        start = time.perf_counter()
        slot = self.placement.place(name, entry, prefetch_sparing=prefetch_sparing)
        if slot is not None:
            self.host.touch(name)
            self.metrics.observe_load(name, entry.spec.tenant, "host", time.perf_counter() - start)
        return slot

    def prefetch_device(self, queued: Iterable[str]) -> int:
        """Place the adapters of queued requests the scheduler did not reach this step (``queued``,
        in queue order) now, before the step's forward pass is issued, so their host -> device
        copies run on the slot writes' side stream beside that step rather than in front of the
        step that admits them. Only what a slot can take without a drain or evicting an adapter
        with requests queued (``DevicePlacement.place``); stops at the first that cannot be
        placed, since the rest would find no room either. Returns how many were placed."""
        wanted = list(dict.fromkeys(queued))
        sparing, placed = frozenset(wanted), 0
        for name in wanted:
            entry = self.entries.get(name)
            if entry is None or entry.loaded is None or entry.slot is not None:
                continue  # unknown, still loading into host memory (under way already), or placed
            if self._place(name, entry, sparing) is None:
                break
            placed += 1
        self.device_prefetches += placed
        return placed

    def begin_step(self, waiting: Iterable[str] = ()) -> tuple[str, int] | None:
        """Called once per engine step: the drained adapter whose running requests to park.
        ``waiting``: the adapters of the queued requests owed their first token, in the order
        admission takes them (``DevicePlacement.begin_step``)."""
        return self.placement.begin_step(waiting)

    def residency(self, name: str) -> Tier:
        return self._get(name).residency

    def cache_key(self, name: str) -> str:
        """What the prefix cache keys this version's KV by: the adapter digest, since a new config
        (``lora_alpha``) over the same weights computes different KV."""
        entry = self._get(name)
        assert entry.loaded is not None
        return f"{name}@{entry.loaded.manifest.adapter_digest}"

    def acquire(self, name: str) -> object:
        """Count a running request against the adapter; returns the lease to release, which stays
        with this version even if the name is re-registered meanwhile."""
        return self.registry.acquire(name)

    @staticmethod
    def lease_version(lease: object) -> tuple[str | None, str | None]:
        """The version label and digest a lease runs on: the one its registration declared (what
        the operator's status names), else the adapter digest its files hash to."""
        assert isinstance(lease, AdapterEntry)
        return lease.spec.version, lease.spec.digest or (lease.loaded.manifest.adapter_digest if lease.loaded else None)

    def release(self, lease: object) -> None:
        assert isinstance(lease, AdapterEntry)
        self.registry.release(lease)

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
        self.files.pin(entry.spec.source)
        if name in self.host:
            self.host.pin(name)
        if name in self.device:
            self.device.pin(name)
        if entry.loaded is None:
            self.start_load(name)

    def unpin(self, name: str) -> None:
        entry = self._get(name)
        entry.pinned = False
        self.files.unpin(entry.spec.source)
        self.host.unpin(name)
        self.device.unpin(name)

    def prefetch(self, name: str) -> None:
        """Start bringing the adapter into host memory; the device slot follows on first use."""
        self.start_load(name)

    def info(self, name: str) -> AdapterInfo:
        return self._get(name).info(name)

    def close(self) -> None:
        self.loads.close()
        self.files.close()
