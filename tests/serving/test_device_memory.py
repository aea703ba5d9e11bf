"""KV sizing from device memory, as vLLM's ``gpu_memory_utilization`` does it (the arithmetic; the
reading of a real device's memory runs on the GPU machine's check)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplane.serving.config import EngineConfig
from loraplane.serving.engine.builder import kv_blocks
from loraplane.serving.engine.device_memory import GpuBudget, activation_bytes
from loraplane.serving.weights.base import resolve_base

GiB = 2**30


def test_the_kv_cache_gets_what_the_utilization_leaves(tiny_llama: Path, tmp_path: Path) -> None:
    base = resolve_base(str(tiny_llama), tmp_path)
    config = EngineConfig(model=str(tiny_llama), cache_dir=tmp_path, block_size=16)
    gpu = GpuBudget(total=80 * GiB, used_elsewhere=2 * GiB, weights=16 * GiB, slots=GiB, activations=3 * GiB, utilization=0.9)
    blocks, per_block = kv_blocks(config, base, torch.bfloat16, 512, gpu)
    assert gpu.kv_bytes == 72 * GiB - 22 * GiB
    assert blocks == gpu.kv_bytes // per_block
    # An explicit size or block count wins over the utilization, as in vLLM.
    sized = EngineConfig(model=str(tiny_llama), cache_dir=tmp_path, block_size=16, kv_cache_memory_mb=64)
    assert kv_blocks(sized, base, torch.bfloat16, 512, gpu)[0] == 64 * 2**20 // per_block
    # A config written out and read back (what the operator's engine.yaml is) still sizes from the GPU.
    again = EngineConfig.model_validate(config.model_dump())
    assert kv_blocks(again, base, torch.bfloat16, 512, gpu)[0] == blocks
    assert kv_blocks(config, base, torch.bfloat16, 512, None)[0] == 512 * 2**20 // per_block  # a CPU's default
    counted = EngineConfig(model=str(tiny_llama), cache_dir=tmp_path, num_kv_blocks=100)
    assert kv_blocks(counted, base, torch.bfloat16, 512, gpu)[0] == 100


def test_a_gpu_too_full_for_one_sequence_is_refused_with_what_to_change(tiny_llama: Path, tmp_path: Path) -> None:
    base = resolve_base(str(tiny_llama), tmp_path)
    config = EngineConfig(model=str(tiny_llama), cache_dir=tmp_path)
    full = GpuBudget(total=80 * GiB, used_elsewhere=70 * GiB, weights=2 * GiB, slots=0, activations=0, utilization=0.9)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_blocks(config, base, torch.bfloat16, 512, full)


def test_the_activation_estimate_grows_with_the_batch_limits(tiny_llama: Path, tmp_path: Path) -> None:
    cfg = resolve_base(str(tiny_llama), tmp_path).config
    small = activation_bytes(cfg, 2048, 64, torch.bfloat16, 16)
    assert activation_bytes(cfg, 8192, 64, torch.bfloat16, 16) > small
    assert activation_bytes(cfg, 2048, 256, torch.bfloat16, 16) - small == 2 * 192 * cfg.vocab_size * 4
