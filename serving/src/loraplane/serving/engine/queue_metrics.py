"""The engine's queue and KV cache as Prometheus series under vLLM's names, read at scrape time.

These are what a model server is asked for by the tools that pick, scale and chart vLLM pods:
the Gateway API Inference Extension's endpoint picker (llm-d's scheduler) reads
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` and ``vllm:lora_requests_info``
(which adapters run and wait, and ``max_lora``) to route a request to the pod that has its
adapter; KEDA scalers and vLLM's Grafana dashboards read the queue gauges. Published under
vLLM's names, not ours, so each of them works unconfigured; the rest of our series keep the
``loraplane_`` prefix.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplane.serving.engine.block_manager import BlockManager
from loraplane.serving.engine.scheduler import Scheduler
from loraplane.serving.engine.sequence import Sequence


class QueueCollector(Collector):
    def __init__(self, scheduler: Scheduler, blocks: BlockManager, max_loras: int, model_name: str) -> None:
        self.scheduler, self.blocks = scheduler, blocks
        self.max_loras, self.model_name = max_loras, model_name

    def collect(self) -> Iterator[Metric]:
        # Copies taken in one C call each, as the engine thread moves sequences meanwhile.
        running = list(self.scheduler.running)
        waiting = [*list(self.scheduler.waiting), *list(self.scheduler.parked)]  # parked: out of the batch, queued to resume
        label = [self.model_name]
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the batch", len(running)),
            ("vllm:num_requests_waiting", "Requests queued, or parked until their adapter's turn", len(waiting)),
            (
                "vllm:kv_cache_usage_perc",
                "Fraction of the KV pool in use (1 is full); unified paging's adapter pages count as used",
                1.0 - self.blocks.num_free / max(1, self.blocks.num_blocks),
            ),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(label, value)
            yield gauge
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "The adapters of running and waiting requests, as labels (vLLM's; the value is the time of reading)",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        info.add_metric([str(self.max_loras), _names(running), _names(waiting)], time.time())
        yield info


def _names(seqs: list[Sequence]) -> str:
    return ",".join(sorted({s.adapter for s in seqs if s.adapter is not None}))
