"""Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2018).

An adapter hashes to a point on a ring of replicas; it goes to the first replica clockwise whose
in-flight load is below ``ceil((1 + epsilon) * (total + 1) / replicas)``. Warm replicas keep their
adapters (affinity), and no replica carries more than (1+epsilon) times the mean, so one hot
adapter overflows to the next replica on the ring instead of melting its home.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Sequence


def _point(label: str) -> int:
    # blake2b rather than hash(): Python salts str hashes per process, and the router and the
    # simulator must place an adapter on the same replica every time.
    return int.from_bytes(hashlib.blake2b(label.encode(), digest_size=8).digest(), "big")


class BoundedLoadRing:
    def __init__(self, replicas: Sequence[str], *, epsilon: float = 0.25, virtual_nodes: int = 64) -> None:
        if not replicas:
            raise ValueError("a ring needs at least one replica")
        if len(set(replicas)) != len(replicas):
            raise ValueError("replica names must be unique")
        if epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {epsilon}")
        self.replicas = list(replicas)
        self.epsilon = epsilon
        ring = sorted((_point(f"{r}#{v}"), r) for r in self.replicas for v in range(virtual_nodes))
        self._points = [p for p, _ in ring]
        self._owners = [r for _, r in ring]

    def capacity(self, total_load: int) -> int:
        """Largest load a replica may have when a new request arrives."""
        return math.ceil((1 + self.epsilon) * (total_load + 1) / len(self.replicas))

    def preference(self, key: str) -> list[str]:
        """Replicas in ring order starting at ``key``'s point, each once."""
        start = bisect.bisect(self._points, _point(key)) % len(self._points)
        seen: list[str] = []
        for i in range(len(self._points)):
            owner = self._owners[(start + i) % len(self._points)]
            if owner not in seen:
                seen.append(owner)
                if len(seen) == len(self.replicas):
                    break
        return seen

    def choose(self, key: str, load: Callable[[str], int], candidates: Sequence[str] | None = None) -> str:
        """The first replica for ``key`` under the load bound; ``candidates`` are tried first.

        ``candidates`` lets a router put replicas that already hold the adapter ahead of the ring
        order while the same bound still applies to them.
        """
        total = sum(load(r) for r in self.replicas)
        cap = self.capacity(total)
        order = [c for c in (candidates or []) if c in self.replicas]
        order += [r for r in self.preference(key) if r not in order]
        for replica in order:
            if load(replica) < cap:
                return replica
        return min(self.replicas, key=load)  # unreachable with epsilon >= 0; kept as a safe fallback
