"""The operator's decisions as pure functions of plain inputs: what the replicas' figures mean for an
adapter's status, when a status write is worth it, which adapters a replica lacks, which to pin.
Handlers gather the inputs and apply the outputs; everything here is tested without a cluster."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from loraplane.admin_api import Counters, percentile, rate
from loraplane.operator.api.loraadapter import AdapterMetrics


@dataclass(frozen=True)
class Sample:
    """An adapter's counters summed over the replicas at one moment."""

    at: float
    counters: Counters = field(default_factory=Counters)


def sample(at: float, per_replica: Iterable[Counters]) -> Sample:
    """Sum one adapter's ``/admin/stats`` entries from every replica that knows it (their recent
    load durations pooled)."""
    total = Counters()
    for entry in per_replica:
        total = total.plus(entry)
    return Sample(at, total)


def request_rate(previous: Sample | None, now: Sample) -> float | None:
    """Requests per second between two samples; None without an earlier one."""
    if previous is None or now.at <= previous.at:
        return None
    return rate(previous.counters.requests, now.counters.requests, now.at - previous.at)


def metrics(previous: Sample | None, now: Sample, last_updated: str) -> AdapterMetrics:
    """Status figures: the request rate over the interval since ``previous``, hit rates and load
    latencies over everything the replicas have seen."""
    c = now.counters
    arrivals = c.arrivals
    mean_load = 1e3 * c.load_seconds_total / c.loads if c.loads else None
    p50, p99 = percentile(c.recent_load_ms, 0.5), percentile(c.recent_load_ms, 0.99)
    return AdapterMetrics(
        requests_per_second=round(request_rate(previous, now) or 0.0, 3),
        prompt_tokens=c.prompt_tokens,
        completion_tokens=c.completion_tokens,
        device_hit_rate=round(c.device_hits / arrivals, 4) if arrivals else None,
        host_hit_rate=round(c.host_hits / arrivals, 4) if arrivals else None,
        cold_loads=c.cold_loads,
        load_latency_mean_ms=round(mean_load, 2) if mean_load is not None else None,
        load_latency_p50_ms=round(p50, 2) if p50 is not None else None,
        load_latency_p99_ms=round(p99, 2) if p99 is not None else None,
        last_updated=last_updated,
    )


def worth_writing(
    old: AdapterMetrics | None, new: AdapterMetrics, *, min_relative_change: float = 0.1, refresh_due: bool = False
) -> bool:
    """Write status only when a figure a person reads moved: a cluster with thousands of adapters
    must not send thousands of writes per interval for counters that crept up by one. Once
    ``refresh_due`` (the last write is old), any change is written, so small changes are late, not
    lost; an idle adapter's figures do not change and cost nothing."""
    if old is None:  # nothing shown yet: write once there is something to show
        return bool(new.requests_per_second or new.completion_tokens or new.cold_loads or new.device_hit_rate is not None)
    if refresh_due and old.model_dump(exclude={"last_updated"}) != new.model_dump(exclude={"last_updated"}):
        return True

    def moved(a: float | None, b: float | None, floor: float) -> bool:
        if (a is None) != (b is None):
            return True
        if a is None or b is None:
            return False
        return abs(a - b) > max(floor, min_relative_change * max(abs(a), abs(b)))

    return (
        moved(old.requests_per_second, new.requests_per_second, 0.05)
        or moved(old.device_hit_rate, new.device_hit_rate, 0.02)
        or moved(old.host_hit_rate, new.host_hit_rate, 0.02)
        or new.cold_loads != old.cold_loads
        or moved(old.load_latency_p99_ms, new.load_latency_p99_ms, 1.0)
        or moved(float(old.completion_tokens), float(new.completion_tokens), 100)
    )


def missing(registered: Iterable[str], ready: Iterable[str]) -> list[str]:
    """Ready adapters a replica does not know (it is new, or it restarted), in name order."""
    have = set(registered)
    return sorted(name for name in ready if name not in have)


def unclaimed(registered: Iterable[str], claimed: Iterable[str]) -> list[str]:
    """Names a replica serves that no LoraAdapter claims (deleted or renamed while it was away)."""
    keep = set(claimed)
    return sorted(name for name in registered if name not in keep)


def hot_set(
    rates: Mapping[str, float], slots: int, pinned_now: Iterable[str], hysteresis: float, min_rate: float = 0.0
) -> set[str]:
    """The adapters to pin: the ``slots`` hottest by request rate above ``min_rate``. A pinned
    adapter's rate counts ``1 + hysteresis`` times when ranking, so a challenger must beat it
    clearly to take its pin and two adapters trading places by a request or two do not flap."""
    incumbents = set(pinned_now)
    score = {n: r * (1 + hysteresis) if n in incumbents else r for n, r in rates.items() if r > min_rate}
    return set(sorted(score, key=lambda n: (-score[n], n))[: max(0, slots)])


@dataclass(frozen=True)
class StagingCandidate:
    """One version the nodes might hold, with what ranks it."""

    source: str
    digest: str
    pinned: bool = False  # pinned by its manifest or by auto-pinning: it never leaves the nodes
    prefetch: bool = False
    rate: float = 0.0  # requests per second over the replicas
    next_version: bool = False  # validated or being validated, not serving yet: staged before its promotion


def node_staging(candidates: Iterable[StagingCandidate]) -> list[StagingCandidate]:
    """What every node of the base should hold, most wanted first; the agent keeps the head that
    fits its bound. Pinned versions first (they stay whatever the bound), then the serving
    versions by request rate (the hot set), then prefetch-marked ones nobody has asked for yet,
    then next versions, so a promotion finds its files on every node. Each version once, at its
    best rank; ties by source, so the order is stable between syncs."""

    def rank(c: StagingCandidate) -> tuple[int, float, str]:
        if c.pinned:
            return (0, -c.rate, c.source)
        if c.next_version:
            return (3, 0.0, c.source)
        if c.rate > 0:
            return (1, -c.rate, c.source)
        return (2 if c.prefetch else 4, 0.0, c.source)

    best: dict[tuple[str, str], StagingCandidate] = {}
    for c in sorted(candidates, key=rank):
        best.setdefault((c.source, c.digest), c)
    return [c for c in best.values() if c.pinned or c.rate > 0 or c.prefetch or c.next_version]
