"""Which device the engine runs on, and how much of its memory the KV cache gets.

On a GPU the KV cache is sized as vLLM sizes it: of the device's total memory, the engine may
use ``gpu_memory_utilization``; memory other processes (or the CUDA context) already hold, the
weights just loaded, the static adapter slots and the activations of the largest step come off
that, and the KV cache (or, under unified paging, the page pool that adapters share with it)
gets the rest. vLLM measures the activations with a profiling forward pass; here they are
estimated from the model's shape and the batch limits (:func:`activation_bytes`), which errs
on the large side for a dense Llama and is simple to audit. On a CPU the cache is
``kv_cache_memory_mb``, as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from loraplane.serving.model.llama_config import LlamaConfig

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when torch sees a GPU. ``cuda`` without one is refused, except while the
    engine is traced on fake CUDA tensors (``FakeTensorMode``, how the CPU-only tests step it)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available() and torch._guards.detect_fake_mode() is None:
        raise ValueError("device='cuda' but torch sees no CUDA device (is this the CPU build of torch?)")
    return torch.device(name, 0) if name == "cuda" else torch.device(name)


def activation_bytes(cfg: LlamaConfig, max_tokens: int, max_seqs: int, dtype: torch.dtype, max_rank: int) -> int:
    """An upper estimate of one step's transient memory: a layer's live tensors for every
    scheduled token (residual, norm, fused q/k/v, attention output, fused gate/up and its
    product, the LoRA shrink buffer in float32) and the float32 logits of every sampled row,
    twice (the sampler's working copy)."""
    size = torch.empty((), dtype=dtype).element_size()
    per_token = (3 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size + cfg.q_size + 3 * cfg.intermediate_size) * size
    per_token += 4 * max_rank
    return max_tokens * per_token + 2 * max_seqs * cfg.vocab_size * 4


@dataclass(frozen=True)
class GpuBudget:
    """The arithmetic of one sizing, kept for the startup log and the tests."""

    total: int
    used_elsewhere: int
    weights: int
    slots: int
    activations: int
    utilization: float

    @property
    def kv_bytes(self) -> int:
        return int(self.total * self.utilization) - self.used_elsewhere - self.weights - self.slots - self.activations


def gpu_budget(device: torch.device, utilization: float, slots: int, activations: int) -> GpuBudget:
    """Read the device's memory now, after the weights are loaded and before anything else is."""
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return GpuBudget(
        total=total,
        used_elsewhere=total - free - reserved,  # other processes, the CUDA context, cuBLAS workspaces
        weights=torch.cuda.memory_allocated(device),
        slots=slots,
        activations=activations,
        utilization=utilization,
    )


def log_sizing(device: torch.device, blocks: int, block_size: int, block_bytes: int, slots: str, seqs: int, tokens: int) -> None:
    log.info(
        "%s: KV cache %d blocks of %d tokens (%.2f GiB, %d tokens); adapter slots: %s; largest batch %d sequences, %d tokens",
        device, blocks, block_size, blocks * block_bytes / 2**30, blocks * block_size, slots, seqs, tokens,
    )  # fmt: skip
