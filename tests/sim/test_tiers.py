"""Tier simulation: the published figures, the policy targets and the bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.sim.tiers import Costs, lower_bound_wait_ms, simulate_tiers
from loraplane.sim.trace import zipf_trace

PUBLISHED = [  # GPU slots, host slots, GPU hit %, host hit %, disk loads, mean wait ms
    (8, 100, 29.6, 44.4, 12968, 32.46),
    (32, 100, 54.5, 19.1, 13187, 32.22),
    (32, 500, 54.5, 44.5, 500, 2.54),
    (128, 500, 78.2, 20.8, 500, 1.83),
]


@pytest.fixture(scope="module")
def trace_adapters() -> list[int]:
    return zipf_trace().adapters


@pytest.mark.parametrize(("gpu", "host", "gpu_hit", "host_hit", "disk", "wait"), PUBLISHED)
def test_lru_reproduces_the_published_table(
    trace_adapters: list[int], gpu: int, host: int, gpu_hit: float, host_hit: float, disk: int, wait: float
) -> None:
    r = simulate_tiers(trace_adapters, gpu, host, "lru")
    assert (round(100 * r.gpu_hit_rate, 1), round(100 * r.host_hit_rate, 1), r.cold_loads) == (gpu_hit, host_hit, disk)
    assert round(r.mean_wait_ms, 2) == wait
    assert r.gpu_hits + r.host_hits + r.cold_loads == r.requests


def test_best_online_policy_cuts_wait_by_a_third_and_stays_above_belady(trace_adapters: list[int]) -> None:
    lru = simulate_tiers(trace_adapters, 32, 100, "lru")
    online = [simulate_tiers(trace_adapters, 32, 100, p) for p in ("lfu", "tinylfu")]
    best = min(online, key=lambda r: r.mean_wait_ms)
    belady = simulate_tiers(trace_adapters, 32, 100, "belady")
    bound = lower_bound_wait_ms(trace_adapters, 32, 100)
    assert best.mean_wait_ms <= 0.65 * lru.mean_wait_ms
    assert bound <= belady.mean_wait_ms <= best.mean_wait_ms
    assert belady.gpu_hits >= max(r.gpu_hits for r in [lru, *online])


def test_pinning_the_hot_set_beats_plain_lru(trace_adapters: list[int]) -> None:
    hot = sorted(set(trace_adapters), key=trace_adapters.count, reverse=True)[:16]
    plain = simulate_tiers(trace_adapters, 32, 100, "lru")
    pinned = simulate_tiers(trace_adapters, 32, 100, "lru", pinned=hot)
    assert pinned.policy == "lru+pin16"
    assert pinned.gpu_hits > plain.gpu_hits and pinned.mean_wait_ms < plain.mean_wait_ms


def test_costs_scale_the_wait() -> None:
    r = simulate_tiers([1, 2, 1, 3], 1, 1, "lru", costs=Costs(host_ms=10, cold_ms=100))
    # one host slot: by the second request for 1, the host tier holds 2, so every request is cold
    assert (r.gpu_hits, r.host_hits, r.cold_loads) == (0, 0, 4)
    assert r.mean_wait_ms == 100
    r = simulate_tiers([1, 2, 1], 1, 2, "lru", costs=Costs(host_ms=10, cold_ms=100))
    assert (r.gpu_hits, r.host_hits, r.cold_loads) == (0, 1, 2)
    assert r.mean_wait_ms == pytest.approx(210 / 3)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=120), st.integers(1, 4), st.integers(0, 6))
def test_no_policy_beats_the_lower_bound(stream: list[int], gpu: int, host: int) -> None:
    bound = lower_bound_wait_ms(stream, gpu, host)
    for policy in ("lru", "lfu", "tinylfu", "belady"):
        assert simulate_tiers(stream, gpu, host, policy).mean_wait_ms >= bound - 1e-9
