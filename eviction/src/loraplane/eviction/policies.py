"""Eviction policies: which resident adapter leaves a full tier, and whether a newcomer stays.

A policy only orders keys; capacity, pinning and "in use" live in :class:`~loraplane.eviction.tier.Tier`,
so every policy honours them the same way. Each policy sees the tier's access stream through
``on_hit``/``on_insert``/``on_remove`` and answers ``victim(skip)`` with the key it would evict
first among those ``skip`` does not protect.

Policies:

* ``lru`` - least recently used; the baseline every serving stack ships.
* ``lfu`` - frequency with aging: counts are kept for every key ever seen (adapters number in the
  thousands, not millions, so a dict is cheaper and exact where TinyLFU would use a count-min
  sketch) and halved every ``aging_period`` accesses, so yesterday's hot adapter cools down.
* ``tinylfu`` - ``lfu`` eviction plus TinyLFU admission: a newcomer is kept only if it has been
  asked for more often than the victim it would displace. One-hit wonders then pass through a
  tier without flushing the hot set.
* ``demand`` - decayed demand (:mod:`loraplane.eviction.demand`): evict the key asked for least
  lately, counts decaying continuously with a half-life, with TinyLFU's admission filter.
* ``belady`` - Belady's MIN: evict the key needed furthest in the future. Offline (it is handed the
  whole access stream up front), so it only runs in the simulator, as the bound for the others.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Literal, Protocol, get_args

Key = Hashable
Skip = Callable[[Key], bool]


class LazyHeap:
    """The victim search of the heap-ordered policies: a min-heap of ``(priority, key)``
    snapshots. A snapshot goes stale when its key is accessed again, re-aged or leaves the tier;
    the policy's ``current`` test drops stale ones as they surface, so finding a victim costs
    O(log n) amortised instead of a scan over every resident adapter."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[float, ...], int, Key]] = []
        self._seq = 0  # tie-breaker so entries never compare keys of different types

    def push(self, priority: tuple[float, ...], key: Key) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (priority, self._seq, key))

    def clear(self) -> None:
        self._heap = []

    def first(self, current: Callable[[tuple[float, ...], Key], bool], skip: Skip) -> Key | None:
        """The lowest-priority live key that ``skip`` does not protect; live entries stay."""
        kept: list[tuple[tuple[float, ...], int, Key]] = []
        found: Key | None = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            priority, _, key = entry
            if not current(priority, key):
                continue
            kept.append(entry)  # a victim stays valid until the tier actually removes it
            if not skip(key):
                found = key
                break
        for entry in kept:
            heapq.heappush(self._heap, entry)
        return found


class EvictionPolicy(Protocol):
    """What a :class:`Tier` needs from a policy."""

    name: str

    def on_hit(self, key: Key) -> None: ...

    def on_miss(self, key: Key) -> None: ...

    def on_insert(self, key: Key) -> None: ...

    def on_remove(self, key: Key) -> None: ...

    def victim(self, skip: Skip) -> Key | None: ...

    def admit(self, candidate: Key, victim: Key) -> bool: ...


class LRUPolicy:
    """Evict the resident key whose last access is oldest."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def on_hit(self, key: Key) -> None:
        self._order.move_to_end(key)

    def on_miss(self, key: Key) -> None:
        pass

    def on_insert(self, key: Key) -> None:
        self._order[key] = None

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, skip: Skip) -> Key | None:
        return next((k for k in self._order if not skip(k)), None)

    def admit(self, candidate: Key, victim: Key) -> bool:
        return True


class LFUAgingPolicy:
    """Evict the resident key with the lowest aged frequency; ties go to the least recent.

    The victim search uses a lazy heap of ``(count, last_access, key)`` snapshots: stale entries
    (the key was accessed again, aged, or left) are dropped when popped, so an eviction costs
    O(log n) amortised instead of a scan over every resident adapter.
    """

    name = "lfu"

    def __init__(self, aging_period: int = 10_000) -> None:
        if aging_period < 1:
            raise ValueError(f"aging_period must be >= 1, got {aging_period}")
        self.aging_period = aging_period
        self._count: dict[Key, int] = {}
        self._last: dict[Key, int] = {}
        self._resident: set[Key] = set()
        self._heap = LazyHeap()
        self._tick = 0

    def frequency(self, key: Key) -> int:
        return self._count.get(key, 0)

    def _touch(self, key: Key) -> None:
        self._tick += 1
        self._count[key] = self._count.get(key, 0) + 1
        self._last[key] = self._tick
        if self._tick % self.aging_period == 0:
            self._age()
        elif key in self._resident:
            self._push(key)

    def _age(self) -> None:
        self._count = {k: c // 2 for k, c in self._count.items() if c // 2 > 0 or k in self._resident}
        self._heap.clear()
        for k in self._resident:
            self._push(k)

    def _priority(self, key: Key) -> tuple[float, ...]:
        return (self._count.get(key, 0), self._last.get(key, 0))

    def _push(self, key: Key) -> None:
        self._heap.push(self._priority(key), key)

    def on_hit(self, key: Key) -> None:
        self._touch(key)

    def on_miss(self, key: Key) -> None:
        self._touch(key)

    def on_insert(self, key: Key) -> None:
        self._resident.add(key)
        self._push(key)

    def on_remove(self, key: Key) -> None:
        self._resident.discard(key)

    def victim(self, skip: Skip) -> Key | None:
        return self._heap.first(lambda prio, key: key in self._resident and prio == self._priority(key), skip)

    def admit(self, candidate: Key, victim: Key) -> bool:
        return True


class TinyLFUPolicy(LFUAgingPolicy):
    """Aged LFU eviction with TinyLFU's admission filter."""

    name = "tinylfu"

    def admit(self, candidate: Key, victim: Key) -> bool:
        return self.frequency(candidate) > self.frequency(victim)


