"""Every target module's :class:`LoraSlots`, attached to the model's projections.

One table holds ``max_loras`` slots at ``max_lora_rank`` for each (layer, target module). The
projections read their slices' slots during the forward pass; writing an adapter into slot ``s``
updates every layer at once. The table also remembers, per module, which slots hold a non-zero
rank, so a batch whose adapters do not touch ``gate_proj`` skips its kernels altogether.
"""

from __future__ import annotations

import torch

from loraplane.adapter_format import LLAMA_TARGETS
from loraplane.kernels import LoraSlots
from loraplane.serving.model.llama import LlamaModel


class SlotTable:
    def __init__(self, model: LlamaModel, num_slots: int, max_rank: int, dtype: torch.dtype) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self.slots: dict[tuple[int, str], LoraSlots] = {}
        for layer, proj in model.linear_layers():
            for i, name in enumerate(proj.slice_names):
                slots = LoraSlots.empty(num_slots, max_rank, proj.in_features, proj.slice_sizes[i], dtype=dtype)
                proj.lora[i] = slots
                self.slots[(layer, name)] = slots
        self.num_layers = model.config.num_hidden_layers
        self.occupied: dict[str, set[int]] = {m: set() for m in LLAMA_TARGETS}

    def write(self, slot: int, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        """``weights[(layer, module)] = (A [r, in], B [out, r])``; modules the adapter leaves out get rank 0."""
        self.clear(slot)
        for key, (a, b) in weights.items():
            self.slots[key].write(slot, a, b, scaling)
            self.occupied[key[1]].add(slot)

    def clear(self, slot: int) -> None:
        for slots in self.slots.values():
            slots.ranks[slot] = 0
            slots.scalings[slot] = 0.0
        for used in self.occupied.values():
            used.discard(slot)

    def active_modules(self, batch_slots: set[int]) -> frozenset[str]:
        return frozenset(m for m, used in self.occupied.items() if used & batch_slots)

    def bytes_used(self) -> int:
        return sum(s.lora_a.nbytes + s.lora_b.nbytes for s in self.slots.values())
