"""Engine settings, named as vLLM names them wherever vLLM has the same knob."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from loraplane.adapter_format.validation import MAX_WEIGHTS_BYTES
from loraplane.admin_api import Quotas
from loraplane.admin_api.engine_sizing import EngineSizing


def default_cache_dir() -> Path:
    return Path(os.environ.get("LORAPLANE_CACHE", Path.home() / ".cache" / "loraplane"))


class EngineConfig(EngineSizing):
    """Everything the engine reads; the sizing knobs the operator also writes come from
    ``EngineSizing``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(default="embedded", description="'embedded', a .gguf file, or a Hugging Face checkpoint folder")
    base_name: str | None = Field(default=None, description="model id adapters declare as base_model_name_or_path")
    base_revision: str | None = Field(default=None, description="revision adapters must declare, if they declare one")
    merged_lora: str | None = Field(
        default=None,
        description="a dedicated deployment's adapter (a source URI, fetched and checked as any adapter's): merged into "
        "the base at start (W + scale B A, loraplane merge) and served as the model under served_model_name",
    )
    merged_lora_digest: str | None = Field(default=None, description="the merged adapter's version (sha256:...)")
    merged_lora_tenant: str | None = Field(
        default=None,
        description="a merged model's tenant (merged_lora's, or a model that is a merged checkpoint): the only one whose "
        "keys may call it (none: any)",
    )
    merged_lora_quotas: Quotas | None = Field(
        default=None,
        description="a merged model's own quotas (its LoraAdapter's), kept here as on the shared replicas",
    )
    served_model_name: str | None = Field(
        default=None,
        description="vLLM's flag: the name the model answers to (a merged model: its adapter's served name); default base_name",
    )
    device: Literal["auto", "cuda", "cpu"] = Field(
        default="auto", description="where the weights, KV cache and adapter slots live; auto: cuda when torch sees a GPU"
    )
    load_format: Literal["auto", "dummy"] = Field(
        default="auto",
        description="auto: the checkpoint's weights; dummy: random weights of the checkpoint's shape (vLLM's, for "
        "benchmarks: the folder needs only config.json and a tokenizer)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="auto: bfloat16 where the hardware computes it natively, else float32"
    )
    enforce_eager: bool = Field(
        default=False,
        description="run every step eagerly; by default every step replays a CUDA graph (the Triton backend only)",
    )
    async_scheduling: bool = Field(
        default=False,
        description="schedule and launch step N+1 before step N's tokens are read back (vLLM's flag), so the host's "
        "work overlaps the GPU's; a request's stop is then seen one step late (its extra token is discarded), and steps "
        "with rows whose sampling reads the host's history (penalties, structured output, logits processors, "
        "logprobs) run synchronously; no gain on a CPU, where the host is the device",
    )
    max_cudagraph_capture_size: int | None = Field(
        default=None,
        gt=0,
        description="the largest step captured as a CUDA graph, in tokens (vLLM's): larger decode batches and steps "
        "with prompts run eagerly; unset: max_num_batched_tokens (every step)",
    )
    kernel_backend: Literal["auto", "triton", "cpu"] = Field(
        default="auto",
        description="auto: the Triton kernels on CUDA, numba loops (LoRA; decode attention in float32) and SDPA on a CPU; "
        "triton on a CPU runs Triton's interpreter (TRITON_INTERPRET=1), for tests",
    )
    quantization: Literal["fp8"] | None = Field(default=None, description="fp8: float8_e4m3fn base weights, per-channel scales")
    block_size: int = Field(default=16, gt=0)
    num_kv_blocks: int | None = Field(default=None, gt=0, description="overrides kv_cache_memory_mb")
    kv_cache_memory_mb: int | None = Field(
        default=None, gt=0, description="the KV cache's size; unset: 512 on a CPU, gpu_memory_utilization's share on a GPU"
    )
    enable_prefix_caching: bool = True
    fair_scheduling: bool = Field(default=True, description="admit waiting requests least-served tenant first, not FIFO")
    fair_prefill_chunk: int | None = Field(
        default=None,
        ge=1,
        description="prompt tokens the tenants over their fair share may add to one step between them while another "
        "tenant is below its share (the step length is what that tenant's next token waits for), or in its place the "
        "rest of one prompt, at most three chunks, of a tenant over its share with nothing else queued; default 16 on a CPU, "
        "where every token lengthens the step, 512 on a GPU, where a decode step is bound by reading the weights and a "
        "few hundred more tokens add little (not measured yet)",
    )
    fair_interjection: bool | None = Field(
        default=None,
        description="with fair scheduling, run the prompt of a tenant below its share that arrives during a step between "
        "that step's layers, so its first token waits for one layer of a burster's step rather than all of it; "
        "default on with the CPU backend, where one step of a burster's decodes costs about a neighbour's whole "
        "prompt, off with Triton (a step is milliseconds there, and decode steps replay CUDA graphs)",
    )
    max_adapter_bytes: int = Field(default=MAX_WEIGHTS_BYTES, gt=0, description="largest adapter weights file accepted")
    max_loads_in_flight: int = Field(default=2, ge=1, description="adapter loads running at once, off the request path")
    disk_cache_max_bytes: int | None = Field(
        default=20 * 2**30,
        gt=0,
        description="bytes of adapter files kept under cache_dir/adapters, the least wanted evicted first; None: unbounded",
    )
    node_cache_url: str | None = Field(
        default=None,
        description="the node agent on this node (loraplane node-agent): adapter files come from its cache, which "
        "node_cache_dir mounts read-only, and it alone fetches from object storage; unset: this process fetches into "
        "cache_dir itself. The agent takes the admin token (LORAPLANE_ADMIN_TOKEN)",
    )
    node_cache_dir: Path | None = Field(default=None, description="where the node cache is mounted; needed with node_cache_url")
    lora_modules: dict[str, str] = Field(
        default_factory=dict, description="adapter name -> PEFT folder, file:// or s3:// URI; registered and loaded at start"
    )
    s3_endpoint: str | None = Field(default=None, description="defaults to AWS_ENDPOINT_URL")
    s3_access_key: str | None = Field(default=None, description="defaults to AWS_ACCESS_KEY_ID")
    s3_secret_key: str | None = Field(default=None, description="defaults to AWS_SECRET_ACCESS_KEY", repr=False)
    s3_region: str | None = Field(default=None, description="defaults to AWS_REGION")
    golden_min_token_agreement: float = Field(
        default=0.9, ge=0, le=1, description="an adapter's golden outputs must agree this often on this base"
    )
    golden_max_mean_kl: float = Field(default=0.1, ge=0, description="and stay this close to its recorded log-probabilities")
    metrics_max_adapter_labels: int = Field(default=256, ge=1, description="adapters with their own metric label")
    step_trace: Path | None = Field(
        default=None,
        description="write one JSON line per forward pass (what it carried, how long it took, the first tokens it gave) "
        "and per request queued, to read where requests' time goes (benchmarks/step_trace_report.py); the file is "
        "started anew",
    )
    cache_dir: Path = Field(default_factory=default_cache_dir)

    @model_validator(mode="after")
    def _node_cache_mounted(self) -> EngineConfig:
        if self.node_cache_url is not None and self.node_cache_dir is None:
            raise ValueError("node_cache_url needs node_cache_dir: where this pod mounts the node cache the agent writes")
        if self.async_scheduling and self.fair_interjection:
            raise ValueError(
                "async_scheduling cannot run with fair_interjection: an interjected step needs the one in flight done"
            )
        if self.merged_lora is not None and self.served_model_name is None:
            raise ValueError("merged_lora needs served_model_name: the merged model answers to the adapter's name")
        return self
