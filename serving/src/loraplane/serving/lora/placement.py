"""Device placement: which host-resident adapters hold the device's slots.

One object owns the device tier (its eviction policy), the slot store (static slots or unified
pages), the drain that frees a slot held by busy adapters, and the demand that ranks adapters for
both. The manager asks :meth:`DevicePlacement.place` on the engine thread between forward passes;
registration, loading and the host tier stay with the manager.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from loraplane.eviction import Tier, TierFullError, make_policy
from loraplane.serving.lora.demand import Demand
from loraplane.serving.lora.drain import SlotDrain, drain_victim
from loraplane.serving.lora.entries import AdapterEntry
from loraplane.serving.lora.shared_pages import SharedPages
from loraplane.serving.lora.slot_store import slot_store
from loraplane.serving.lora.slot_table import SlotTable


class DevicePlacement:
    def __init__(
        self,
        table: SlotTable,
        policy: str,
        entries: Mapping[str, AdapterEntry],
        lookup: Callable[[object], AdapterEntry | None],
        *,
        pages: SharedPages | None = None,
        queued: Callable[[], Mapping[str, int]] = dict,
        owed: Callable[[], Mapping[str, int]] = dict,
    ) -> None:
        """``entries`` is the manager's registry (read live), ``lookup`` also finds retired
        versions by their private key, ``queued`` counts the requests waiting per adapter and
        ``owed`` those still owed their first token (queued, or admitted and in their prompt)."""
        self.num_slots = table.num_slots
        self.entries, self.lookup = entries, lookup
        # "demand" places by demand: a hot set that keeps its slots, and drains chosen by demand.
        # The other policies keep their own order for both (lru: recency, as vLLM's slots do).
        self.follows_demand = policy == "demand"
        self.demands = Demand(queued)
        self.tier = Tier(table.num_slots, make_policy(policy), name="device", in_use=self._held, on_evict=self.take_off)
        self.store = slot_store(table, pages)  # static slots or unified pages, fixed from here on
        self.store.on_kv_short(lambda: self.evict_idle(spare_hot=False))
        # The victim is the one in least demand outside the hot set, never the one that is simply
        # always busy (see drain.drain_victim).
        self.drain = SlotDrain(lambda name: self.demands.queued().get(name, 0) > 0)
        self.owed = owed
        self._spare: frozenset[str] = frozenset()  # a prefetch's: adapters it may not evict (see place)

    def busy(self, key: object) -> bool:
        entry = self.lookup(key)
        return bool(entry and entry.running)

    def _held(self, key: object) -> bool:
        """What the device tier may not evict: adapters with running requests, the hot set, and
        during a prefetch the adapters with requests queued."""
        return self.busy(key) or key in self._spare or key in self.hot_set()

    def hot_set(self) -> frozenset[str]:
        """The engine's own hot set (see ``Demand``): as many adapters as half the device slots
        (rounded up) and never more than ``max_loras - 1`` less the pinned ones, so unpinned
        traffic always has a slot to share. They stay in their device slots: neither evicted
        while idle nor drained for a colder adapter."""
        if not self.follows_demand:
            return frozenset()
        slots = self.num_slots
        return self.demands.hot_set(min((slots + 1) // 2, slots - 1 - len(self.tier.pinned)), self.entries)

    def demand(self, name: str, queued: Mapping[str, int] | None = None) -> float:
        return self.demands.of(name, queued)

    # leaving the device ---------------------------------------------------------------------
    def take_off(self, key: object) -> None:
        """Free the adapter's slot (and pages); the device tier's eviction callback."""
        entry = self.lookup(key)
        if entry is not None and entry.placement is not None:
            self.store.clear(entry.placement)
            entry.placement = None

    def remove(self, key: str) -> None:
        """Off the device, whatever the policy thinks (an unregistration or a host eviction)."""
        self.tier.remove(key)
        self.take_off(key)

    def evict_idle(self, *, spare_hot: bool) -> bool:
        """Take the policy's choice among idle, unpinned device adapters off the device (sparing
        the hot set when another adapter wants the pages; KV pressure spares only pinned ones)."""
        hot = self.hot_set() if spare_hot else frozenset()
        spare = self._spare
        victim = self.tier.policy.victim(lambda k: k in self.tier.pinned or self.busy(k) or k in hot or k in spare)
        if victim is None:
            return False
        self.remove(str(victim))
        return True

    # taking a slot --------------------------------------------------------------------------
    def place(self, name: str, entry: AdapterEntry, *, prefetch_sparing: frozenset[str] | None = None) -> int | None:
        """Put a host-resident adapter into a slot; None when no slot (or no pages) can be freed
        now, in which case a drain is asked for and the caller retries next step.

        A prefetch (``prefetch_sparing`` given: the adapters with requests queued) takes only a
        free slot or an idle one nobody queues for, and asks no drain: it runs ahead of the
        request's turn, and must neither push out an adapter another queued request is about to
        use nor start a drain its request's own turn would not."""
        assert entry.loaded is not None
        self._spare = prefetch_sparing or frozenset()
        try:
            if not self.store.make_room(entry.loaded, lambda: self.evict_idle(spare_hot=True)):
                return None  # KV and busy adapters hold the pool; retry after sequences finish
            try:
                self.tier.insert(name)
            except TierFullError:
                if prefetch_sparing is None:
                    self.drain.ask(name, self._on_device, self._drain_victim)
                return None
        finally:
            self._spare = frozenset()
        self.drain.placed(name)
        entry.placement, entry.placed_step = self.store.place(entry.loaded), self.drain.step
        if entry.pinned:
            self.tier.pin(name)
        return entry.placement.slot

    def begin_step(self, waiting: Iterable[str] = ()) -> tuple[str, int] | None:
        """An engine step begins (the drain's clock ticks); returns the drained adapter (and its
        slot) whose running requests the engine should park now (see ``SlotDrain.overdue``),
        only under demand placement. ``waiting``: the adapters of the queued requests owed their
        first token, in the order admission takes them (see ``_drain_ahead``)."""
        self.drain.tick()
        current = self.drain.current
        if current is not None and (current.victim in self.tier.pinned or current.victim in self.hot_set()):
            # Pinned or hot since the drain chose it: the device tier will not evict it, so the
            # drain could never free its slot, and the victim would admit nothing meanwhile. Seen
            # as the hot customer waiting ten seconds in the demo scenario. The waiter asks again
            # and a drain picks a holder that can leave.
            self.drain.cancel()
        elif current is not None and self.follows_demand and current.victim in self._owing(current.waiter):
            # The victim owes a first token now (a request for it arrived after the admissions of
            # the step its drain began), and the waiter only resumes parked answers: the drain
            # gives way, and the waiter asks again once that token is out (see
            # drain.RESUME_PATIENCE_STEPS).
            self.drain.cancel()
        if self.follows_demand and self.drain.current is None:
            self._drain_ahead(waiting)
        victim = self.drain.overdue() if self.follows_demand else None
        entry = self.entries.get(victim) if victim is not None else None
        if victim is None or entry is None or entry.slot is None or not entry.running:
            return None
        return victim, entry.slot

    def admits(self, name: str) -> bool:
        """Whether a request for ``name``, which holds a slot, may join the batch: not while it
        is drained, except, under demand placement, in the step its drain began. A request
        admitted then runs its prompt in that step and is parked with the rest in the next one
        (their KV kept), so its first token does not wait for the other adapter's whole turn;
        the waiter's wait is the same either way. Under ``lru`` a drain waits for the victim's
        requests to finish, so one more would hold the slot for a whole answer."""
        if not self.drain.draining(name):
            return True
        return self.follows_demand and self.drain.admits(name)

    def _drain_ahead(self, waiting: Iterable[str]) -> None:
        """At the top of a step, before the scheduler runs, the first request in line whose
        adapter is in host memory but not on the device asks for a slot, as admission would when
        it reached that request. When every slot is held (no free slot, no idle adapter to evict)
        and the drain this starts has a victim that owes no first token (its running requests are
        all decoding, nothing is queued for it), the victim is parked at once: the waiter is placed
        and admitted in this step, as if it had been resident, and a turn on a shared slot costs
        the new request no step beyond the holder's SLOT_HOLD_STEPS. Asked from admission, the
        drain parked the victim only in the next step, and each turn cost the new request a step
        (60 to 140 ms in the demo scenario on a CPU) for one more token of each of the victim's
        answers. Where a slot can be had without a drain nothing is done here: admission places the
        adapter when it reaches the request, and evicts nothing for a request it may not reach."""
        for name in waiting:
            entry = self.entries.get(name)
            if entry is None or entry.loaded is None or entry.slot is not None:
                continue  # unknown, loading into host memory (under way already), or placed
            if self.tier.has_room():
                return
            self.drain.ask(name, self._on_device, self._drain_victim)
            d = self.drain.current
            if d is not None and d.waiter == name and self.owed().get(d.victim, 0) == 0:
                self.drain.park_now()
            return

    def _drain_victim(self, waiter: str, now: int) -> str | None:
        if not self.follows_demand:  # the policy's own order, as the device tier would evict
            victim = self.tier.policy.victim(lambda k: k in self.tier.pinned)
            return None if victim is None else str(victim)
        queued = self.demands.queued()
        hot, owing = self.hot_set(), self._owing(waiter)
        return drain_victim(self.entries.items(), waiter, now, hot, lambda n: self.demand(n, queued), owing)

    def _owing(self, waiter: str) -> frozenset[str]:
        """The adapters a drain for ``waiter`` may not take a slot from because they owe a first
        token: none when the waiter owes one itself or has run out of patience."""
        owed = self.owed()
        if owed.get(waiter, 0) > 0 or not self.drain.patient(waiter):
            return frozenset()
        return frozenset(name for name, n in owed.items() if n > 0)

    def _on_device(self, name: str) -> bool:
        entry = self.entries.get(name)
        return entry is not None and entry.slot is not None
