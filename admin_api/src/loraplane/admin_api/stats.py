"""The statistics every reader of replica counters computes, written once so the operator's status,
the benchmarks' reports and the router agree on what a p99 or a rate is."""

from __future__ import annotations

from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 1]); None for no values. Nearest rank, not
    interpolation, so a reported p99 is a latency some request actually had."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else None


def rate(before: float, after: float, seconds: float) -> float:
    """Per-second rate of a counter between two readings. Counters restart with their replica, so
    a decrease counts as a fresh start from zero rather than a negative rate."""
    if seconds <= 0:
        return 0.0
    delta = after - before
    return (delta if delta >= 0 else after) / seconds
