"""Per-adapter and per-tenant metering: Prometheus metrics and a JSON stats view of the same counts.

Label cardinality stays bounded with thousands of adapters: the first ``max_adapter_labels``
adapter names (and ``max_tenant_labels`` tenants) seen get their own label value, later ones are
counted under ``__other__``. The JSON stats keep exact per-adapter figures for every adapter,
since they are read on demand rather than stored by a time-series database for each label.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

from loraplane.admin_api import Counters, CountSum

OTHER = "__other__"
NONE = "__base__"
RECENT_LOADS = 64
LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# vLLM's buckets for vllm:time_to_first_token_seconds, so dashboards built for it read ours.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 640, 2560)


@dataclass
class AdapterCounts:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    arrivals: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # tier at arrival -> requests
    load_seconds: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))  # tier -> [n, sum]
    queue_wait: list[float] = field(default_factory=lambda: [0, 0.0])
    # The last loads' durations: sum and count give a mean, but the operator's status shows p50 and
    # p99, and a percentile needs the values. A bounded window keeps the stats call small.
    recent_loads: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_LOADS))


class _Bounded:
    def __init__(self, limit: int) -> None:
        self.limit, self.seen = limit, set[str]()

    def __call__(self, value: str | None) -> str:
        if value is None:
            return NONE
        if value in self.seen or len(self.seen) < self.limit:
            self.seen.add(value)
            return value
        return OTHER


class EngineMetrics:
    def __init__(
        self, registry: CollectorRegistry | None = None, *, max_adapter_labels: int = 256, max_tenant_labels: int = 256
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.adapter_label = _Bounded(max_adapter_labels)
        self.tenant_label = _Bounded(max_tenant_labels)
        labels = ["adapter", "tenant"]
        r = self.registry
        self.requests = Counter("loraplane_requests", "Requests accepted", labels, registry=r)
        self.prompt_tokens = Counter("loraplane_prompt_tokens", "Prompt tokens of accepted requests", labels, registry=r)
        self.completion_tokens = Counter("loraplane_generation_tokens", "Tokens generated", labels, registry=r)
        self.arrivals = Counter(
            "loraplane_adapter_arrivals",
            "Requests by where their adapter was when they arrived (device hit, host hit, cold load)",
            [*labels, "tier"],
            registry=r,
        )
        self.load_seconds = Histogram(
            "loraplane_adapter_load_seconds",
            "Time to bring an adapter up one tier: cold->host, disk->host, host->device",
            [*labels, "tier"],
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "loraplane_adapter_queue_wait_seconds",
            "Time a request waited for its adapter to load before it could be scheduled",
            labels,
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "loraplane_time_to_first_token_seconds",
            "Time from a request's arrival at the engine to its first generated token",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.counts: dict[str, AdapterCounts] = defaultdict(AdapterCounts)
        self.tenants: dict[str, AdapterCounts] = defaultdict(AdapterCounts)

    def _labels(self, adapter: str | None, tenant: str | None) -> tuple[str, str]:
        return self.adapter_label(adapter), self.tenant_label(tenant)

    def _both(self, adapter: str | None, tenant: str | None) -> tuple[AdapterCounts, AdapterCounts]:
        return self.counts[adapter or NONE], self.tenants[tenant or NONE]

    def observe_request(self, adapter: str | None, tenant: str | None, prompt_tokens: int, arrival_tier: str | None) -> None:
        labels = self._labels(adapter, tenant)
        self.requests.labels(*labels).inc()
        self.prompt_tokens.labels(*labels).inc(prompt_tokens)
        if arrival_tier is not None:
            self.arrivals.labels(*labels, arrival_tier).inc()
        for c in self._both(adapter, tenant):
            c.requests += 1
            c.prompt_tokens += prompt_tokens
            if arrival_tier is not None:
                c.arrivals[arrival_tier] += 1

    def observe_tokens(self, adapter: str | None, tenant: str | None, n: int) -> None:
        self.completion_tokens.labels(*self._labels(adapter, tenant)).inc(n)
        for c in self._both(adapter, tenant):
            c.completion_tokens += n

    def observe_load(self, adapter: str, tenant: str | None, tier: str, seconds: float) -> None:
        self.load_seconds.labels(*self._labels(adapter, tenant), tier).observe(seconds)
        for c in self._both(adapter, tenant):
            c.load_seconds[tier][0] += 1
            c.load_seconds[tier][1] += seconds
            c.recent_loads.append(seconds)

    def observe_queue_wait(self, adapter: str, tenant: str | None, seconds: float) -> None:
        self.queue_wait.labels(*self._labels(adapter, tenant)).observe(seconds)
        for c in self._both(adapter, tenant):
            c.queue_wait[0] += 1
            c.queue_wait[1] += seconds

    def observe_ttft(self, adapter: str | None, tenant: str | None, seconds: float) -> None:
        self.ttft.labels(*self._labels(adapter, tenant)).observe(seconds)

    @staticmethod
    def counters(c: AdapterCounts) -> Counters:
        """The admin API's view of one adapter's or tenant's counts."""
        return Counters(
            requests=c.requests,
            prompt_tokens=c.prompt_tokens,
            completion_tokens=c.completion_tokens,
            device_hits=c.arrivals.get("device", 0),
            host_hits=c.arrivals.get("host", 0),
            cold_loads=c.arrivals.get("cold", 0),
            load_seconds={tier: CountSum(count=int(n), sum=s) for tier, (n, s) in c.load_seconds.items()},
            queue_wait_seconds=CountSum(count=int(c.queue_wait[0]), sum=c.queue_wait[1]),
            recent_load_ms=[round(1e3 * s, 3) for s in c.recent_loads],
        )
