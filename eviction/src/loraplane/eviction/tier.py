"""A capacity-bounded tier of adapters (device slots or host cache) driven by an eviction policy.

Capacity is counted in units the caller chooses: one per adapter for static slots, pages or bytes
when adapters of different ranks share a pool (S-LoRA's unified paging). Pinned keys and keys the
caller reports as in use (adapters with running sequences) are never evicted, whatever the policy
says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable

from loraplane.eviction.policies import EvictionPolicy

Key = Hashable


class TierFullError(RuntimeError):
    """Nothing evictable is left: every resident key is pinned or in use."""


class Tier:
    def __init__(
        self,
        capacity: int,
        policy: EvictionPolicy,
        *,
        name: str = "tier",
        in_use: Callable[[Key], bool] | None = None,
        on_evict: Callable[[Key], None] | None = None,
    ) -> None:
        if capacity < 0:
            raise ValueError(f"{name}: capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        self.name = name
        self._in_use = in_use or (lambda _key: False)
        self._on_evict = on_evict
        self._size: dict[Key, int] = {}
        self._pinned: set[Key] = set()
        self.used = 0

    def __contains__(self, key: object) -> bool:
        return key in self._size

    def __len__(self) -> int:
        return len(self._size)

    def keys(self) -> list[Key]:
        return list(self._size)

    def size(self, key: Key) -> int | None:
        """The units a resident key takes; None when it is not resident."""
        return self._size.get(key)

    @property
    def pinned(self) -> frozenset[Key]:
        return frozenset(self._pinned)

    def _protected(self, key: Key) -> bool:
        return key in self._pinned or self._in_use(key)

    def touch(self, key: Key, size: int = 1) -> bool:
        """One request for ``key``: True on a hit; on a miss, cache it if the policy admits it."""
        if key in self._size:
            self.policy.on_hit(key)
            return True
        self.policy.on_miss(key)
        # On TierFullError the request is served by bypass: the load happened, the tier cannot keep it.
        with contextlib.suppress(TierFullError):
            self.insert(key, size, admit=True)
        return False

    def insert(self, key: Key, size: int = 1, *, admit: bool = False) -> list[Key]:
        """Make ``key`` resident, evicting as needed; returns the evicted keys.

        With ``admit`` the policy's admission filter may decline to keep the key (a caching
        decision on the request path: nothing is evicted, nothing raised). Without it the caller
        needs the key resident (a prefetch, a device slot for a running sequence) and it goes in.
        Raises :class:`TierFullError` if only protected keys could make room.
        """
        if key in self._size:
            return []
        if size > self.capacity:
            raise TierFullError(f"{self.name}: {key!r} needs {size} units, capacity is {self.capacity}")
        victims = self._victims_for(size)
        if victims is None:
            raise TierFullError(f"{self.name}: no room for {key!r}; every resident adapter is pinned or in use")
        if admit and victims and not self.policy.admit(key, victims[0]):
            return []
        for victim in victims:
            self.remove(victim)
            if self._on_evict is not None:
                self._on_evict(victim)
        self._size[key] = size
        self.used += size
        self.policy.on_insert(key)
        return victims

    def has_room(self, size: int = 1) -> bool:
        """Whether ``insert`` of ``size`` units would succeed now, evicting only what it may."""
        return size <= self.capacity and self._victims_for(size) is not None

    def _victims_for(self, size: int) -> list[Key] | None:
        """The keys, in the policy's order, whose eviction makes room for ``size`` more units;
        None when only protected keys could."""
        victims: list[Key] = []
        freed = 0
        while self.used - freed + size > self.capacity:
            victim = self.policy.victim(lambda k: self._protected(k) or k in victims)
            if victim is None:
                return None
            victims.append(victim)
            freed += self._size[victim]
        return victims

    def remove(self, key: Key) -> None:
        size = self._size.pop(key, None)
        if size is None:
            return
        self.used -= size
        self._pinned.discard(key)
        self.policy.on_remove(key)

    def pin(self, key: Key) -> None:
        if key not in self._size:
            raise KeyError(f"{self.name}: cannot pin {key!r}, it is not resident")
        self._pinned.add(key)

    def unpin(self, key: Key) -> None:
        self._pinned.discard(key)
