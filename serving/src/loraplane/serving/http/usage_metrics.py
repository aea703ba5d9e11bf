"""The usage spool and its export as Prometheus series, read at scrape time: a billing record
backlog that grows, or an export that keeps failing, is something to be paged for before a pod's
disk fills or a rescheduled pod takes unexported records with it. Shared by the server and the
router (torch-free)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from loraplane.usage import Metering


class UsageCollector(Collector):
    def __init__(self, metering: Metering) -> None:
        self.metering = metering

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        m = self.metering
        written = CounterMetricFamily("loraplane_usage_records", "Usage records written to the local spool")
        written.add_metric([], m.spool.written if m.spool else 0)
        yield written
        rotations = CounterMetricFamily(
            "loraplane_usage_spool_rotation_failures",
            "Spool segment closes that failed and were retried (the spool kept writing)",
        )
        rotations.add_metric([], m.spool.rotation_failures if m.spool else 0)
        yield rotations
        lost = CounterMetricFamily(
            "loraplane_usage_spool_records_lost", "Usage records whose write failed (a full or broken disk); none is half-written"
        )
        lost.add_metric([], m.spool.records_lost if m.spool else 0)
        yield lost
        if m.exporter is not None:
            uploaded = CounterMetricFamily("loraplane_usage_segments_exported", "Spool segments uploaded and deleted locally")
            uploaded.add_metric([], m.exporter.uploaded)
            failures = CounterMetricFamily("loraplane_usage_export_failures", "Export attempts that failed (retried)")
            failures.add_metric([], m.exporter.failures)
            pending = GaugeMetricFamily("loraplane_usage_segments_pending", "Closed spool segments waiting for export")
            pending.add_metric([], m.exporter.pending())
            yield from (uploaded, failures, pending)
