"""Two-tier adapter cache simulation: device slots in front of a host cache in front of cold storage.

The model is the seed lesson's: a request touches the device tier first (inserting on a miss) and
touches the host tier only on a device miss (inserting on a miss there too); a miss in both is a
cold load. Host hits and cold loads cost fixed latencies. Because the host tier sees only device
misses, the run is done in two passes (device, then host over the miss stream); this is the same
result as interleaving, and it lets Belady's MIN see each tier's own future.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from loraplane.eviction import Tier, make_policy


@dataclass(frozen=True)
class Costs:
    """Load latencies per tier, in milliseconds (the seed's example values by default)."""

    host_ms: float = 3.0
    cold_ms: float = 120.0


@dataclass(frozen=True, kw_only=True)
class HitCounts:
    """Where each request's adapter was found: device slot, host cache, or cold storage."""

    requests: int
    gpu_hits: int
    host_hits: int
    cold_loads: int
    costs: Costs = Costs()

    @property
    def gpu_hit_rate(self) -> float:
        return self.gpu_hits / self.requests if self.requests else 0.0

    @property
    def host_hit_rate(self) -> float:
        return self.host_hits / self.requests if self.requests else 0.0

    @property
    def mean_wait_ms(self) -> float:
        if not self.requests:
            return 0.0
        return (self.host_hits * self.costs.host_ms + self.cold_loads * self.costs.cold_ms) / self.requests


@dataclass(frozen=True, kw_only=True)
class TierResult(HitCounts):
    policy: str
    gpu_slots: int
    host_slots: int


def _run_tier(stream: Sequence[Hashable], slots: int, policy: str, pinned: Iterable[Hashable] = ()) -> list[int]:
    """Replay ``stream`` through one tier; returns the positions that missed."""
    tier = Tier(slots, make_policy(policy, future=stream if policy == "belady" else None))
    for key in pinned:
        if len(tier) < slots:
            tier.insert(key)
            tier.pin(key)
    return [i for i, key in enumerate(stream) if not tier.touch(key)]


def simulate_tiers(
    adapters: Sequence[Hashable],
    gpu_slots: int,
    host_slots: int,
    policy: str = "lru",
    *,
    costs: Costs = Costs(),
    pinned: Sequence[Hashable] = (),
) -> TierResult:
    """Replay a request stream through device and host tiers with one eviction policy.

    ``pinned`` adapters are loaded into device slots before the first request and never evicted,
    as the operator's auto-pinner does for the hot set.
    """
    gpu_misses = _run_tier(adapters, gpu_slots, policy, pinned)
    host_stream = [adapters[i] for i in gpu_misses]
    cold = len(_run_tier(host_stream, host_slots, policy))
    label = f"{policy}+pin{len(pinned)}" if pinned else policy
    return TierResult(
        policy=label,
        gpu_slots=gpu_slots,
        host_slots=host_slots,
        requests=len(adapters),
        gpu_hits=len(adapters) - len(gpu_misses),
        host_hits=len(host_stream) - cold,
        cold_loads=cold,
        costs=costs,
    )


def min_misses(stream: Sequence[Hashable], slots: int) -> int:
    return len(_run_tier(stream, slots, "belady"))


def lower_bound_wait_ms(adapters: Sequence[Hashable], gpu_slots: int, host_slots: int, costs: Costs = Costs()) -> float:
    """A bound on mean load wait that no policy, online or offline, can beat in this model.

    Device misses are at least MIN's misses with ``gpu_slots``; a cold load happens only when the
    adapter is in neither tier, whose union never holds more than ``gpu_slots + host_slots``
    adapters, so cold loads are at least MIN's misses at that size. Wait is
    ``host_ms * device_misses + (cold_ms - host_ms) * cold_loads``, so both bounds combine.
    """
    if not adapters:
        return 0.0
    gpu_min = min_misses(adapters, gpu_slots)
    cold_min = min_misses(adapters, gpu_slots + host_slots)
    return (costs.host_ms * gpu_min + (costs.cold_ms - costs.host_ms) * cold_min) / len(adapters)
