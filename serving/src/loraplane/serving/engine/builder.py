"""The engine's composition root: ``build_engine(config)`` resolves the base, builds the model
with its weights, sizes the KV cache, chooses the adapter slots' memory layout and wires the
scheduler to the adapter manager. Kept apart from the engine, which steps, so each sizing rule is
read (and tested) on its own, and every part is chosen in one place.
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import chain

import torch

from loraplane.adapter_format import ValidationLimits
from loraplane.adapter_format.sources import S3Settings
from loraplane.serving import cuda_runtime
from loraplane.serving.config import EngineConfig
from loraplane.serving.engine.adapter_gate import AdapterGate
from loraplane.serving.engine.block_manager import BlockManager
from loraplane.serving.engine.device_memory import GpuBudget, activation_bytes, gpu_budget, log_sizing, resolve_device
from loraplane.serving.engine.llm_engine import EngineParts, LLMEngine
from loraplane.serving.engine.model_runner import ModelRunner
from loraplane.serving.engine.queue_metrics import QueueCollector
from loraplane.serving.engine.sampler import Sampler
from loraplane.serving.engine.scheduler import FAIR_PREFILL_CHUNK, Scheduler
from loraplane.serving.engine.step_graphs import DecodeGraphs, PromptGraphs
from loraplane.serving.engine.structured import Grammars
from loraplane.serving.lora.adapter_files import AdapterFiles, NodeAgentFiles, OwnCache
from loraplane.serving.lora.manager import AdapterManager
from loraplane.serving.lora.merge import merged_at_start
from loraplane.serving.lora.slot_table import PagedSlotTable, SlotTable
from loraplane.serving.lora.state_metrics import AdapterStateCollector
from loraplane.serving.metrics import EngineMetrics
from loraplane.serving.model import cpu_gemm
from loraplane.serving.model.attention import KVCache
from loraplane.serving.model.layers import fp8_gemm_supported
from loraplane.serving.model.llama import LlamaModel
from loraplane.serving.model.page_pool import PagePool
from loraplane.serving.tokenizer import Tokenizer
from loraplane.serving.weights.base import BaseCheckpoint, resolve_base
from loraplane.serving.weights.checkpoint import iter_tensors, load_weights, random_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_CACHE_MB = 512  # the KV cache on a CPU when kv_cache_memory_mb is unset


def resolve_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    """``auto`` picks bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16 or AMX), where it
    halves the weight bytes each step streams; elsewhere (AVX2, plain AVX-512) bf16 matmuls are
    converted to float32 operand by operand and slower than float32 itself."""
    if name != "auto":
        return DTYPES[name]
    device = device or resolve_device("auto")
    if device.type == "cuda" or cpu_gemm.native_bf16():
        return torch.bfloat16
    return torch.float32


@contextmanager
def _creating(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """New parameters straight on ``device`` in ``dtype``: an 8B base never exists in float32 or
    on the host as a whole (the rotary tables ask for float32 themselves)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(before)


def build_model(base: BaseCheckpoint, config: EngineConfig, max_positions: int, device: torch.device | None = None) -> LlamaModel:
    device = device or resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    with _creating(device, dtype):
        model = LlamaModel(base.config, max_positions)
    if config.load_format == "dummy":
        random_weights(model)
    else:
        load_weights(model, iter_tensors(base.folder))  # copy_ casts into the parameters' dtype
    if config.quantization == "fp8":
        native = fp8_gemm_supported(device, dtype)
        for _, proj in model.linear_layers():
            proj.to_fp8(native)
    if device.type == "cpu" and kernel_backend(config, device) == "cpu":
        model.pack_for_cpu()
    return model.eval()


def static_slot_bytes(model: LlamaModel, config: EngineConfig, dtype: torch.dtype) -> int:
    """Device bytes of ``max_loras`` static slots of ``max_lora_rank`` rows for every target slice."""
    per_rank = sum(proj.in_features + size for _, proj in model.linear_layers() for size in proj.slice_sizes)
    return config.max_loras * config.max_lora_rank * per_rank * torch.empty((), dtype=dtype).element_size()


