"""BGMV: batched gather matrix-vector products, one adapter per row, for decode.

Semantics::

    for t in rows:  s = row_slots[t], r = ranks[s]   (s = -1: skip)
        shrink: out[t, :r] = lora_a[s, :r] @ x[t]
        expand: y[t, off:off+N] += scalings[s] * buf[t, :r] @ lora_b[s, :r]

Shapes: x [T, K], lora_a [S, R, K], out/buf [T, R] float32, lora_b [S, R, N], y [T, >= off+N].
A fused projection's slices (q/k/v, gate/up) go in one launch each way: ``lora_a`` [n, S, R, K] and
ranks [n, S] stacked, ``buf`` [T, n * R], and ``lora_b`` [S, R, N] laid out as the fused output, each
slice j in its columns ``offsets[j] : offsets[j] + sizes[j]`` (``layout.StackedLoraSlots``); a
program walks the slices one after another (``tl.static_range``).

Decode is memory-bound: each program streams one row's adapter weights once with wide vector
loads and reduces in registers; no ``tl.dot`` (a single row would waste the tensor cores).

The shrink splits its reduction over K between programs (float32 atomic adds into a
zeroed buffer; ``ATOMIC``) whenever rows x rank blocks alone would leave the GPU's SMs idle. A program that
walks all of K = 4096 alone issues 32 dependent loads: on an H200 that cost about 26 us whatever
the batch (25.7 us at batch 1, 31.7 at 256), 0.1-33% of the copy bandwidth (gpu_check, part 2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    row_slots_ptr,
    ranks_ptr,
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
    k_per_split,
    NUM_SLICES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    row = tl.program_id(0)
    pid_r = tl.program_id(1)
    k_lo = tl.program_id(2) * k_per_split
    slot = tl.load(row_slots_ptr + row)
    x_base = x_ptr + row.to(tl.int64) * stride_xm
    for j in tl.static_range(NUM_SLICES):  # a fused projection's slices, one after another
        rank = tl.load(ranks_ptr + j * stride_rj + tl.maximum(slot, 0))
        rank = tl.where(slot >= 0, rank, 0)
        if pid_r * BLOCK_R < rank:
            offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
            offs_k = tl.arange(0, BLOCK_K)
            a_base = a_ptr + j * stride_aj + slot.to(tl.int64) * stride_as
            acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
                k = k0 + offs_k
                x = tl.load(x_base + k * stride_xk, mask=k < K, other=0.0).to(tl.float32)
                a = tl.load(
                    a_base + offs_r[:, None] * stride_ar + k[None, :] * stride_ak,
                    mask=(offs_r[:, None] < rank) & (k[None, :] < K),
                    other=0.0,
                ).to(tl.float32)
                acc += tl.sum(a * x[None, :], axis=1)
            out_ptrs = out_ptr + row.to(tl.int64) * stride_om + j * stride_oj + offs_r * stride_or
            if ATOMIC:  # the reduction is split over K: add this program's part
                tl.atomic_add(out_ptrs, acc, mask=offs_r < rank, sem="relaxed")
            else:
                tl.store(out_ptrs, acc, mask=offs_r < rank)


@triton.jit
def _bgmv_expand_kernel(
    buf_ptr,
    b_ptr,
    y_ptr,
    row_slots_ptr,
    ranks_ptr,
    scalings_ptr,
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
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(row_slots_ptr + row)
    for j in tl.static_range(len(SLICE_SIZES)):  # a fused projection's slices, each into its columns
        rank = tl.load(ranks_ptr + j * stride_rj + tl.maximum(slot, 0))
        rank = tl.where(slot >= 0, rank, 0)
        if (rank > 0) & (pid_n * BLOCK_N < SLICE_SIZES[j]):
            scale = tl.load(scalings_ptr + j * stride_rj + slot)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_r = tl.arange(0, BLOCK_R)
            b_base = b_ptr + slot.to(tl.int64) * stride_bs + SLICE_OFFSETS[j] * stride_ln
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                r = r0 + offs_r
                buf = tl.load(buf_ptr + row.to(tl.int64) * stride_bm + j * stride_bj + r * stride_br, mask=r < rank, other=0.0)
                b = tl.load(
                    b_base + r[:, None] * stride_lr + offs_n[None, :] * stride_ln,
                    mask=(r[:, None] < rank) & (offs_n[None, :] < SLICE_SIZES[j]),
                    other=0.0,
                ).to(tl.float32)
                acc += tl.sum(b * buf[:, None], axis=0)
            y_ptrs = y_ptr + row.to(tl.int64) * stride_ym + (y_offset + SLICE_OFFSETS[j] + offs_n) * stride_yn
            mask = offs_n < SLICE_SIZES[j]
            y = tl.load(y_ptrs, mask=mask, other=0.0)
            tl.store(y_ptrs, (y.to(tl.float32) + scale * acc).to(y_ptr.dtype.element_ty), mask=mask)


# Launch shapes, from a sweep on an H200 (benchmarks/lora_kernel_sweep.py; docs/benchmarks.md, "The
# GPU path on an H200"): the
# geometric mean over batch 1-256 and ranks 8/16/64 of each candidate's time against the best
# candidate at that shape. The shrink's split aims at SHRINK_PROGRAMS programs (eight per SM of
# the H200's 132); the expand's 512-column blocks at two warps came 2.3x faster than 256 at four.
SHRINK_BLOCK_R, SHRINK_BLOCK_K, SHRINK_PROGRAMS, SHRINK_WARPS = 16, 128, 1056, 8
EXPAND_BLOCK_N, EXPAND_BLOCK_R, EXPAND_WARPS = 512, 16, 2


def split_k(programs: int, k: int, block_k: int, target: int) -> tuple[int, int]:
    """How a shrink splits its reduction over K, for every launcher of one (this, SGMV, paged
    BGMV): (the number of programs that share one row's reduction, the K each covers). The
    number is a power of two, doubled while ``programs`` times it stays under ``target`` and
    never more than K has blocks; each covers whole blocks, so no two overlap."""
    most, split = triton.cdiv(k, block_k), 1
    while programs * split * 2 <= target and split * 2 <= most:
        split *= 2
    return split, triton.cdiv(triton.cdiv(k, split), block_k) * block_k


def slice_strides(weights: torch.Tensor, ranks: torch.Tensor) -> tuple[int, int, int]:
    """(slices, the weights' stride between slices, the ranks' and scalings' stride between slices)
    of a slot table: one slice ``[S, R, F]`` with ranks ``[S]``, or a fused projection's stacked
    slices ``[n, S, R, F]`` with ranks ``[n, S]`` (``layout.StackedLoraSlots``)."""
    if weights.dim() == 4:
        return weights.shape[0], weights.stride(0), ranks.stride(0)
    return 1, 0, 0


def bgmv_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    ranks: torch.Tensor,
    row_slots: torch.Tensor,
    out: torch.Tensor,
    *,
    zeroed: bool = False,
) -> None:
    """``zeroed``: ``out`` already holds zeros (a split shrink adds into it; else it is zeroed here).
    Stacked slices (``lora_a`` [n, S, R, K], ``ranks`` [n, S]) write ``out`` [T, n * R], slice j
    in columns ``j * R : (j + 1) * R``."""
    if x.shape[0] == 0:
        return
    n, stride_aj, stride_rj = slice_strides(lora_a, ranks)
    max_rank = lora_a.shape[-2]
    block_r, block_k, k = SHRINK_BLOCK_R, SHRINK_BLOCK_K, x.shape[1]
    r_blocks = triton.cdiv(max_rank, block_r)
    split, k_per_split = split_k(x.shape[0] * r_blocks, k, block_k, SHRINK_PROGRAMS)
    if split > 1 and not zeroed:
        out.zero_()
    grid = (x.shape[0], r_blocks, split)
    _bgmv_shrink_kernel[grid](
        x, lora_a, out, row_slots, ranks, x.shape[1], x.stride(0), x.stride(1), stride_aj, lora_a.stride(-3),
        lora_a.stride(-2), lora_a.stride(-1), out.stride(0), max_rank * out.stride(1), out.stride(1), stride_rj, k_per_split,
        NUM_SLICES=n, BLOCK_R=block_r, BLOCK_K=block_k, ATOMIC=split > 1, num_warps=SHRINK_WARPS,
    )  # fmt: skip


def bgmv_expand(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    row_slots: torch.Tensor,
    y_offset: int,
    slices: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
) -> None:
    """``slices``: a fused projection's (offsets, sizes) in ``lora_b`` [S, R, N] and in ``y``
    past ``y_offset``, with ``ranks``/``scalings`` [n, S] and ``buf`` [T, n * R]; one slice
    (``lora_b``'s whole width) when None."""
    if y.shape[0] == 0:
        return
    offsets, sizes = slices if slices is not None else ((0,), (lora_b.shape[2],))
    stride_rj = ranks.stride(0) if ranks.dim() == 2 else 0
    block_n, block_r, max_rank = EXPAND_BLOCK_N, EXPAND_BLOCK_R, lora_b.shape[1]
    grid = (y.shape[0], triton.cdiv(max(sizes), block_n))
    _bgmv_expand_kernel[grid](
        buf, lora_b, y, row_slots, ranks, scalings, y_offset, buf.stride(0), max_rank * buf.stride(1), buf.stride(1),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), y.stride(0), y.stride(1), stride_rj,
        SLICE_OFFSETS=tuple(offsets), SLICE_SIZES=tuple(sizes), BLOCK_N=block_n, BLOCK_R=block_r, num_warps=EXPAND_WARPS,
    )  # fmt: skip
