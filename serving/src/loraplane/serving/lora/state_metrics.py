"""Each adapter's tier and pin, and the node's disk cache, as Prometheus series read from the
adapter manager at scrape time (the counters live in ``serving.metrics``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplane.serving.lora.manager import AdapterManager
from loraplane.serving.metrics import EngineMetrics


class AdapterStateCollector(Collector):
    """Each adapter's tier and pin at scrape time, read from the engine rather than mirrored into
    gauges on every change. Adapters beyond the label cap are summed per tier under ``__other__``."""

    def __init__(self, metrics: EngineMetrics, adapters: AdapterManager) -> None:
        self.metrics, self.adapters = metrics, adapters

    def collect(self) -> Iterator[Metric]:
        metrics = self.metrics
        resident = GaugeMetricFamily(
            "loraplane_adapter_tier", "Adapters by the tier they are in now (1 per adapter)", labels=["adapter", "tenant", "tier"]
        )
        pinned = GaugeMetricFamily("loraplane_adapter_pinned", "Pinned adapters (1 per adapter)", labels=["adapter", "tenant"])
        tiers: dict[tuple[str, str, str], int] = defaultdict(int)
        pins: dict[tuple[str, str], int] = defaultdict(int)
        for name in list(self.adapters.entries):
            info = self.adapters.info(name)
            labels = (metrics.adapter_label(name), metrics.tenant_label(info.tenant))
            tiers[(*labels, info.residency.value)] += 1
            pins[labels] += int(info.pinned)
        for tier_key, n in tiers.items():
            resident.add_metric(list(tier_key), n)
        for pin_key, n in pins.items():
            pinned.add_metric(list(pin_key), n)
        yield resident
        yield pinned
        disk = self.adapters.files.figures()
        yield GaugeMetricFamily("loraplane_disk_cache_bytes", "Bytes of adapter files in the disk cache", value=disk.bytes)
        yield GaugeMetricFamily("loraplane_disk_cache_entries", "Adapter folders in the disk cache", value=disk.entries)
        if disk.max_bytes is not None:
            yield GaugeMetricFamily("loraplane_disk_cache_limit_bytes", "The disk cache's bound", value=disk.max_bytes)
        yield CounterMetricFamily(
            "loraplane_disk_cache_evictions", "Adapter folders the disk cache deleted to stay in its bound", value=disk.evictions
        )
