"""Building an engine's parts from its config: the model's dtype, the model with its weights,
the KV cache's size and the object store's settings. Kept apart from the engine, which steps,
so each sizing rule is read (and tested) on its own.
"""

from __future__ import annotations

import torch

from loraplane.adapter_format.sources import S3Settings
from loraplane.serving.config import EngineConfig
from loraplane.serving.model.attention import KVCache
from loraplane.serving.model.llama import LlamaModel
from loraplane.serving.weights.base import BaseCheckpoint
from loraplane.serving.weights.checkpoint import iter_tensors, load_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    """``auto`` picks bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16 or AMX), where it
    halves the weight bytes each step streams; elsewhere bf16 matmuls are emulated and slower."""
    if name != "auto":
        return DTYPES[name]
    if torch.cuda.is_available() or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return torch.float32


def build_model(base: BaseCheckpoint, config: EngineConfig, max_positions: int) -> LlamaModel:
    model = LlamaModel(base.config, max_positions)
    load_weights(model, iter_tensors(base.folder))
    model.to(resolve_dtype(config.dtype))
    model.rotary.to(torch.float32)
    if config.quantization == "fp8":
        for _, proj in model.linear_layers():
            proj.to_fp8()
    return model.eval()


def kv_blocks(config: EngineConfig, base: BaseCheckpoint, dtype: torch.dtype, max_model_len: int) -> tuple[int, int]:
    """How many KV blocks the cache holds (``num_kv_blocks``, or as many as fit in
    ``kv_cache_memory_mb``) and the bytes of one; a cache that cannot hold one whole sequence of
    ``max_model_len`` is refused at startup rather than failing its first long request."""
    cfg = base.config
    per_block = KVCache.bytes_per_block(cfg.num_hidden_layers, config.block_size, cfg.num_key_value_heads, cfg.head_dim, dtype)
    num_blocks = config.num_kv_blocks or max(1, config.kv_cache_memory_mb * 2**20 // per_block)
    if num_blocks * config.block_size < max_model_len:
        raise ValueError(
            f"{num_blocks} KV blocks of {config.block_size} tokens cannot hold one sequence of max_model_len="
            f"{max_model_len}; raise kv_cache_memory_mb or lower max_model_len"
        )
    return num_blocks, per_block


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
