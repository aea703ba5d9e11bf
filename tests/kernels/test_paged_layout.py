"""The paged layout computes what the dense slot layout computes, wherever the rows sit in the pool."""

from __future__ import annotations

import random

import pytest
import torch

from loraplane.kernels import LoraSlots, PagedLoraSlots, SlotLayoutError, add_lora, reference_add_lora, segments_to_rows


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """float32 against a float64 reference, within float32's rounding of sums as large as the
    largest output: rounding grows with the terms summed, and a small output may be the
    difference of large ones (a fixed 1e-4 failed once in a CI run, on 1.9e-4 at outputs of
    ~600)."""
    scale = max(1.0, float(ref.abs().max()))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * scale)


def _pair(num_slots: int, max_rank: int, k: int, n: int, seed: int) -> tuple[LoraSlots, PagedLoraSlots]:
    g = torch.Generator().manual_seed(seed)
    dense = LoraSlots.empty(num_slots, max_rank, k, n)
    width = max(k, n)
    pool = torch.full((num_slots * max_rank * 2 * width + 7,), float("nan"))  # unused floats are NaN
    paged = PagedLoraSlots.empty(pool, num_slots, max_rank, k, n)
    places = list(range(num_slots * max_rank * 2))
    random.Random(seed).shuffle(places)  # rows scattered over the pool in no order
    for s in range(num_slots):
        rank = [max_rank, 1, max_rank // 2, 0][s % 4]
        if not rank:
            continue
        a = torch.randn(rank, k, generator=g)
        b = torch.randn(n, rank, generator=g)
        dense.write(s, a, b, 0.5 + s)
        a_rows = [places.pop() * width for _ in range(rank)]
        b_rows = [places.pop() * width for _ in range(rank)]
        paged.write(s, a, b, 0.5 + s, a_rows, b_rows)
    return dense, paged


@pytest.mark.parametrize(
    ("rows", "backend"), [(3, "cpu"), (80, "cpu"), (9, "triton")]
)  # serial and parallel CPU kernels; Triton under TRITON_INTERPRET=1
def test_paged_rows_match_the_reference(rows: int, backend: str) -> None:
    dense, paged = _pair(6, 20, 150, 300, seed=rows)  # rank above one 16-row tile, widths above one tile
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 150, generator=g)
    y = torch.randn(rows, 320, generator=g)
    row_slots = torch.tensor([(i % 7) - 1 for i in range(rows)], dtype=torch.int32)
    ref = reference_add_lora(y, x, dense, row_slots, y_offset=10)
    out = add_lora(y.clone(), x, paged, row_slots=row_slots, y_offset=10, backend=backend)  # type: ignore[arg-type]
    _close(out, ref)


def test_paged_segments_and_round_trip() -> None:
    dense, paged = _pair(4, 4, 16, 12, seed=1)
    starts, slots = torch.tensor([0, 5, 5, 9, 20], dtype=torch.int32), torch.tensor([0, 3, -1, 2], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(20, 16, generator=g), torch.randn(20, 12, generator=g)
    ref = reference_add_lora(y, x, dense, segments_to_rows(starts, slots))
    out = add_lora(y.clone(), x, paged, seg_starts=starts, seg_slots=slots)
    _close(out, ref)
    a, bt = paged.to_dense(2)
    assert torch.equal(a, dense.lora_a[2, : int(dense.ranks[2])]) and torch.equal(bt, dense.lora_b[2, : int(dense.ranks[2])])


def test_paged_write_refuses_rows_outside_the_pool() -> None:
    paged = PagedLoraSlots.empty(torch.zeros(100), 2, 4, 10, 10)
    with pytest.raises(SlotLayoutError, match="outside the pool"):
        paged.write(0, torch.zeros(2, 10), torch.zeros(10, 2), 1.0, [0, 95], [20, 30])
    with pytest.raises(SlotLayoutError, match="row offsets"):
        paged.write(0, torch.zeros(2, 10), torch.zeros(10, 2), 1.0, [0], [20, 30])
