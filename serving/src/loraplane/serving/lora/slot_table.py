"""Every target module's slot table, attached to the model's projections.

One table holds ``max_loras`` slots for each (layer, target module). The projections read their
slices' slots during the forward pass; writing an adapter into slot ``s`` updates every layer at
once. The table also remembers, per module, which slots hold a non-zero rank, so a batch whose
adapters do not touch ``gate_proj`` skips its kernels altogether.

Two layouts, one interface (vLLM-style static slots for comparison, S-LoRA-style unified paging):

- :class:`SlotTable`: dense slots, every slot reserving ``max_lora_rank`` rows of every module;
- :class:`PagedSlotTable`: row offsets into the engine's page pool, which the KV cache shares;
  an adapter takes exactly the pages its rank needs (see :meth:`PagedSlotTable.pages_needed`).
"""

from __future__ import annotations

from collections.abc import Iterable, Set

import torch

from loraplane.adapter_format import LLAMA_TARGETS
from loraplane.kernels import LoraSlots, PagedLoraSlots, StackedLoraSlots
from loraplane.serving import cuda_runtime
from loraplane.serving.lora.slot_writes import SlotWrites
from loraplane.serving.model.layers import LoraLinear
from loraplane.serving.model.llama import LlamaModel

Weights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class SlotTable:
    def __init__(
        self, model: LlamaModel, num_slots: int, max_rank: int, dtype: torch.dtype = torch.float32, *, stacked: bool = False
    ) -> None:
        """Slots on the model's device, in ``dtype``; writes copy from the host tier on their own
        stream (:class:`SlotWrites`). ``stacked``: a fused projection's slices in one table
        (``StackedLoraSlots``), which the Triton kernels take in one launch; the CPU path reads
        each slice's own contiguous table instead."""
        self.num_slots, self.max_rank, self.dtype = num_slots, max_rank, dtype
        self.device = model.embed_tokens.weight.device
        self.writes = SlotWrites(self.device)
        self.slots: dict[tuple[int, str], LoraSlots | PagedLoraSlots] = {}
        for layer, proj in model.linear_layers():
            views: list[LoraSlots] | None = None
            if stacked and len(proj.slice_names) > 1:
                proj.stacked = StackedLoraSlots.empty(
                    num_slots, max_rank, proj.in_features, proj.slice_sizes, dtype=dtype, device=self.device
                )
                views = proj.stacked.slices()
            for i, name in enumerate(proj.slice_names):
                slots = views[i] if views is not None else self._make(proj, i)
                proj.lora[i] = slots
                self.slots[(layer, name)] = slots
        self.num_layers = model.config.num_hidden_layers
        self.occupied: dict[str, set[int]] = {m: set() for m in LLAMA_TARGETS}

    def _make(self, proj: LoraLinear, i: int) -> LoraSlots | PagedLoraSlots:
        return LoraSlots.empty(
            self.num_slots, self.max_rank, proj.in_features, proj.slice_sizes[i], dtype=self.dtype, device=self.device
        )

    def write(self, slot: int, weights: Weights, scaling: float) -> None:
        """``weights[(layer, module)] = (A [r, in], B [out, r])``; modules the adapter leaves out get rank 0."""
        self.clear(slot)
        with self.writes.writing(slot, weights):
            for key, (a, b) in weights.items():
                dense = self.slots[key]
                assert isinstance(dense, LoraSlots)
                dense.write(slot, a, b, scaling)
                self.occupied[key[1]].add(slot)

    def wait_for_writes(self, slots: Iterable[int] | None = None) -> None:
        """Before a step reads these slots (all by default), its stream waits for their copies."""
        self.writes.wait(range(self.num_slots) if slots is None else slots)

    def clear(self, slot: int) -> None:
        # Copies into this slot may still be on the side stream (placed, then evicted before a
        # step read it): the compute stream's clear must come after them.
        self.writes.wait([slot])
        for slots in self.slots.values():
            slots.ranks[slot] = 0
            slots.scalings[slot] = 0.0
        for used in self.occupied.values():
            used.discard(slot)

    def active_modules(self, batch_slots: Set[int]) -> frozenset[str]:
        return frozenset(m for m, used in self.occupied.items() if used & batch_slots)


class PagedSlotTable(SlotTable):
    """Slots whose rows live in pages of the shared pool (``pool_f32`` is the pool viewed flat)."""

    def __init__(self, model: LlamaModel, num_slots: int, max_rank: int, pool_f32: torch.Tensor, page_floats: int) -> None:
        self.pool, self.page_floats = pool_f32, page_floats
        super().__init__(model, num_slots, max_rank)

    def _make(self, proj: LoraLinear, i: int) -> PagedLoraSlots:
        return PagedLoraSlots.empty(self.pool, self.num_slots, self.max_rank, proj.in_features, proj.slice_sizes[i])

    def _rows(self, weights: Weights) -> list[int]:
        """Row widths in packing order: per (layer, module), A's rows then B^T's."""
        widths = []
        for key in sorted(weights):
            a, b = weights[key]
            widths += [a.shape[1]] * a.shape[0] + [b.shape[0]] * a.shape[0]
        return widths

    def _pack(self, widths: list[int], pages: list[int] | None) -> tuple[int, list[int]]:
        """Place rows page by page, never splitting a row; (pages used, flat offsets)."""
        used, fill, offsets = 0, self.page_floats, []
        for w in widths:
            if w > self.page_floats:
                raise ValueError(f"a {w}-wide adapter row does not fit a page of {self.page_floats} floats")
            if fill + w > self.page_floats:
                used, fill = used + 1, 0
            if pages is not None:
                offsets.append(pages[used - 1] * self.page_floats + fill)
            fill += w
        return used, offsets

    def zero_pages(self, pages: list[int]) -> None:
        """Clear pages an adapter gives back before KV blocks take them: float32 rows read as
        bfloat16 or float16 KV can be NaN, and a masked position still multiplies by zero."""
        if pages:
            index = torch.tensor(pages, dtype=torch.int64)
            if cuda_runtime.available(self.pool.device):
                index = index.pin_memory()  # a copy from pageable memory would block the host
            self.pool.view(-1, self.page_floats).index_fill_(0, index.to(self.pool.device, non_blocking=True), 0.0)

    def pages_needed(self, weights: Weights) -> int:
        return self._pack(self._rows(weights), None)[0]

    def write_paged(self, slot: int, weights: Weights, scaling: float, pages: list[int]) -> None:
        self.clear(slot)
        _, offsets = self._pack(self._rows(weights), pages)
        cursor = 0
        with self.writes.writing(slot, weights):
            for key in sorted(weights):
                a, b = weights[key]
                r = a.shape[0]
                table = self.slots[key]
                assert isinstance(table, PagedLoraSlots)
                table.write(slot, a, b, scaling, offsets[cursor : cursor + r], offsets[cursor + r : cursor + 2 * r])
                cursor += 2 * r
                self.occupied[key[1]].add(slot)
