"""Metering: Prometheus exposition with bounded adapter labels, and the JSON counts behind it."""

from __future__ import annotations

from engine_helpers import tiny_engine
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


def test_the_queue_and_the_adapters_in_it_under_vllms_names(tiny_llama, tiny_adapters, tmp_path) -> None:
    """What the Gateway API Inference Extension's endpoint picker (llm-d) and KEDA read from a vLLM
    pod: requests running and waiting, the KV pool's use, and which adapters run and wait."""
    from prometheus_client.parser import text_string_to_metric_families

    from loraplane.serving.engine.sampling_params import SamplingParams

    engine = tiny_engine(tiny_llama, tmp_path, dict(tiny_adapters), max_num_seqs=1, max_loras=2)

    def scraped() -> dict[str, list]:  # type: ignore[type-arg]
        text = generate_latest(engine.metrics.registry).decode()
        return {f.name: f.samples for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}

    idle = scraped()
    assert idle["vllm:num_requests_running"][0].value == idle["vllm:num_requests_waiting"][0].value == 0
    assert idle["vllm:kv_cache_usage_perc"][0].value == 0
    assert idle["vllm:lora_requests_info"][0].labels == {
        "max_lora": "2",
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request([5, 6, 7, 8, 9], params, adapter="qv4")
    engine.add_request([5, 6, 7], params, adapter="all8")
    engine.step()  # one place in the batch: qv4's request runs, all8's waits
    busy = scraped()
    assert busy["vllm:num_requests_running"][0].value == 1 and busy["vllm:num_requests_waiting"][0].value == 1
    assert busy["vllm:num_requests_running"][0].labels == {"model_name": tiny_llama.name}
    assert 0 < busy["vllm:kv_cache_usage_perc"][0].value < 1
    info = busy["vllm:lora_requests_info"][0].labels
    assert (info["running_lora_adapters"], info["waiting_lora_adapters"]) == ("qv4", "all8")
