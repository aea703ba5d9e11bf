"""Decayed demand: counts that fade with a half-life, and the policy that evicts by them."""

from __future__ import annotations

import random

import pytest

from loraplane.eviction import Tier, make_policy
from loraplane.eviction.demand import DecayedCounts, DemandPolicy
from loraplane.sim.tiers import simulate_tiers


def test_a_count_halves_every_half_life() -> None:
    now = [0.0]
    counts = DecayedCounts(10.0, clock=lambda: now[0])
    for _ in range(8):
        counts.add("a")
    assert counts.value("a") == pytest.approx(8.0)
    now[0] = 10.0
    assert counts.value("a") == pytest.approx(4.0)
    now[0] = 30.0
    assert counts.value("a") == pytest.approx(1.0)
    counts.add("a")
    assert counts.value("a") == pytest.approx(2.0)
    assert counts.value("never") == 0.0


def test_order_by_demand_does_not_change_while_time_passes() -> None:
    """The stored values rank keys as their current counts do, at any later time."""
    now = [0.0]
    counts = DecayedCounts(5.0, clock=lambda: now[0])
    for key, n, at in (("a", 6, 0.0), ("b", 2, 8.0), ("c", 1, 12.0)):
        now[0] = at
        for _ in range(n):
            counts.add(key)
    for t in (12.0, 20.0, 100.0):
        now[0] = t
        by_value = sorted("abc", key=counts.value)
        assert by_value == sorted("abc", key=counts.rank_key)
    assert counts.top(2) == sorted("abc", key=counts.value, reverse=True)[:2]


def test_yesterdays_favourite_gives_way_to_todays() -> None:
    """A key asked for 100 times long ago loses its place to one asked for 20 times lately:
    aged LFU (halving every 10,000 accesses) would still keep the old favourite."""
    tier = Tier(2, DemandPolicy(half_life=20))
    lfu = Tier(2, make_policy("lfu"))
    for t in (tier, lfu):
        for _ in range(100):
            t.touch("old")
        for _ in range(20):
            t.touch("new")
        t.insert("third")
    assert "old" not in tier and "new" in tier
    assert "old" in lfu and "new" not in lfu


def test_admission_keeps_a_one_hit_wonder_out() -> None:
    tier = Tier(1, DemandPolicy())
    for _ in range(5):
        tier.touch("hot")
    assert not tier.touch("once")
    assert tier.keys() == ["hot"]


def test_demand_beats_lru_and_lfu_when_the_hot_set_moves() -> None:
    """The daily-fine-tune shape: Zipf 1.1 over 100 adapters whose popularity order is reshuffled
    every 5,000 requests. Recency forgets too fast, frequency too slowly."""
    rng = random.Random(0)
    weights = [1 / (i + 1) ** 1.1 for i in range(100)]
    stream: list[int] = []
    for _ in range(6):
        order = list(range(100))
        rng.shuffle(order)
        stream += [order[i] for i in rng.choices(range(100), weights, k=5000)]
    hits = {p: simulate_tiers(stream, 32, 100, p).gpu_hit_rate for p in ("lru", "lfu", "demand")}
    assert hits["demand"] > hits["lru"] + 0.02
    assert hits["demand"] > hits["lfu"] + 0.05
