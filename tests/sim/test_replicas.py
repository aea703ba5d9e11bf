"""Replicas behind round-robin and adapter-affinity routing, and the bounded-load ring itself."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from loraplane.routing import BoundedLoadRing
from loraplane.sim.replicas import simulate_replicas
from loraplane.sim.trace import Trace, zipf_trace


def test_affinity_raises_hit_rates_and_keeps_load_bounded() -> None:
    trace = zipf_trace(num_requests=20_000)
    rr = simulate_replicas(trace, 4, 32, 100, "round-robin")
    aff = simulate_replicas(trace, 4, 32, 100, "affinity", epsilon=0.25)
    assert rr.max_share == pytest.approx(1.0)
    assert aff.gpu_hit_rate > rr.gpu_hit_rate + 0.1
    assert aff.cold_loads < rr.cold_loads / 2
    assert aff.mean_wait_ms < rr.mean_wait_ms
    # the bound is (1+eps) x mean at each arrival, rounded up to whole requests
    assert aff.peak_inflight_ratio <= 1.25 + 4 / 40


def test_a_single_hot_adapter_overflows_instead_of_melting_one_replica() -> None:
    n = 4000
    trace = Trace([0] * n, ["hot"], [i * 0.01 for i in range(n)], ["t"] * n, [256] * n)
    aff = simulate_replicas(trace, 3, 8, 16, "affinity", epsilon=0.1)
    assert aff.peak_inflight_ratio <= 1.1 + 3 / 30
    assert aff.max_share < 1.2  # the hot adapter spread over all three


def test_ring_prefers_warm_candidates_within_the_bound() -> None:
    ring = BoundedLoadRing(["a", "b", "c"], epsilon=0.0)
    load = {"a": 0, "b": 0, "c": 0}
    home = ring.preference("adapter-x")[0]
    assert ring.choose("adapter-x", load.__getitem__) == home
    warm = next(r for r in "abc" if r != home)
    assert ring.choose("adapter-x", load.__getitem__, [warm]) == warm
    load[warm] = 5  # over ceil((0+1)*(5+1)/3) = 2
    assert ring.choose("adapter-x", load.__getitem__, [warm]) != warm


def test_ring_placement_is_stable_across_processes() -> None:
    """The router and the simulator run in different processes and must agree on every home."""
    code = (
        "from loraplane.routing import BoundedLoadRing as R\n"
        "print([R(['r0', 'r1', 'r2']).preference(f'a{i}')[0] for i in range(50)])"
    )
    homes = {
        subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True, text=True, check=True
        ).stdout
        for seed in ("1", "2")
    }
    assert len(homes) == 1
    assert set(ast.literal_eval(homes.pop())) == {"r0", "r1", "r2"}  # and the ring spreads adapters over every replica


def test_ring_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one replica"):
        BoundedLoadRing([])
    with pytest.raises(ValueError, match="unique"):
        BoundedLoadRing(["a", "a"])
    with pytest.raises(ValueError, match="unknown routing"):
        simulate_replicas(zipf_trace(num_requests=10), 2, 1, 1, "random")