class BeladyPolicy:
    """Belady's MIN over a known access stream: evict the key whose next use is furthest away.

    It must be fed exactly ``future``, access by access; a divergence is a bug in the caller and
    raises, because a MIN that silently drifts from its stream is no longer a bound.
    """

    name = "belady"

    def __init__(self, future: Sequence[Key]) -> None:
        self._future = future
        self._next = _next_use(future)
        self._pos = 0
        self._next_use: dict[Key, int] = {}
        self._heap = LazyHeap()
        self._resident: set[Key] = set()

    def _advance(self, key: Key) -> None:
        if self._pos >= len(self._future) or self._future[self._pos] != key:
            raise RuntimeError(f"belady: access #{self._pos} is {key!r}, not the stream it was given")
        self._next_use[key] = self._next[self._pos]
        self._pos += 1
        if key in self._resident:
            self._heap.push((-self._next_use[key], self._pos), key)

    def on_hit(self, key: Key) -> None:
        self._advance(key)

    def on_miss(self, key: Key) -> None:
        self._advance(key)

    def on_insert(self, key: Key) -> None:
        self._resident.add(key)
        self._heap.push((-self._next_use.get(key, len(self._future)), self._pos), key)

    def on_remove(self, key: Key) -> None:
        self._resident.discard(key)

    def victim(self, skip: Skip) -> Key | None:
        horizon = len(self._future)
        return self._heap.first(lambda prio, key: key in self._resident and -prio[0] == self._next_use.get(key, horizon), skip)

    def admit(self, candidate: Key, victim: Key) -> bool:
        # MIN with bypass: keeping a key needed later than the victim can only cost misses.
        return self._next_use.get(candidate, len(self._future)) < self._next_use.get(victim, len(self._future))


def _next_use(stream: Sequence[Key]) -> list[int]:
    """For each position, the index of the same key's next access (len(stream) if none)."""
    nxt = [len(stream)] * len(stream)
    seen: dict[Key, int] = {}
    for i in range(len(stream) - 1, -1, -1):
        nxt[i] = seen.get(stream[i], len(stream))
        seen[stream[i]] = i
    return nxt


POLICY_NAMES = ("lru", "lfu", "tinylfu", "demand", "belady")
# What a serving engine can run (Belady needs the future); the type its configuration fields use.
OnlinePolicyName = Literal["lru", "lfu", "tinylfu", "demand"]
ONLINE_POLICY_NAMES: tuple[str, ...] = get_args(OnlinePolicyName)


def make_policy(name: str, future: Sequence[Key] | None = None) -> EvictionPolicy:
    """Build a policy by name; ``belady`` needs the access stream it will be fed."""
    if name == "lru":
        return LRUPolicy()
    if name == "lfu":
        return LFUAgingPolicy()
    if name == "tinylfu":
        return TinyLFUPolicy()
    if name == "demand":
        from loraplane.eviction.demand import DemandPolicy  # it builds on this module's protocol

        return DemandPolicy()
    if name == "belady":
        if future is None:
            raise ValueError("belady is offline: it needs the future access stream")
        return BeladyPolicy(future)
    raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
