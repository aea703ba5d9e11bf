"""The statistics the operator, the router and the benchmarks share: counters summed over replicas
and differenced over an interval, nearest-rank percentiles, and rates across a replica restart."""

from __future__ import annotations

import pytest

from loraplane.admin_api import Counters, percentile, rate


def counters(requests: int, cold: int, loads: dict[str, tuple[int, float]], recent: list[float]) -> Counters:
    return Counters.model_validate({
        "requests": requests, "cold_loads": cold, "recent_load_ms": recent,
        "load_seconds": {t: {"count": n, "sum": s} for t, (n, s) in loads.items()},
    })  # fmt: skip


def test_counters_add_over_replicas_and_difference_over_an_interval() -> None:
    a = counters(10, 2, {"cold": (2, 0.4)}, [200.0])
    b = counters(5, 1, {"host": (3, 0.03)}, [10.0])
    total = a.plus(b)
    assert (total.requests, total.cold_loads, total.loads) == (15, 3, 5)
    assert total.load_seconds_total == pytest.approx(0.43) and sorted(total.recent_load_ms) == [10.0, 200.0]
    later = counters(14, 2, {"cold": (2, 0.4), "host": (1, 0.01)}, [200.0, 10.0])
    delta = later.since(a)
    assert (delta.requests, delta.cold_loads, delta.loads) == (4, 0, 1)


def test_percentile_is_a_value_some_request_had() -> None:
    values = [5.0, 1.0, 3.0, 100.0, 2.0]
    assert percentile(values, 0.5) == 3.0 and percentile(values, 0.99) == 100.0
    assert percentile([], 0.5) is None


def test_a_counter_that_went_down_is_a_restart_not_a_negative_rate() -> None:
    assert rate(100, 130, 10) == 3.0
    assert rate(100, 20, 10) == 2.0  # the replica restarted and has counted 20 since
    assert rate(1, 2, 0) == 0.0
