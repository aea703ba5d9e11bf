"""Figures from a benchmark run: latency percentiles, throughput, per-tenant rows, and the tiers
each adapter was served from (the difference of the server's ``/admin/stats`` before and after)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from pydantic import BaseModel

from loraplane.admin_api import Counters, ReplicaStats, stats
from loraplane.serving.bench.driver import Outcome


def percentile(values: Sequence[float], q: float) -> float:
    """The admin API's nearest-rank percentile (``q`` in [0, 1]), NaN for no values so a table
    prints a gap instead of failing."""
    p = stats.percentile(values, q)
    return math.nan if p is None else p


class Latency(BaseModel):
    requests: int
    ok: int
    refused: int  # 429 / 503: shed or over quota, as the server said
    failed: int
    completion_tokens: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float

    @classmethod
    def of(cls, outcomes: Sequence[Outcome]) -> Latency:
        ok = [o for o in outcomes if o.ok]
        ttft = [o.ttft for o in ok if o.ttft is not None]
        itl = [gap for o in ok for gap in o.itl]
        refused = sum(1 for o in outcomes if o.status in (429, 503))
        return cls(
            requests=len(outcomes),
            ok=len(ok),
            refused=refused,
            failed=len(outcomes) - len(ok) - refused,
            completion_tokens=sum(o.completion_tokens for o in ok),
            ttft_p50_ms=1e3 * percentile(ttft, 0.5),
            ttft_p90_ms=1e3 * percentile(ttft, 0.9),
            ttft_p99_ms=1e3 * percentile(ttft, 0.99),
            itl_p50_ms=1e3 * percentile(itl, 0.5),
            itl_p99_ms=1e3 * percentile(itl, 0.99),
        )


class AdapterTiers(BaseModel):
    """Where an adapter's requests found it on arrival, and what its loads and queueing cost."""

    requests: int = 0
    completion_tokens: int = 0
    device_hits: int = 0
    host_hits: int = 0
    cold_loads: int = 0
    load_seconds: float = 0.0
    loads: int = 0
    queue_wait_seconds: float = 0.0

    @property
    def arrivals(self) -> int:
        return self.device_hits + self.host_hits + self.cold_loads

    def rate(self, hits: int) -> float:
        return hits / self.arrivals if self.arrivals else math.nan

    @property
    def mean_load_ms(self) -> float:
        return 1e3 * self.load_seconds / self.loads if self.loads else 0.0

    def __add__(self, other: AdapterTiers) -> AdapterTiers:
        return AdapterTiers(**{k: getattr(self, k) + getattr(other, k) for k in AdapterTiers.model_fields})

    @classmethod
    def of(cls, c: Counters) -> AdapterTiers:
        return cls(
            requests=c.requests,
            completion_tokens=c.completion_tokens,
            device_hits=c.device_hits,
            host_hits=c.host_hits,
            cold_loads=c.cold_loads,
            load_seconds=c.load_seconds_total,
            loads=c.loads,
            queue_wait_seconds=c.queue_wait_seconds.sum,
        )


def tier_delta(before: ReplicaStats, after: ReplicaStats) -> dict[str, AdapterTiers]:
    """Per adapter, what happened between two ``/admin/stats`` readings."""
    out = {}
    for name, entry in after.adapters.items():
        delta = AdapterTiers.of(entry.since(before.adapters.get(name) or Counters()))
        if delta.arrivals or delta.requests:
            out[name] = delta
    return out


class BenchReport(BaseModel):
    wall_seconds: float
    overall: Latency
    per_tenant: dict[str, Latency]
    per_adapter: dict[str, AdapterTiers]  # empty without admin access

    @property
    def requests_per_second(self) -> float:
        return self.overall.ok / self.wall_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.overall.completion_tokens / self.wall_seconds

    @property
    def tiers(self) -> AdapterTiers:
        return sum(self.per_adapter.values(), AdapterTiers())


def summarize(
    outcomes: Sequence[Outcome],
    wall_seconds: float,
    stats_before: ReplicaStats | None,
    stats_after: ReplicaStats | None,
) -> BenchReport:
    by_tenant: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by_tenant[o.request.tenant or "(open)"].append(o)
    per_adapter = tier_delta(stats_before, stats_after) if stats_before is not None and stats_after is not None else {}
    return BenchReport(
        wall_seconds=wall_seconds,
        overall=Latency.of(outcomes),
        per_tenant={t: Latency.of(v) for t, v in sorted(by_tenant.items())},
        per_adapter=per_adapter,
    )


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, header))] + [[f"{c:.1f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True))) for r in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def format_report(report: BenchReport) -> str:
    o = report.overall
    lines = [
        f"{o.requests} requests in {report.wall_seconds:.1f} s: {o.ok} ok, {o.refused} refused (429/503), {o.failed} failed",
        f"throughput: {report.requests_per_second:.2f} req/s, {report.tokens_per_second:.1f} output tokens/s",
        f"time to first token: p50 {o.ttft_p50_ms:.0f} ms, p90 {o.ttft_p90_ms:.0f} ms, p99 {o.ttft_p99_ms:.0f} ms",
        f"inter-token latency: p50 {o.itl_p50_ms:.1f} ms, p99 {o.itl_p99_ms:.1f} ms",
    ]
    if report.per_adapter:
        t = report.tiers
        lines.append(
            f"adapter tiers on arrival: device {100 * t.rate(t.device_hits):.1f}%, host {100 * t.rate(t.host_hits):.1f}%, "
            f"cold {100 * t.rate(t.cold_loads):.1f}% ({t.cold_loads} cold loads); "
            f"{t.loads} loads, mean {t.mean_load_ms:.1f} ms; "
            f"mean queue wait {1e3 * t.queue_wait_seconds / max(1, t.requests):.1f} ms"
        )
    lines += ["", "per tenant:"]
    rows = [
        (name, v.requests, v.ok, v.refused, v.completion_tokens, v.ttft_p50_ms, v.ttft_p99_ms, v.itl_p50_ms)
        for name, v in report.per_tenant.items()
    ]
    lines.append(_table(("tenant", "requests", "ok", "refused", "tokens", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms"), rows))
    return "\n".join(lines)