def kv_blocks(
    config: EngineConfig,
    base: BaseCheckpoint,
    dtype: torch.dtype,
    max_model_len: int,
    gpu: GpuBudget | None = None,
) -> tuple[int, int]:
    """How many KV blocks the cache holds and the bytes of one: ``num_kv_blocks``, else what
    ``gpu`` leaves for the cache on a GPU (unless ``kv_cache_memory_mb`` is set), else
    ``kv_cache_memory_mb``. A cache that cannot hold one whole sequence of ``max_model_len`` is
    refused at startup rather than failing its first long request."""
    cfg = base.config
    per_block = KVCache.bytes_per_block(cfg.num_hidden_layers, config.block_size, cfg.num_key_value_heads, cfg.head_dim, dtype)
    if config.num_kv_blocks:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_memory_mb is None and gpu is not None:
        num_blocks = max(0, gpu.kv_bytes // per_block)
    else:
        num_blocks = max(1, (config.kv_cache_memory_mb or CPU_KV_CACHE_MB) * 2**20 // per_block)
    if num_blocks * config.block_size < max_model_len:
        hint = (
            "raise gpu_memory_utilization, lower max_loras, max_lora_rank or max_num_batched_tokens, or lower max_model_len"
            if gpu is not None
            else "raise kv_cache_memory_mb or lower max_model_len"
        )
        raise ValueError(
            f"{num_blocks} KV blocks of {config.block_size} tokens cannot hold one sequence of max_model_len="
            f"{max_model_len}; {hint}"
        )
    return num_blocks, per_block


def interjects(config: EngineConfig, backend: str) -> bool:
    """Whether a step takes a fair-share neighbour's prompt between its layers: only with fair
    scheduling; unset, on the CPU backend, where one step of a burster's decodes costs about a
    whole prompt, and off with Triton (``EngineConfig.fair_interjection``); never with async scheduling."""
    if not config.fair_scheduling or config.async_scheduling:  # an interjection needs the step in flight done
        return False
    return backend == "cpu" if config.fair_interjection is None else config.fair_interjection


def kernel_backend(config: EngineConfig, device: torch.device) -> str:
    """ "triton" or "cpu" for this device. The CPU path reads host memory, so it cannot run on a
    GPU; Triton on a CPU needs its interpreter, switched on before Triton is first imported."""
    backend = config.kernel_backend
    if backend == "auto":
        return "triton" if device.type == "cuda" else "cpu"
    if backend == "cpu" and device.type != "cpu":
        raise ValueError(f"kernel_backend='cpu' runs on host memory, not on {device}")
    if backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("kernel_backend='triton' on a CPU needs TRITON_INTERPRET=1 (Triton's interpreter)")
    return backend


def s3_settings(config: EngineConfig) -> S3Settings:
    """The object store's settings: the engine's own where given, else the standard AWS_*
    environment variables (what a pod's Secret sets)."""
    env = S3Settings.from_env()
    return S3Settings(
        config.s3_endpoint or env.endpoint,
        config.s3_access_key or env.access_key,
        config.s3_secret_key or env.secret_key,
        config.s3_region or env.region,
    )


def build_engine(config: EngineConfig | None = None) -> LLMEngine:
    """An engine for ``config`` (the defaults serve the embedded base), with the config's
    ``lora_modules`` loaded."""
    config = config or EngineConfig()
    engine = LLMEngine(build_parts(config))
    for name, source in config.lora_modules.items():
        engine.load_lora(name, source)
    return engine


def adapter_files(config: EngineConfig, limits: ValidationLimits) -> AdapterFiles:
    """Where adapter files come from: the node agent's cache when the config names one, else a
    disk cache of this process's own under ``cache_dir``, bounded by ``disk_cache_max_bytes``."""
    return node_cache_files(config) or OwnCache(
        config.cache_dir, max_bytes=config.disk_cache_max_bytes, policy=config.eviction_policy, s3=s3_settings(config),
        max_weights_bytes=limits.max_bytes,
    )  # fmt: skip


def node_cache_files(config: EngineConfig) -> NodeAgentFiles | None:
    """The node agent's cache when the config names one (the pod's own disk cache otherwise). The
    agent takes the admin token the pod already holds; the pod's name tells its pins apart."""
    if config.node_cache_url is None:
        return None
    assert config.node_cache_dir is not None  # EngineConfig's rule
    token = os.environ.get("LORAPLANE_ADMIN_TOKEN")
    return NodeAgentFiles(config.node_cache_url, token, config.node_cache_dir, socket.gethostname())


def build_parts(config: EngineConfig) -> EngineParts:
    """Every part of an engine, each chosen here once: unified paging puts the adapter slots in
    the KV cache's page pool (``lora_memory``), static slots keep their own tensors. One function
    on purpose: the order of construction is the wiring, read top to bottom."""
    # A merged checkpoint (a dedicated deployment's, from the node cache) answers to its adapter's
    # name; a base merged here at start keeps the base's name until merged_at_start renames it.
    name = config.served_model_name if config.merged_lora is None and config.served_model_name else config.base_name
    base = resolve_base(
        config.model, config.cache_dir, name=name, revision=config.base_revision,
        weights=config.load_format != "dummy",
    )  # fmt: skip
    limits = ValidationLimits(
        max_lora_rank=config.max_lora_rank,
        max_bytes=config.max_adapter_bytes,
        require_adapter_digest=config.require_adapter_digest,
    )
    files = adapter_files(config, limits)
    if config.merged_lora is not None:  # a dedicated deployment's replica: the adapter becomes the model
        base = merged_at_start(base, files, config)
    cfg = base.config
    limit = cfg.context_limit()
    if config.max_model_len and config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} is above this model's context ({limit} tokens)")
    max_model_len = config.max_model_len or min(limit, 4096)
    device = resolve_device(config.device)
    backend = kernel_backend(config, device)
    dtype = resolve_dtype(config.dtype, device)
    max_num_seqs, max_num_batched_tokens = config.batch_limits("cuda" if device.type == "cuda" else "cpu")
    model = build_model(base, config, max_model_len, device)
    tokenizer = Tokenizer(base.folder)
    # Adapter weights stay float32 on the CPU whatever the base dtype: the CPU kernels compute in
    # float32, and converting the slot tables on every call would cost more than the product.
    # On a GPU they take the model's dtype, halving what each decode step streams; the Triton
    # kernels accumulate in float32 either way.
    slot_dtype = dtype if device.type == "cuda" else torch.float32
    static = static_slot_bytes(model, config, slot_dtype) if config.lora_memory == "static" else 0
    gpu = None
    if cuda_runtime.available(device):
        act = activation_bytes(cfg, max_num_batched_tokens, max_num_seqs, dtype, config.max_lora_rank)
        gpu = gpu_budget(device, config.gpu_memory_utilization, static, act)
    num_blocks, per_block = kv_blocks(config, base, dtype, max_model_len, gpu)
    # Decode graphs pad their batch with rows that write one more block, which the block
    # manager never hands out (its id is num_blocks).
    graphed = backend == "triton" and not config.enforce_eager
    physical = num_blocks + 1 if graphed else num_blocks
    pool = PagePool(physical, per_block, device) if config.lora_memory == "unified" else None
    cache = KVCache(
        cfg.num_hidden_layers, physical, config.block_size, cfg.num_key_value_heads, cfg.head_dim, dtype, pool=pool,
        device=device,
    )  # fmt: skip
    blocks = BlockManager(num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching)
    slots = (
        PagedSlotTable(model, config.max_loras, config.max_lora_rank, pool.flat_f32(), pool.page_floats)
        if pool is not None
        else SlotTable(model, config.max_loras, config.max_lora_rank, slot_dtype, stacked=backend == "triton")
    )
    where = f"{config.max_loras} in the KV pool's pages" if pool is not None else f"{config.max_loras} ({static / 2**30:.2f} GiB)"
    log_sizing(device, num_blocks, config.block_size, per_block, where, max_num_seqs, max_num_batched_tokens)
    metrics = EngineMetrics(max_adapter_labels=config.metrics_max_adapter_labels)

    def queued() -> Counter[str]:  # the scheduler's queue and parked (built below): part of each adapter's demand
        return Counter(s.adapter for s in chain(scheduler.waiting, scheduler.parked) if s.adapter is not None)

    def owed() -> Counter[str]:  # requests queued or running that have no token yet: first tokens go first
        return Counter(
            s.adapter for s in chain(scheduler.waiting, scheduler.running) if s.adapter is not None and not s.output_token_ids
        )

    adapters = AdapterManager(
        slots,
        base.shape,
        limits,
        files,
        max_cpu_loras=config.host_slots,
        max_loads_in_flight=config.max_loads_in_flight,
        policy=config.eviction_policy,
        metrics=metrics,
        pages=blocks if pool is not None else None,
        queued=queued,
        owed=owed,
    )
    metrics.registry.register(AdapterStateCollector(metrics, adapters))
    gate = AdapterGate(adapters, metrics)
    scheduler = Scheduler(
        blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        ready=gate.ready,
        on_admit=gate.hold,
        on_preempt=gate.drop,
        fair=config.fair_scheduling,
        fair_prefill_chunk=config.fair_prefill_chunk or FAIR_PREFILL_CHUNK["cuda" if device.type == "cuda" else "cpu"],
    )
    metrics.registry.register(QueueCollector(scheduler, blocks, config.max_loras, base.shape.name))
    graphs = prompt_graphs = None
    if graphed:
        max_blocks = -(-max_model_len // config.block_size)
        cap = min(config.max_cudagraph_capture_size or max_num_batched_tokens, max_num_batched_tokens)
        graphs = DecodeGraphs(model, cache, num_blocks, min(max_num_seqs, cap), max_blocks, backend)
        prompt_graphs = PromptGraphs(model, cache, num_blocks, max_num_seqs, cap, max_blocks, backend, pool=graphs.pool)
        if graphs.real:  # the larger first, so the decode graphs reuse their memory
            prompt_graphs.capture_all()
            graphs.capture_all()
    eos = tokenizer.eos_token_id
    eos_ids = frozenset(cfg.eos_token_ids) | ({eos} if eos is not None else frozenset())
    sampler = Sampler(eos_ids=eos_ids, backend=backend)
    return EngineParts(
        config=config,
        base=base,
        max_model_len=max_model_len,
        dtype=dtype,
        model=model,
        tokenizer=tokenizer,
        cache=cache,
        blocks=blocks,
        slots=slots,
        metrics=metrics,
        adapters=adapters,
        gate=gate,
        scheduler=scheduler,
        eos_ids=eos_ids,
        sampler=sampler,
        grammars=Grammars(tokenizer.hf, cfg.vocab_size, eos_ids),
        runner=ModelRunner(model, cache, slots, sampler, backend, graphs, prompt_graphs),
        interjects=interjects(config, backend),
    )
