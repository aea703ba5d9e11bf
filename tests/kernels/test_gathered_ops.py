"""SGMV and BGMV, on the Triton path (interpreted on CPU) and the CPU path, against the reference.

Tolerances per dtype, relative to the float64 reference computed from the same rounded inputs:
float32 1e-4, float16 4e-3, bfloat16 3e-2 (output rounding dominates for the half types).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.kernels import (
    LoraSlots,
    SlotLayoutError,
    StackedLoraSlots,
    add_lora,
    bgmv_shrink,
    cpu,
    reference_add_lora,
    segments_to_rows,
    sgmv_shrink,
)

TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
BACKENDS = ["cpu", "triton"]


def make_slots(
    ranks: list[int], k: int, n: int, dtype: torch.dtype = torch.float32, max_rank: int = 64, seed: int = 0
) -> LoraSlots:
    g = torch.Generator().manual_seed(seed)
    slots = LoraSlots.empty(len(ranks), max_rank, k, n, dtype=dtype)
    slots.lora_a.fill_(float("nan"))  # rows past each rank must never be read
    slots.lora_b.fill_(float("nan"))
    for s, r in enumerate(ranks):
        if r:
            a = torch.randn(r, k, generator=g) / k**0.5
            b = torch.randn(n, r, generator=g) / r**0.5
            slots.write(s, a.to(dtype), b.to(dtype), 16.0 / r)
    return slots


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    tol = TOL[dtype]
    scale = float(ref.abs().max()) if ref.numel() else 1.0
    torch.testing.assert_close(out.to(torch.float64), ref, rtol=tol, atol=tol * max(1.0, scale))


def inputs(rows: int, k: int, n_total: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g).to(dtype), torch.randn(rows, n_total, generator=g).to(dtype)


MIXES = {
    # name: (slot ranks, per-row slot ids)
    "one adapter for all rows": ([16], [0] * 7),
    "every row different, ranks 1..64": ([1, 8, 16, 33, 64, 2, 5], [0, 1, 2, 3, 4, 5, 6]),
    "rows without an adapter": ([8, 64], [-1, 0, -1, 1, 1, -1]),
    "all rows base only": ([8], [-1, -1, -1]),
    "empty slot next to full ones": ([0, 4, 64], [1, 2, 1, 2]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize(("k", "n"), [(64, 48), (97, 131)])
def test_bgmv_matches_reference(backend: str, mix: str, k: int, n: int) -> None:
    ranks, ids = MIXES[mix]
    slots = make_slots(ranks, k, n)
    x, y = inputs(len(ids), k, n + 5, torch.float32)
    row_slots = torch.tensor(ids, dtype=torch.int32)
    ref = reference_add_lora(y, x, slots, row_slots, y_offset=3)
    out = add_lora(y.clone(), x, slots, row_slots=row_slots, y_offset=3, backend=backend)  # type: ignore[arg-type]
    check(out, ref, torch.float32)


SEGMENTS = {
    "one segment": ([0, 9], [1]),
    "empty and one-token segments": ([0, 0, 1, 1, 6, 7], [0, 1, 2, -1, 0]),
    "segment without adapter": ([0, 4, 20, 21], [-1, 2, 0]),
    "longer than one row block": ([0, 37, 40], [2, 1]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seg", list(SEGMENTS))
def test_sgmv_matches_reference(backend: str, seg: str) -> None:
    starts, seg_ids = SEGMENTS[seg]
    slots = make_slots([3, 64, 17], 80, 72)
    x, y = inputs(starts[-1], 80, 72, torch.float32)
    seg_starts, seg_slots = torch.tensor(starts, dtype=torch.int32), torch.tensor(seg_ids, dtype=torch.int32)
    ref = reference_add_lora(y, x, slots, segments_to_rows(seg_starts, seg_slots))
    out = add_lora(y.clone(), x, slots, seg_starts=seg_starts, seg_slots=seg_slots, backend=backend)  # type: ignore[arg-type]
    check(out, ref, torch.float32)


@pytest.mark.parametrize("stacked", [False, True], ids=["one slice", "stacked q/k/v"])
def test_sgmv_work_lists_match_the_per_segment_grid(stacked: bool) -> None:
    """A CUDA graph's SGMV: one program per work-list entry (kernels.tiles), spare entries doing
    nothing, whatever the segments; the same sums as the per-segment grid, which the reference
    checks."""
    from loraplane.kernels.dispatch import add_lora_stacked
    from loraplane.kernels.lora_batch import segment_tile_capacity, segment_tiles

    starts, seg_ids = [0, 70, 71, 71, 90], [2, -1, 0, 1]  # past one shrink block, an empty segment
    seg_starts, seg_slots = torch.tensor(starts, dtype=torch.int32), torch.tensor(seg_ids, dtype=torch.int32)
    work = torch.from_numpy(segment_tiles(starts, segment_tile_capacity(starts[-1], len(seg_ids)) + 3))
    rows = segments_to_rows(seg_starts, seg_slots)
    if not stacked:
        slots = make_slots([3, 64, 17], 80, 72)
        x, y = inputs(starts[-1], 80, 72, torch.float32)
        ref = reference_add_lora(y, x, slots, rows)
        out = add_lora(
            y.clone(), x, slots, seg_starts=seg_starts, seg_slots=seg_slots, backend="triton", max_seg_len=0, seg_tiles=work
        )  # fmt: skip
        check(out, ref, torch.float32)
        return
    k, sizes = 64, (64, 16, 16)
    table = StackedLoraSlots.empty(3, 16, k, sizes)
    g = torch.Generator().manual_seed(6)
    for j, views in enumerate(table.slices()):
        for slot, r in enumerate((8, 16 - 4 * j, 4)):
            views.write(slot, torch.randn(r, k, generator=g) / k**0.5, torch.randn(sizes[j], r, generator=g) / r**0.5, 2.0)
    x, y = inputs(starts[-1], k, sum(sizes), torch.float32)
    ref = y.to(torch.float64)
    for offset, views in zip(table.offsets, table.slices(), strict=True):
        ref = reference_add_lora(ref, x, views, rows, y_offset=offset)
    out = add_lora_stacked(
        y.clone(), x, table, seg_starts=seg_starts, seg_slots=seg_slots, max_seg_len=0, backend="triton", seg_tiles=work
    )  # fmt: skip
    check(out, ref, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", ["sgmv", "bgmv"])
def test_half_precision_inputs_accumulate_in_float32(backend: str, dtype: torch.dtype, op: str) -> None:
    slots = make_slots([8, 32, 64], 128, 96, dtype=dtype)
    x, y = inputs(10, 128, 96, dtype)
    seg_starts = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    seg_slots = torch.tensor([2, 0, 1], dtype=torch.int32)
    rows = segments_to_rows(seg_starts, seg_slots).to(torch.int32)
    ref = reference_add_lora(y, x, slots, rows)
    if op == "sgmv":
        out = add_lora(y.clone(), x, slots, seg_starts=seg_starts, seg_slots=seg_slots, backend=backend)  # type: ignore[arg-type]
    else:
        out = add_lora(y.clone(), x, slots, row_slots=rows, backend=backend)  # type: ignore[arg-type]
    check(out, ref, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_qkv_slices_with_different_widths(backend: str) -> None:
    """q, k and v adapters expand into their own column ranges of one fused output."""
    k = 64
    widths = {"q": 64, "k": 16, "v": 16}
    per_slice = {name: make_slots([8, 16, 4], k, w, seed=i) for i, (name, w) in enumerate(widths.items())}
    x, y = inputs(6, k, sum(widths.values()), torch.float32)
    rows = torch.tensor([0, 1, 2, -1, 1, 0], dtype=torch.int32)
    out, ref, offset = y.clone(), y.to(torch.float64), 0
    for name, w in widths.items():
        ref = reference_add_lora(ref, x, per_slice[name], rows, y_offset=offset)
        add_lora(out, x, per_slice[name], row_slots=rows, y_offset=offset, backend=backend)  # type: ignore[arg-type]
        offset += w
    check(out, ref, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows_as", ["rows", "segments"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_projections_slices_in_one_launch(backend: str, rows_as: str, dtype: torch.dtype) -> None:
    """q/k/v stacked in one table (one shrink and one expand on the Triton path), each slice with
    its own ranks (an adapter may leave k_proj out: rank 0 there), against the reference slice by
    slice; rows past each rank hold NaN and are never read."""
    from loraplane.kernels.dispatch import add_lora_stacked

    k, sizes, ranks = 64, (64, 16, 16), [[8, 16, 4, 0], [8, 0, 4, 2], [8, 16, 0, 2]]
    stacked = StackedLoraSlots.empty(4, 16, k, sizes, dtype=dtype)
    for table in (stacked.lora_a, stacked.lora_b):
        table.fill_(float("nan"))
    g = torch.Generator().manual_seed(5)
    for j, views in enumerate(stacked.slices()):
        for s, r in enumerate(ranks[j]):
            if r:
                a, b = torch.randn(r, k, generator=g) / k**0.5, torch.randn(sizes[j], r, generator=g) / r**0.5
                views.write(s, a.to(dtype), b.to(dtype), 16.0 / r)
    x, y = inputs(9, k, sum(sizes), dtype)
    rows = torch.tensor([0, 0, 0, 1, 1, 3, -1, 2, 2], dtype=torch.int32)
    ref = y.to(torch.float64)
    for offset, views in zip(stacked.offsets, stacked.slices(), strict=True):
        ref = reference_add_lora(ref, x, views, rows, y_offset=offset)
    out = y.clone()
    if rows_as == "rows":
        add_lora_stacked(out, x, stacked, row_slots=rows, backend=backend)  # type: ignore[arg-type]
    else:
        starts, slots = torch.tensor([0, 3, 5, 6, 7, 9], dtype=torch.int32), torch.tensor([0, 1, 3, -1, 2], dtype=torch.int32)
        add_lora_stacked(out, x, stacked, seg_starts=starts, seg_slots=slots, max_seg_len=3, backend=backend)  # type: ignore[arg-type]
    check(out, ref, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["sgmv", "bgmv"])
def test_half_precision_output_slices_leave_other_columns_alone(backend: str, op: str) -> None:
    """A bfloat16 model's fused projection: each slice's adapter lands in its own columns of the
    bfloat16 output, and columns no active slice owns (here the middle one) keep their bits."""
    k, widths = 64, {"q": 48, "skipped": 16, "v": 16}
    x, y = inputs(24, k, sum(widths.values()), torch.bfloat16)
    seg_starts = torch.tensor([0, 10, 24], dtype=torch.int32)
    seg_slots = torch.tensor([1, 0], dtype=torch.int32)
    rows = segments_to_rows(seg_starts, seg_slots).to(torch.int32)
    out, ref, offset = y.clone(), y.to(torch.float64), 0
    for i, (name, w) in enumerate(widths.items()):
        if name != "skipped":
            slots = make_slots([8, 16], k, w, seed=i)
            ref = reference_add_lora(ref, x, slots, rows, y_offset=offset)
            if op == "sgmv":
                add_lora(out, x, slots, seg_starts=seg_starts, seg_slots=seg_slots, y_offset=offset, backend=backend)  # type: ignore[arg-type]
            else:
                add_lora(out, x, slots, row_slots=rows, y_offset=offset, backend=backend)  # type: ignore[arg-type]
        offset += w
    check(out, ref, torch.bfloat16)
    assert torch.equal(out[:, 48:64], y[:, 48:64])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_beside_decodes_on_the_cpu(dtype: torch.dtype) -> None:
    """The segments long enough for BLAS go through it and the short ones (decodes, a short
    prompt) through the row kernel in one call: every row gets its own adapter, rows without one
    keep their base output, and the fused output's other columns keep their bits."""
    long = cpu.blas_min_len(dtype)
    lengths, seg_ids = [long + 3, 1, 2, 1, long, 5, 1], [0, 1, 0, -1, 2, 1, 0]
    assert cpu.segments_pay(max(lengths), dtype) and not cpu.segments_pay(long - 1, dtype)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    slots = make_slots([8, 16, 4], 64, 48, dtype=torch.float32)  # CPU slots stay float32
    x, y = inputs(starts[-1], 64, 80, dtype)  # the slice owns columns 16:64 of a fused output
    seg_starts, seg_slots = torch.tensor(starts, dtype=torch.int32), torch.tensor(seg_ids, dtype=torch.int32)
    ref = reference_add_lora(y, x, slots, segments_to_rows(seg_starts, seg_slots), y_offset=16)
    out = add_lora(y.clone(), x, slots, seg_starts=seg_starts, seg_slots=seg_slots, y_offset=16, backend="cpu")
    check(out[:, 16:64], ref[:, 16:64], dtype)
    assert torch.equal(out[:, :16], y[:, :16]) and torch.equal(out[:, 64:], y[:, 64:])
    base_only = slice(starts[3], starts[4])
    assert torch.equal(out[base_only], y[base_only])


