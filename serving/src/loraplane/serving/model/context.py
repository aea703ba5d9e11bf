"""Per-step metadata the model reads instead of taking a dozen arguments.

The model runner builds one :class:`StepContext` per forward pass from the scheduled sequences;
layers only read it. Keeping it a plain object (not module state) means a forward pass has no
hidden inputs: everything that decides the output is in the tokens, the weights, the KV cache
and this context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplane.kernels.lora_batch import LoraBatch


@dataclass(frozen=True)
class PrefillSpan:
    """Rows ``start:start+num_new`` of the flat batch are one sequence's new tokens; its keys are
    the first ``context_len`` tokens of that sequence, read through ``block_ids``."""

    start: int
    num_new: int
    context_len: int
    block_ids: torch.Tensor


@dataclass(frozen=True)
class PagedBatch:
    """Every sequence of the step in the form the paged-attention kernel reads (prefill spans and
    decode rows alike): sequence ``b``'s new tokens are rows ``query_starts[b]:query_starts[b+1]``
    and its whole context is ``seq_lens[b]`` tokens in the blocks ``block_tables[b]`` lists."""

    block_tables: torch.Tensor  # [B, max_blocks] int32; past a sequence's length never read
    query_starts: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    max_query_len: int  # known on the host: sizes the kernel's grid (its tiles' query block, with ``tiles``)
    tiles: torch.Tensor | None = None  # a work list (kernels.tiles): the fixed grid of a CUDA graph with prompts


@dataclass(frozen=True)
class StepContext:
    """One forward pass's metadata. The attention kernel reads ``paged``; the CPU path reads
    ``prefills`` and the ``decode_*`` fields (in float32 the decode rows read the cache through
    their block tables, :mod:`loraplane.kernels.cpu_layer`; otherwise one padded gather, a mask
    built from ``decode_lens`` hiding its padding)."""

    positions: torch.Tensor
    slot_blocks: torch.Tensor  # KV block of each new token
    slot_offsets: torch.Tensor  # its position inside the block
    prefills: tuple[PrefillSpan, ...] = ()
    decode_rows: torch.Tensor | None = None
    decode_block_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None  # [n] each decode row's context length
    lora: LoraBatch | None = None  # the step's rows as the adapter kernels read them
    paged: PagedBatch | None = None
    # The layers' norms, rotations, activation and KV writes as one Triton kernel each
    # (kernels.ops), with the residual stream carried beside the layer output; the Triton
    # backend's step. Off: torch ops, in the order and precision of transformers' Llama (in
    # float32 on a CPU, the norms, rotations and KV writes as kernels.cpu_layer's numba loops).
    fused: bool = False
