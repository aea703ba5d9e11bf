"""Eviction policies when the hot set moves: the daily-fine-tune shape, in the simulator.

Run: python benchmarks/policy_drift_bench.py  (a few seconds)

Zipf 1.1 over 100 adapters; every 5,000 requests the popularity order is reshuffled (8 phases,
40,000 requests). GPU hit rate at 32 GPU / 100 host slots per policy, then the ``demand``
policy's half-life swept. `loraplane sim --compare` is the stationary counterpart.
"""

from __future__ import annotations

import random

from loraplane.eviction.demand import DemandPolicy
from loraplane.eviction.tier import Tier
from loraplane.sim.tiers import simulate_tiers


def drifting_stream(adapters: int = 100, phases: int = 8, per_phase: int = 5000, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** 1.1 for i in range(adapters)]
    stream: list[int] = []
    for _ in range(phases):
        order = list(range(adapters))
        rng.shuffle(order)
        stream += [order[i] for i in rng.choices(range(adapters), weights, k=per_phase)]
    return stream


def main() -> None:
    stream = drifting_stream()
    print(f"{len(stream)} requests, hot set reshuffled every 5,000; GPU hit rate at 32 GPU / 100 host slots")
    for policy in ("lru", "lfu", "tinylfu", "demand", "belady"):
        print(f"  {policy:<8} {100 * simulate_tiers(stream, 32, 100, policy).gpu_hit_rate:.1f}%")
    print("demand, device tier alone, by half-life (accesses)")
    for half_life in (100, 200, 500, 1000, 3000):
        tier = Tier(32, DemandPolicy(half_life))
        hits = sum(tier.touch(key) for key in stream)
        print(f"  {half_life:>5} {100 * hits / len(stream):.1f}%")


if __name__ == "__main__":
    main()
