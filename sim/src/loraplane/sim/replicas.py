"""Replicas behind a router: what adapter affinity does to hit rates and to the load spread.

Each replica has its own device and host tiers. A request occupies its replica for
``tokens / tokens_per_s`` seconds, which is all the load model the bound needs: in-flight counts
at each arrival. Round-robin spreads load perfectly and scatters every adapter over every replica;
affinity (consistent hashing with bounded loads) keeps each adapter on few replicas.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from loraplane.eviction import Tier, make_policy
from loraplane.routing import BoundedLoadRing
from loraplane.sim.tiers import Costs, HitCounts
from loraplane.sim.trace import Trace

ROUTINGS = ("round-robin", "affinity")


@dataclass(frozen=True, kw_only=True)
class ReplicaResult(HitCounts):
    routing: str
    num_replicas: int
    max_share: float  # busiest replica's share of requests over the even share (1.0 = perfectly even)
    peak_inflight_ratio: float  # worst in-flight load on one replica over the mean (once >= 10 per replica)


def simulate_replicas(
    trace: Trace,
    num_replicas: int,
    gpu_slots: int,
    host_slots: int,
    routing: str,
    *,
    policy: str = "lru",
    epsilon: float = 0.25,
    tokens_per_s: float = 50.0,
    costs: Costs = Costs(),
) -> ReplicaResult:
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; choose one of {', '.join(ROUTINGS)}")
    if policy == "belady":
        raise ValueError("belady needs each replica's future stream; compare online policies across replicas")
    if num_replicas < 1 or tokens_per_s <= 0:
        raise ValueError("num_replicas must be >= 1 and tokens_per_s > 0")
    names = [f"replica-{i}" for i in range(num_replicas)]
    gpu = {r: Tier(gpu_slots, make_policy(policy)) for r in names}
    host = {r: Tier(host_slots, make_policy(policy)) for r in names}
    ring = BoundedLoadRing(names, epsilon=epsilon)
    inflight = dict.fromkeys(names, 0)
    served = dict.fromkeys(names, 0)
    ends: list[tuple[float, str]] = []
    gpu_hits = host_hits = cold = 0
    peak_ratio = 1.0
    for i, (adapter, now, tokens) in enumerate(zip(trace.adapters, trace.timestamps, trace.tokens, strict=True)):
        while ends and ends[0][0] <= now:
            _, done = heapq.heappop(ends)
            inflight[done] -= 1
        if routing == "round-robin":
            replica = names[i % num_replicas]
        else:
            warm = [r for r in names if adapter in gpu[r]] + [r for r in names if adapter in host[r]]
            replica = ring.choose(trace.names[adapter], inflight.__getitem__, warm)
        if gpu[replica].touch(adapter):
            gpu_hits += 1
        elif host[replica].touch(adapter):
            host_hits += 1
        else:
            cold += 1
        inflight[replica] += 1
        served[replica] += 1
        heapq.heappush(ends, (now + max(tokens, 1) / tokens_per_s, replica))
        total = sum(inflight.values())
        if total >= 10 * num_replicas:  # ratios of a handful of requests say nothing about balance
            peak_ratio = max(peak_ratio, inflight[replica] * num_replicas / total)
    n = len(trace)
    return ReplicaResult(
        routing=routing,
        num_replicas=num_replicas,
        requests=n,
        gpu_hits=gpu_hits,
        host_hits=host_hits,
        cold_loads=cold,
        costs=costs,
        max_share=max(served.values()) * num_replicas / n if n else 1.0,
        peak_inflight_ratio=peak_ratio,
    )