def test_in_place_add_returns_the_same_tensor() -> None:
    slots = make_slots([4], 32, 32)
    x, y = inputs(3, 32, 32, torch.float32)
    out = add_lora(y, x, slots, row_slots=torch.zeros(3, dtype=torch.int32), backend="cpu")
    assert out is y


def test_a_low_rank_adapter_does_no_high_rank_work() -> None:
    """Programs past an adapter's rank exit: with NaN in every padding row, a read would show."""
    slots = make_slots([2], 64, 64, max_rank=64)
    x, _ = inputs(4, 64, 64, torch.float32)
    buf = bgmv_shrink(x, slots.lora_a, slots.ranks, torch.zeros(4, dtype=torch.int32), backend="triton")
    assert torch.isfinite(buf).all() and (buf[:, 2:] == 0).all()


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=6),
    data=st.data(),
    backend=st.sampled_from(BACKENDS),
)
def test_random_segmentations(lengths: list[int], data: st.DataObject, backend: str) -> None:
    ranks = [1, 7, 16, 0]
    seg_ids = data.draw(st.lists(st.integers(-1, len(ranks) - 1), min_size=len(lengths), max_size=len(lengths)))
    slots = make_slots(ranks, 40, 24, max_rank=16)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    x, y = inputs(starts[-1], 40, 24, torch.float32)
    seg_starts, seg_slots = torch.tensor(starts, dtype=torch.int32), torch.tensor(seg_ids, dtype=torch.int32)
    ref = reference_add_lora(y, x, slots, segments_to_rows(seg_starts, seg_slots))
    out = add_lora(y.clone(), x, slots, seg_starts=seg_starts, seg_slots=seg_slots, backend=backend)  # type: ignore[arg-type]
    check(out, ref, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs_raise_instead_of_answering_wrong(backend: str) -> None:
    slots = make_slots([8, 8], 32, 16, max_rank=16)
    x, y = inputs(4, 32, 16, torch.float32)
    rows = torch.tensor([0, 1, 0, 1], dtype=torch.int32)
    be = backend  # the checks run before any backend is chosen
    with pytest.raises(SlotLayoutError, match=r"x has shape \[4, 31\], lora_a expects \[rows, 32\]"):
        add_lora(y, x[:, :31], slots, row_slots=rows, backend=be)  # type: ignore[arg-type]
    with pytest.raises(SlotLayoutError, match="adapter index 2 in row_slots is out of range for 2 slots"):
        add_lora(y, x, slots, row_slots=torch.tensor([0, 2, 0, 0], dtype=torch.int32), backend=be)  # type: ignore[arg-type]
    with pytest.raises(SlotLayoutError, match="adapter index -2"):
        add_lora(y, x, slots, row_slots=torch.tensor([0, -2, 0, 0], dtype=torch.int32), backend=be)  # type: ignore[arg-type]
    with pytest.raises(SlotLayoutError, match="a rank of 17 is above the slot maximum 16"):
        bgmv_shrink(x, slots.lora_a, torch.tensor([8, 17], dtype=torch.int32), rows, backend=be)  # type: ignore[arg-type]
    with pytest.raises(SlotLayoutError, match="seg_starts must rise from 0 to the number of rows"):
        sgmv_shrink(x, slots.lora_a, slots.ranks, torch.tensor([0, 3, 2, 4]), torch.tensor([0, 1, 0]), backend=be)  # type: ignore[arg-type]
    with pytest.raises(SlotLayoutError, match="too narrow for 16 outputs at offset 4"):
        add_lora(y, x, slots, row_slots=rows, y_offset=4, backend=be)  # type: ignore[arg-type]
    with pytest.raises(SlotLayoutError, match="rank 17 is above the slot maximum 16"):
        slots.write(0, torch.zeros(17, 32), torch.zeros(16, 17), 1.0)
    assert torch.equal(y, inputs(4, 32, 16, torch.float32)[1])  # nothing was written by the failed calls


@pytest.mark.parametrize("backend", BACKENDS)
def test_separate_shrink_and_expand_ops(backend: str) -> None:
    """The two halves, as the engine calls them when it reuses one shrink buffer across slices."""
    from loraplane.kernels import bgmv_expand, sgmv_expand

    slots = make_slots([4, 16], 48, 40, max_rank=16)
    x, y = inputs(5, 48, 40, torch.float32)
    rows = torch.tensor([1, 0, -1, 1, 1], dtype=torch.int32)
    ref = reference_add_lora(y, x, slots, rows)
    buf = bgmv_shrink(x, slots.lora_a, slots.ranks, rows, backend=backend)  # type: ignore[arg-type]
    check(bgmv_expand(y.clone(), buf, slots.lora_b, slots.ranks, slots.scalings, rows, backend=backend), ref, torch.float32)  # type: ignore[arg-type]
    seg_starts, seg_slots = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    ref = reference_add_lora(y, x, slots, segments_to_rows(seg_starts, seg_slots))
    buf = sgmv_shrink(x, slots.lora_a, slots.ranks, seg_starts, seg_slots, backend=backend)  # type: ignore[arg-type]
    out = sgmv_expand(y.clone(), buf, slots.lora_b, slots.ranks, slots.scalings, seg_starts, seg_slots, backend=backend)  # type: ignore[arg-type]
    check(out, ref, torch.float32)


@pytest.mark.parametrize("op", ["sgmv", "bgmv"])
def test_a_shrink_split_over_k_adds_into_a_cleared_buffer(op: str) -> None:
    """Few rows over a long K: the Triton shrink splits the reduction between programs that add
    into ``out``, so a reused buffer (here full of NaN) must be cleared first and every part of K
    counted once, the last partial block too."""
    from loraplane.kernels import bgmv, sgmv

    k = 1000  # several blocks of SHRINK_BLOCK_K, the last one partial
    assert k % bgmv.SHRINK_BLOCK_K and k % sgmv.SHRINK_BLOCK_K
    slots = make_slots([8, 16], k, 24, max_rank=16)
    x, _ = inputs(5, k, 24, torch.float32)
    rows = torch.tensor([1, 0, -1, 1, 1], dtype=torch.int32)
    assert bgmv.split_k(5, k, bgmv.SHRINK_BLOCK_K, bgmv.SHRINK_PROGRAMS)[0] > 1
    assert sgmv.split_k(4, k, sgmv.SHRINK_BLOCK_K, sgmv.SHRINK_PROGRAMS)[0] > 1  # four segments of one row block
    out = torch.full((5, 16), float("nan"))
    if op == "bgmv":
        bgmv_shrink(x, slots.lora_a, slots.ranks, rows, out=out, backend="triton")
    else:
        seg_starts, seg_slots = torch.tensor([0, 1, 2, 3, 5], dtype=torch.int32), torch.tensor([1, 0, -1, 1], dtype=torch.int32)
        sgmv_shrink(x, slots.lora_a, slots.ranks, seg_starts, seg_slots, out=out, backend="triton")
    expected = torch.zeros(5, 16, dtype=torch.float64)
    for t, s in enumerate(rows.tolist()):
        if s >= 0:
            r = int(slots.ranks[s])
            expected[t, :r] = x[t].double() @ slots.lora_a[s, :r].double().T
    assert torch.isfinite(out[rows >= 0]).all()
    torch.testing.assert_close(out[rows >= 0].double(), expected[rows >= 0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_decode_batch_adds_a_projections_slices_in_one_call(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step's CPU path (``LoraBatch.add`` by rows): q/k/v of different widths, each with
    its own ranks (rows past them NaN), rows without an adapter, a float32 or bfloat16 output;
    one row-kernel call for the three slices, and an adapter written into a slot after the
    kernel's views of the tables were made is the one the next call reads."""
    from loraplane.kernels.lora_batch import LoraBatch, cpu_row_slices

    k, widths = 64, (64, 16, 24)
    tables = [make_slots([8, 16, 0], k, n, seed=i) for i, n in enumerate(widths)]
    offsets = [0, widths[0], widths[0] + widths[1]]
    x, y = inputs(7, k, sum(widths), dtype)
    rows = torch.tensor([0, 1, -1, 2, 1, 0, 2], dtype=torch.int32)
    batch = LoraBatch(rows, None, None, frozenset({"q_proj"}), backend="cpu")
    calls = []
    kernel = cpu._add_lora_slices_rows_serial
    monkeypatch.setattr(cpu, "_add_lora_slices_rows_serial", lambda *a: calls.append(1) or kernel(*a))

    def expected() -> torch.Tensor:
        ref = y.to(torch.float64)
        for offset, slots in zip(offsets, tables, strict=True):
            ref = reference_add_lora(ref, x.float(), slots, rows, y_offset=offset)
        return ref

    slices = list(zip(offsets, tables, strict=True))
    prepared = cpu_row_slices(slices)
    out = y.clone()
    batch.add(out, x, slices, prepared=prepared)
    check(out, expected(), dtype)
    assert len(calls) == 1
    g = torch.Generator().manual_seed(9)
    for slots, n in zip(tables, widths, strict=True):  # slot 2 was empty: rows 3 and 6 now get its adapter
        slots.write(2, torch.randn(4, k, generator=g) / k**0.5, torch.randn(n, 4, generator=g) / 2, 4.0)
    out = y.clone()
    batch.add(out, x, slices, prepared=prepared)
    check(out, expected(), dtype)
    assert not torch.equal(out[3], y[3])


def test_the_cpu_slices_call_refuses_shapes_that_do_not_fit() -> None:
    """numba checks no bounds: slot tables that disagree are refused when prepared, and an x of
    another width, a y too narrow for the slices or rows of another count when called, before
    the kernel runs, leaving y as it was."""
    slots = make_slots([8], 64, 32)
    assert slots.host is not None
    other = make_slots([8], 48, 32)
    assert other.host is not None
    more = LoraSlots.empty(2, 64, 64, 32)
    for mismatched in (other, more):  # another input width; another number of slots than the first table
        assert mismatched.host is not None
        with pytest.raises(ValueError, match="do not agree"):
            cpu.RowSlices([(0, slots.host), (32, mismatched.host)])
    prepared = cpu.RowSlices([(16, slots.host)])
    x, y = inputs(3, 64, 48, torch.float32)
    rows = torch.zeros(3, dtype=torch.int32).numpy()
    before = y.clone()
    with pytest.raises(ValueError, match="64 input features"):
        cpu.add_lora_slices(y, x[:, :32], prepared, rows)
    with pytest.raises(ValueError, match=">= 48"):
        cpu.add_lora_slices(y[:, :40].contiguous(), x, prepared, rows)
    with pytest.raises(ValueError, match="row slots"):
        cpu.add_lora_slices(y, x, prepared, rows[:2])
    assert torch.equal(y, before)
    cpu.add_lora_slices(y, x, prepared, rows)
    assert torch.equal(y[:, :16], before[:, :16]) and not torch.equal(y[:, 16:], before[:, 16:])
