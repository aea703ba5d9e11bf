"""The paged slot layout: adapter rows live anywhere in a shared page pool (S-LoRA's unified paging).

Instead of one dense ``[num_slots, max_rank, features]`` tensor per target module, a paged table
holds row *offsets* into one flat float32 pool that the KV cache shares::

    pool       [pool_floats] float32        pages of the engine's memory pool, viewed flat
    a_offsets  [num_slots, max_rank] int64   where row r of slot s's A starts (in_features floats)
    b_offsets  [num_slots, max_rank] int64   where row r of slot s's B^T starts (out_features floats)
    ranks      [num_slots] int32, scalings [num_slots] float32   as in LoraSlots

Each row is contiguous (the packer never splits a row across pages), rows of one adapter need
not be, so an adapter takes exactly the pages its rank needs: a rank-8 adapter an eighth of a
rank-64 one, and pages move between adapters and KV blocks as load shifts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._guards import detect_fake_mode

from loraplane.kernels.layout import SlotLayoutError


@dataclass(frozen=True)
class PagedLoraSlots:
    pool: torch.Tensor
    a_offsets: torch.Tensor
    b_offsets: torch.Tensor
    ranks: torch.Tensor
    scalings: torch.Tensor
    in_features: int
    out_features: int

    @classmethod
    def empty(cls, pool: torch.Tensor, num_slots: int, max_rank: int, in_features: int, out_features: int) -> PagedLoraSlots:
        if pool.dtype != torch.float32 or pool.dim() != 1:
            raise SlotLayoutError(f"the pool must be a flat float32 tensor, got {pool.dtype} {list(pool.shape)}")
        return cls(
            pool,
            torch.zeros(num_slots, max_rank, dtype=torch.int64, device=pool.device),
            torch.zeros(num_slots, max_rank, dtype=torch.int64, device=pool.device),
            torch.zeros(num_slots, dtype=torch.int32, device=pool.device),
            torch.zeros(num_slots, dtype=torch.float32, device=pool.device),
            in_features,
            out_features,
        )

    @property
    def num_slots(self) -> int:
        return int(self.a_offsets.shape[0])

    @property
    def max_rank(self) -> int:
        return int(self.a_offsets.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    def write(self, slot: int, a: torch.Tensor, b: torch.Tensor, scaling: float, a_rows: list[int], b_rows: list[int]) -> None:
        """Copy A [rank, in] and B [out, rank] (PEFT shapes) to the given row offsets and point slot at them."""
        rank = int(a.shape[0])
        if not 0 <= slot < self.num_slots or rank > self.max_rank:
            raise SlotLayoutError(f"slot {slot} / rank {rank} do not fit {self.num_slots} slots of rank {self.max_rank}")
        if a.shape != (rank, self.in_features) or b.shape != (self.out_features, rank):
            raise SlotLayoutError(
                f"adapter shapes A{list(a.shape)} B{list(b.shape)} do not fit in={self.in_features}, out={self.out_features}"
            )
        if len(a_rows) != rank or len(b_rows) != rank:
            raise SlotLayoutError(f"need {rank} row offsets for A and for B")
        end = self.pool.numel()
        if any(o < 0 or o + self.in_features > end for o in a_rows) or any(o < 0 or o + self.out_features > end for o in b_rows):
            raise SlotLayoutError("a row offset points outside the pool")
        # One scatter per matrix (its rows' flat positions in the pool) rather than a copy per row:
        # on a GPU each copy is a launch, and an adapter has thousands of rows. The weights cross
        # as they are and are converted and transposed on the device; the row offsets cross from
        # page-locked memory, and the scatter's index is built from them there.
        device = self.pool.device
        a, b = a.to(device, non_blocking=True), b.to(device, non_blocking=True)
        for rows, width, values, offsets in (
            (a_rows, self.in_features, a, self.a_offsets), (b_rows, self.out_features, b.T, self.b_offsets)
        ):  # fmt: skip
            starts = _to_device(rows, device)
            index = (starts[:, None] + torch.arange(width, device=device)).reshape(-1)
            self.pool.index_copy_(0, index, values.to(torch.float32).reshape(-1))
            offsets[slot, :rank] = starts
        self.ranks[slot] = rank
        self.scalings[slot] = scaling

    def to_dense(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [rank, in], B^T [rank, out]) gathered back, for tests and debugging."""
        rank = int(self.ranks[slot])
        a = (
            torch.stack([self.pool[o : o + self.in_features] for o in self.a_offsets[slot, :rank].tolist()])
            if rank
            else torch.zeros(0, self.in_features)
        )
        b = (
            torch.stack([self.pool[o : o + self.out_features] for o in self.b_offsets[slot, :rank].tolist()])
            if rank
            else torch.zeros(0, self.out_features)
        )
        return a, b


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 ``values`` on ``device`` without blocking the host: through page-locked memory when
    a real GPU is there (not while fake tensors are traced, where nothing can be pinned)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda" and torch.cuda.is_available() and detect_fake_mode() is None:
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
