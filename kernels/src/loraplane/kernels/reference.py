"""The obviously correct version, one row at a time in float64, that every kernel is tested against."""

from __future__ import annotations

import torch

from loraplane.kernels.layout import LoraSlots


def segments_to_rows(seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> torch.Tensor:
    """Per-row slot indices from segment boundaries (``seg_starts`` has one more entry than segments)."""
    lengths = (seg_starts[1:] - seg_starts[:-1]).long()
    return torch.repeat_interleave(seg_slots.long(), lengths)


def reference_add_lora(
    y: torch.Tensor, x: torch.Tensor, slots: LoraSlots, row_slots: torch.Tensor, *, y_offset: int = 0
) -> torch.Tensor:
    """``y`` plus each row's adapter update, as a new float64 tensor (``y`` is not modified)."""
    out = y.detach().to(torch.float64).clone()
    width = slots.out_features
    for i, slot in enumerate(row_slots.tolist()):
        if slot < 0:
            continue
        rank = int(slots.ranks[slot])
        a = slots.lora_a[slot, :rank].to(torch.float64)  # [rank, in]
        b = slots.lora_b[slot, :rank].to(torch.float64).T  # [out, rank], PEFT's B
        update = float(slots.scalings[slot]) * ((x[i].to(torch.float64) @ a.T) @ b.T)
        out[i, y_offset : y_offset + width] += update
    return out
