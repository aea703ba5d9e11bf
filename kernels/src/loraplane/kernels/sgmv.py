"""SGMV: segmented gather matrix-vector products, for prefill.

Semantics::

    for g in segments:  rows = seg_starts[g] : seg_starts[g+1], s = seg_slots[g], r = ranks[s]
        shrink: out[rows, :r] = x[rows] @ lora_a[s, :r].T
        expand: y[rows, off:off+N] += scalings[s] * buf[rows, :r] @ lora_b[s, :r]

Shapes: x [T, K], lora_a [S, R, K], out/buf [T, R] float32, lora_b [S, R, N], y [T, >= off+N]; a
fused projection's slices stacked as ``bgmv`` takes them, in one launch each way.
Grid: (segment, row block, rank or column block). Programs past a segment's end or its adapter's
rank exit at once, so short segments and low ranks cost nothing extra. Given a work list
(``tiles``, see ``kernels.tiles``), the first two are one: a program per entry, so the grid
depends on the step's tokens only, as a CUDA graph needs. Operands are widened to
float32 before ``tl.dot``: Triton's CPU interpreter multiplies bf16 bit patterns otherwise, and
accumulation is float32 on every path anyway. For a bfloat16 or float16 model the dots then run
as TF32 on the tensor cores (``DOT_PRECISION``, as attention does): TF32's 10-bit mantissa holds
x, A and B exactly, and rounds only the expand's float32 shrink result, to 2^-11, finer than the
bf16 that vLLM casts it to. ``ieee`` float32 dots, which a float32 model keeps, took as long as
the base GEMM itself on an H200 (rank 16, 2048 tokens: 89 us against 88, gpu_check part 2).
The shrink splits K between programs (``ATOMIC``: atomic adds into a zeroed buffer) when the
segments' row blocks alone would leave SMs idle, as BGMV's does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplane.kernels.bgmv import slice_strides, split_k
from loraplane.kernels.precision import dot_precision
from loraplane.kernels.tiles import program_work


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    seg_starts_ptr,
    seg_slots_ptr,
    ranks_ptr,
    tiles_ptr,
    K,
    stride_xm,
    stride_xk,
    stride_aj,
    stride_as,
    stride_ar,
    stride_ak,
    stride_om,
    stride_oj,
    stride_or,
    stride_rj,
    num_splits,
    k_per_split,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr,
    TILED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seg, pid_m, live = program_work(tiles_ptr, TILED)  # (segment, row block): the grid's, or a work list's
    pid_r = tl.program_id(2) // num_splits
    k_lo = (tl.program_id(2) % num_splits) * k_per_split
    slot = tl.load(seg_slots_ptr + seg)
    start = tl.load(seg_starts_ptr + seg)
    seg_len = tl.where(live, tl.load(seg_starts_ptr + seg + 1) - start, 0)
    for j in tl.static_range(NUM_SLICES):  # a fused projection's slices, one after another
        rank = tl.load(ranks_ptr + j * stride_rj + tl.maximum(slot, 0))
        rank = tl.where(slot >= 0, rank, 0)
        if (pid_m * BLOCK_M < seg_len) & (pid_r * BLOCK_R < rank):
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
            offs_k = tl.arange(0, BLOCK_K)
            rows = (start + offs_m).to(tl.int64)
            a_base = a_ptr + j * stride_aj + slot.to(tl.int64) * stride_as
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
                k = k0 + offs_k
                x = tl.load(
                    x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=(offs_m[:, None] < seg_len) & (k[None, :] < K),
                    other=0.0,
                )
                a_t = tl.load(
                    a_base + offs_r[None, :] * stride_ar + k[:, None] * stride_ak,
                    mask=(offs_r[None, :] < rank) & (k[:, None] < K),
                    other=0.0,
                )
                acc += tl.dot(x.to(tl.float32), a_t.to(tl.float32), input_precision=DOT_PRECISION)
            out_ptrs = out_ptr + rows[:, None] * stride_om + j * stride_oj + offs_r[None, :] * stride_or
            mask = (offs_m[:, None] < seg_len) & (offs_r[None, :] < rank)
            if ATOMIC:  # the reduction is split over K: add this program's part
                tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")
            else:
                tl.store(out_ptrs, acc, mask=mask)


@triton.jit
def _sgmv_expand_kernel(
    buf_ptr,
    b_ptr,
    y_ptr,
    seg_starts_ptr,
    seg_slots_ptr,
    ranks_ptr,
    scalings_ptr,
    tiles_ptr,
    y_offset,
    stride_bm,
    stride_bj,
    stride_br,
    stride_bs,
    stride_lr,
    stride_ln,
    stride_ym,
    stride_yn,
    stride_rj,
    SLICE_OFFSETS: tl.constexpr,
    SLICE_SIZES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    TILED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seg, pid_m, live = program_work(tiles_ptr, TILED)
    pid_n = tl.program_id(2)
    slot = tl.load(seg_slots_ptr + seg)
    start = tl.load(seg_starts_ptr + seg)
    seg_len = tl.where(live, tl.load(seg_starts_ptr + seg + 1) - start, 0)
    for j in tl.static_range(len(SLICE_SIZES)):  # a fused projection's slices, each into its columns
        rank = tl.load(ranks_ptr + j * stride_rj + tl.maximum(slot, 0))
        rank = tl.where(slot >= 0, rank, 0)
        if (pid_m * BLOCK_M < seg_len) & (rank > 0) & (pid_n * BLOCK_N < SLICE_SIZES[j]):
            scale = tl.load(scalings_ptr + j * stride_rj + slot)
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_r = tl.arange(0, BLOCK_R)
            rows = (start + offs_m).to(tl.int64)
            b_base = b_ptr + slot.to(tl.int64) * stride_bs + SLICE_OFFSETS[j] * stride_ln
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                r = r0 + offs_r
                buf = tl.load(
                    buf_ptr + rows[:, None] * stride_bm + j * stride_bj + r[None, :] * stride_br,
                    mask=(offs_m[:, None] < seg_len) & (r[None, :] < rank),
                    other=0.0,
                )
                b = tl.load(
                    b_base + r[:, None] * stride_lr + offs_n[None, :] * stride_ln,
                    mask=(r[:, None] < rank) & (offs_n[None, :] < SLICE_SIZES[j]),
                    other=0.0,
                )
                acc += tl.dot(buf.to(tl.float32), b.to(tl.float32), input_precision=DOT_PRECISION)
            y_ptrs = y_ptr + rows[:, None] * stride_ym + (y_offset + SLICE_OFFSETS[j] + offs_n[None, :]) * stride_yn
            mask = (offs_m[:, None] < seg_len) & (offs_n[None, :] < SLICE_SIZES[j])
            y = tl.load(y_ptrs, mask=mask, other=0.0)
            tl.store(y_ptrs, (y.to(tl.float32) + scale * acc).to(y_ptr.dtype.element_ty), mask=mask)


# Launch shapes, from the same H200 sweep as BGMV's (2048 and 512 tokens in 8 segments, ranks 16
# and 64); the shrink's split aims at SHRINK_PROGRAMS programs, as BGMV's does.
SHRINK_BLOCK_M, SHRINK_BLOCK_R, SHRINK_BLOCK_K, SHRINK_PROGRAMS, SHRINK_WARPS = 64, 16, 64, 528, 4
EXPAND_BLOCK_M, EXPAND_BLOCK_N, EXPAND_BLOCK_R, EXPAND_WARPS = 16, 256, 16, 4


def sgmv_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    ranks: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    out: torch.Tensor,
    max_seg_len: int,
    *,
    zeroed: bool = False,
    tiles: torch.Tensor | None = None,
) -> None:
    """``zeroed``: ``out`` already holds zeros (a split shrink adds into it; else it is zeroed here).
    Stacked slices as ``bgmv.bgmv_shrink`` takes them. ``tiles``: a work list of
    ``SHRINK_BLOCK_M``-row blocks (``kernels.tiles``), one program per entry whatever the segments
    (a CUDA graph's fixed grid); ``max_seg_len`` is then unused."""
    num_segs = seg_slots.shape[0]
    if tiles is None and (num_segs == 0 or max_seg_len == 0):
        return
    n, stride_aj, stride_rj = slice_strides(lora_a, ranks)
    max_rank = lora_a.shape[-2]
    block_m, block_r, block_k, k = SHRINK_BLOCK_M, SHRINK_BLOCK_R, SHRINK_BLOCK_K, x.shape[1]
    r_blocks = triton.cdiv(max_rank, block_r)
    # Every row block of the longest segment counts: shorter ones exit early, and are cheap.
    programs = (num_segs, triton.cdiv(max_seg_len, block_m)) if tiles is None else (tiles.shape[0], 1)
    split, k_per_split = split_k(programs[0] * programs[1] * r_blocks, k, block_k, SHRINK_PROGRAMS)
    if split > 1 and not zeroed:
        out.zero_()
    grid = (*programs, r_blocks * split)
    _sgmv_shrink_kernel[grid](
        x, lora_a, out, seg_starts, seg_slots, ranks, seg_starts if tiles is None else tiles, x.shape[1], x.stride(0),
        x.stride(1), stride_aj, lora_a.stride(-3), lora_a.stride(-2), lora_a.stride(-1), out.stride(0),
        max_rank * out.stride(1), out.stride(1), stride_rj, split, k_per_split, NUM_SLICES=n, BLOCK_M=block_m,
        BLOCK_R=block_r, BLOCK_K=block_k, ATOMIC=split > 1, TILED=tiles is not None, DOT_PRECISION=dot_precision(x.dtype),
        num_warps=SHRINK_WARPS,
    )  # fmt: skip


def sgmv_expand(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    y_offset: int,
    max_seg_len: int,
    slices: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
    tiles: torch.Tensor | None = None,
) -> None:
    """``slices``: as ``bgmv.bgmv_expand`` takes them. ``tiles``: as the shrink's, of
    ``EXPAND_BLOCK_M``-row blocks."""
    num_segs = seg_slots.shape[0]
    if tiles is None and (num_segs == 0 or max_seg_len == 0):
        return
    offsets, sizes = slices if slices is not None else ((0,), (lora_b.shape[2],))
    stride_rj = ranks.stride(0) if ranks.dim() == 2 else 0
    block_m, block_n, block_r, max_rank = EXPAND_BLOCK_M, EXPAND_BLOCK_N, EXPAND_BLOCK_R, lora_b.shape[1]
    programs = (num_segs, triton.cdiv(max_seg_len, block_m)) if tiles is None else (tiles.shape[0], 1)
    grid = (*programs, triton.cdiv(max(sizes), block_n))
    _sgmv_expand_kernel[grid](
        buf, lora_b, y, seg_starts, seg_slots, ranks, scalings, seg_starts if tiles is None else tiles, y_offset,
        buf.stride(0), max_rank * buf.stride(1), buf.stride(1), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1), stride_rj, SLICE_OFFSETS=tuple(offsets), SLICE_SIZES=tuple(sizes), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_R=block_r, TILED=tiles is not None, DOT_PRECISION=dot_precision(y.dtype),
        num_warps=EXPAND_WARPS,
    )  # fmt: skip
