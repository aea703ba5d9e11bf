"""The router's Prometheus metrics: where requests went and why, retries, and the load spread."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from loraplane.serving.router.table import ReplicaTable


class _Spread(Collector):
    """Read at scrape time from the table, so the gauges can never disagree with it."""

    def __init__(self, table: ReplicaTable) -> None:
        self.table = table

    def collect(self) -> Iterator[GaugeMetricFamily]:
        replicas = list(self.table.replicas.values())
        up = GaugeMetricFamily("loraplane_router_replica_up", "1 while the replica takes requests", labels=["replica"])
        inflight = GaugeMetricFamily(
            "loraplane_router_in_flight_requests", "Requests the router has in flight to the replica", labels=["replica"]
        )
        for r in replicas:
            up.add_metric([r.name], 1.0 if r.up else 0.0)
            inflight.add_metric([r.name], r.in_flight)
        total = sum(r.in_flight for r in replicas if r.up)
        live = sum(1 for r in replicas if r.up)
        spread = GaugeMetricFamily(
            "loraplane_router_load_spread_ratio",
            "Busiest replica's in-flight requests over the mean across up replicas (1 is even)",
        )
        spread.add_metric([], max((r.in_flight for r in replicas if r.up), default=0) * live / total if total else 1.0)
        yield from (up, inflight, spread)


class RouterMetrics:
    def __init__(self, table: ReplicaTable, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.routed = Counter(
            "loraplane_router_requests", "Requests sent to a replica, by routing decision", ["replica", "decision"], registry=r
        )
        self.retries = Counter(
            "loraplane_router_retries", "Requests retried elsewhere after the replica failed before the first byte",
            ["replica"], registry=r,
        )  # fmt: skip
        self.broken_streams = Counter(
            "loraplane_router_broken_streams", "Streams the replica dropped after the first byte", ["replica"], registry=r
        )
        r.register(_Spread(table))
