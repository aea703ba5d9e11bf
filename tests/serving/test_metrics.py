"""Metering: Prometheus exposition with bounded adapter labels, and the JSON counts behind it."""

from __future__ import annotations

from prometheus_client import generate_latest

from loraplane.serving.metrics import OTHER, EngineMetrics


def test_adapter_labels_stay_bounded_while_json_counts_stay_exact() -> None:
    m = EngineMetrics(max_adapter_labels=3)
    for i in range(1000):
        m.observe_request(f"adapter-{i}", "tenant-x", 10, "cold")
        m.observe_tokens(f"adapter-{i}", "tenant-x", 2)
    text = generate_latest(m.registry).decode()
    adapters = {
        line.split('adapter="')[1].split('"')[0] for line in text.splitlines() if line.startswith("loraplane_requests_total")
    }
    assert adapters == {"adapter-0", "adapter-1", "adapter-2", OTHER}
    assert 'loraplane_requests_total{adapter="__other__",tenant="tenant-x"} 997.0' in text
    assert m.counters(m.counts["adapter-999"]).requests == 1
    assert m.counters(m.tenants["tenant-x"]).completion_tokens == 2000


def test_load_and_wait_histograms() -> None:
    m = EngineMetrics()
    m.observe_load("a", "t", "cold", 0.2)
    m.observe_load("a", "t", "host", 0.001)
    m.observe_queue_wait("a", "t", 0.3)
    text = generate_latest(m.registry).decode()
    assert 'loraplane_adapter_load_seconds_count{adapter="a",tenant="t",tier="cold"} 1.0' in text
    assert 'loraplane_adapter_queue_wait_seconds_bucket{adapter="a",le="0.5",tenant="t"} 1.0' in text
    counts = m.counters(m.counts["a"]).model_dump()
    assert counts["load_seconds"] == {"cold": {"count": 1, "sum": 0.2}, "host": {"count": 1, "sum": 0.001}}
