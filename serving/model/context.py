"""Per-step metadata the model reads instead of taking a dozen arguments.

The model runner builds one :class:`StepContext` per forward pass from the scheduled sequences;
layers only read it. Keeping it a plain object (not module state) means a forward pass has no
hidden inputs: everything that decides the output is in the tokens, the weights, the KV cache
and this context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillSpan:
    """Rows ``start:start+num_new`` of the flat batch are one sequence's new tokens; its keys are
    the first ``context_len`` tokens of that sequence, read through ``block_ids``."""

    start: int
    num_new: int
    context_len: int
    block_ids: torch.Tensor


@dataclass(frozen=True)
class LoraBatch:
    """Which adapter slot each row uses, in both forms the kernels take.

    ``row_slots`` [T] (BGMV) is always set; ``seg_starts``/``seg_slots`` (SGMV) are set when the
    rows form runs longer than one token (prefill), so the GPU path can use the segment kernel.
    ``active_modules`` lists the target modules that at least one row's adapter touches; the
    others skip the adapter kernels entirely.
    """

    row_slots: torch.Tensor
    seg_starts: torch.Tensor | None
    seg_slots: torch.Tensor | None
    active_modules: frozenset[str]


@dataclass(frozen=True)
class StepContext:
    positions: torch.Tensor
    slot_blocks: torch.Tensor  # KV block of each new token
    slot_offsets: torch.Tensor  # its position inside the block
    prefills: tuple[PrefillSpan, ...] = ()
    decode_rows: torch.Tensor | None = None
    decode_block_tables: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None  # [n, 1, 1, max_blocks * block_size], True where a key exists
    lora: LoraBatch | None = None
