"""The slot layout: how resident adapters' weights sit in memory for the kernels.

One :class:`LoraSlots` per target module (per layer), holding every resident adapter::

    lora_a   [num_slots, max_rank, in_features]    A of the adapter in slot s, rows 0..rank[s]-1
    lora_b   [num_slots, max_rank, out_features]   B transposed: lora_b[s, r, :] = B[:, r]
    ranks    [num_slots] int32                      the adapter's rank (0 for an empty slot)
    scalings [num_slots] float32                    alpha / rank (alpha / sqrt(rank) for rsLoRA)

PEFT stores ``lora_A.weight`` as ``[rank, in]`` (copied as is) and ``lora_B.weight`` as
``[out, rank]`` (copied transposed). Keeping B rank-major makes both products stream contiguous
rows of ``in`` or ``out`` features, which is what the CPU path vectorises and what the Triton
kernels tile. Rows at and beyond ``ranks[s]`` are never read: a rank-8 adapter in a rank-64 slot
does rank-8 work, and those rows may hold anything (the tests fill them with NaN).

Fused projections (q/k/v, gate/up) keep one ``LoraSlots`` per slice, each with its own A, and
expand into their slice of the fused output with ``y_offset``. The adapter-tier code writes an
adapter into slot ``s`` by copying its tensors into ``lora_a[s, :rank]``, ``lora_b[s, :rank]``
and setting ``ranks[s]`` and ``scalings[s]``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch


class SlotLayoutError(ValueError):
    """Inputs that do not fit the slot layout (shapes, slot indices, ranks)."""


@dataclass(frozen=True)
class LoraSlots:
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    ranks: torch.Tensor
    scalings: torch.Tensor

    @classmethod
    def empty(
        cls,
        num_slots: int,
        max_rank: int,
        in_features: int,
        out_features: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> LoraSlots:
        return cls(
            torch.zeros(num_slots, max_rank, in_features, dtype=dtype, device=device),
            torch.zeros(num_slots, max_rank, out_features, dtype=dtype, device=device),
            torch.zeros(num_slots, dtype=torch.int32, device=device),
            torch.zeros(num_slots, dtype=torch.float32, device=device),
        )

    @property
    def num_slots(self) -> int:
        return int(self.lora_a.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.lora_a.dtype

    @functools.cached_property
    def host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """numpy views of A, B, ranks and scalings (the CPU row kernels' arguments), made once: a
        slot write copies into these tensors in place, so the views stay current. None unless
        all four sit on the CPU, contiguous, in float32 and int32, where a view is the tensor."""
        tensors = (self.lora_a, self.lora_b, self.ranks, self.scalings)
        dtypes = (torch.float32, torch.float32, torch.int32, torch.float32)
        if not all(t.is_cpu and t.is_contiguous() and t.dtype == d for t, d in zip(tensors, dtypes, strict=True)):
            return None
        a, b, ranks, scalings = (t.detach().numpy() for t in tensors)
        return a, b, ranks, scalings

    @property
    def max_rank(self) -> int:
        return int(self.lora_a.shape[1])

    @property
    def in_features(self) -> int:
        return int(self.lora_a.shape[2])

    @property
    def out_features(self) -> int:
        return int(self.lora_b.shape[2])

    def write(self, slot: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Put one adapter (PEFT shapes: ``a`` [rank, in], ``b`` [out, rank]) into ``slot``."""
        rank = int(a.shape[0])
        if not 0 <= slot < self.num_slots:
            raise SlotLayoutError(f"slot {slot} is out of range for {self.num_slots} slots")
        if rank > self.max_rank:
            raise SlotLayoutError(f"rank {rank} is above the slot maximum {self.max_rank}")
        if a.shape != (rank, self.in_features) or b.shape != (self.out_features, rank):
            raise SlotLayoutError(
                f"adapter shapes A{list(a.shape)} B{list(b.shape)} do not fit slots of "
                f"in={self.in_features}, out={self.out_features}"
            )
        device = self.lora_a.device
        if a.device != device:
            # Across to the device as they are (from page-locked memory that is asynchronous), then
            # the dtype conversion and B's transpose on the device: converting on the host would
            # go through a pageable temporary, and a copy from pageable memory blocks the host.
            a, b = a.to(device, non_blocking=True), b.to(device, non_blocking=True)
        self.lora_a[slot, :rank].copy_(a)
        self.lora_b[slot, :rank].copy_(b.T)
        self.ranks[slot] = rank
        self.scalings[slot] = scaling


@dataclass(frozen=True)
class StackedLoraSlots:
    """A fused projection's slices (q/k/v, gate/up) in one table, for one kernel launch each way:

    lora_a   [n, S, R, in]     slice j's A, as ``LoraSlots.lora_a``
    lora_b   [S, R, out]       every slice's B^T side by side, as the fused output lays them out:
                               slice j in columns ``offsets[j] : offsets[j] + sizes[j]``
    ranks    [n, S] int32      per slice: an adapter may target q_proj and not k_proj
    scalings [n, S] float32

    :meth:`slices` views it as one ``LoraSlots`` per slice (the same memory), which is how
    adapters are written into it and how the per-slice kernels read it.
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    ranks: torch.Tensor
    scalings: torch.Tensor
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def empty(
        cls,
        num_slots: int,
        max_rank: int,
        in_features: int,
        sizes: tuple[int, ...],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> StackedLoraSlots:
        n = len(sizes)
        return cls(
            torch.zeros(n, num_slots, max_rank, in_features, dtype=dtype, device=device),
            torch.zeros(num_slots, max_rank, sum(sizes), dtype=dtype, device=device),
            torch.zeros(n, num_slots, dtype=torch.int32, device=device),
            torch.zeros(n, num_slots, dtype=torch.float32, device=device),
            tuple(sum(sizes[:j]) for j in range(n)),
            tuple(sizes),
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.lora_a.dtype

    def slices(self) -> list[LoraSlots]:
        return [
            LoraSlots(self.lora_a[j], self.lora_b[:, :, off : off + size], self.ranks[j], self.scalings[j])
            for j, (off, size) in enumerate(zip(self.offsets, self.sizes, strict=True))
        ]
