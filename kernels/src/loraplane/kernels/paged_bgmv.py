"""BGMV over the paged layout: each adapter row is read at its offset in the shared page pool.

Semantics (``a_off``/``b_off`` [S, R] are flat offsets into ``pool``)::

    for t in rows:  s = row_slots[t], r = ranks[s]   (s = -1: skip)
        shrink: out[t, j] = sum_k pool[a_off[s, j] + k] * x[t, k]              j < r
        expand: y[t, off + n] += scalings[s] * sum_j buf[t, j] * pool[b_off[s, j] + n]

The same program shapes and launch sizes as :mod:`loraplane.kernels.bgmv` (the shrink's split
over K too); the only change is that row ``j``'s base address comes from the index table instead
of ``slot * stride + j * stride``. Prefill segments
run through it row by row (the dispatcher expands them), which costs the SGMV tiling but not
correctness; a paged SGMV is future work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplane.kernels import bgmv


@triton.jit
def _paged_shrink_kernel(
    x_ptr, pool_ptr, a_off_ptr, out_ptr, row_slots_ptr, ranks_ptr, K, R, stride_xm, stride_om, k_per_split,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    pid_r = tl.program_id(1)
    k_lo = tl.program_id(2) * k_per_split
    slot = tl.load(row_slots_ptr + row)
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0))
    rank = tl.where(slot >= 0, rank, 0)
    if pid_r * BLOCK_R < rank:
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        rows = tl.load(a_off_ptr + slot.to(tl.int64) * R + offs_r, mask=offs_r < rank, other=0)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
            k = k0 + offs_k
            x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
            a = tl.load(pool_ptr + rows[:, None] + k[None, :], mask=(offs_r[:, None] < rank) & (k[None, :] < K), other=0.0)
            acc += tl.sum(a * x[None, :], axis=1)
        out_ptrs = out_ptr + row.to(tl.int64) * stride_om + offs_r
        if ATOMIC:  # the reduction is split over K: add this program's part (into a zeroed buffer)
            tl.atomic_add(out_ptrs, acc, mask=offs_r < rank, sem="relaxed")
        else:
            tl.store(out_ptrs, acc, mask=offs_r < rank)


@triton.jit
def _paged_expand_kernel(
    buf_ptr, pool_ptr, b_off_ptr, y_ptr, row_slots_ptr, ranks_ptr, scalings_ptr, N, R, y_offset, stride_bm, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(row_slots_ptr + row)
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0))
    rank = tl.where(slot >= 0, rank, 0)
    if rank > 0:
        scale = tl.load(scalings_ptr + slot)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            r = r0 + offs_r
            buf = tl.load(buf_ptr + row.to(tl.int64) * stride_bm + r, mask=r < rank, other=0.0)
            rows = tl.load(b_off_ptr + slot.to(tl.int64) * R + r, mask=r < rank, other=0)
            b = tl.load(pool_ptr + rows[:, None] + offs_n[None, :], mask=(r[:, None] < rank) & (offs_n[None, :] < N), other=0.0)
            acc += tl.sum(b * buf[:, None], axis=0)
        y_ptrs = y_ptr + row.to(tl.int64) * stride_ym + y_offset + offs_n
        mask = offs_n < N
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + scale * acc).to(y_ptr.dtype.element_ty), mask=mask)


def paged_add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    pool: torch.Tensor,
    a_off: torch.Tensor,
    b_off: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    row_slots: torch.Tensor,
    y_offset: int,
    n_dim: int,
) -> None:
    """Shrink into a float32 buffer, then expand into ``y`` (rows of x and y must be contiguous)."""
    rows, max_rank = x.shape[0], a_off.shape[1]
    if rows == 0:
        return
    x, y_rows = x.contiguous(), y
    if y.stride(1) != 1:
        raise ValueError("y must have contiguous rows")
    buf = torch.zeros(rows, max_rank, dtype=torch.float32, device=x.device)
    slots32 = row_slots.to(torch.int32)
    k, block_k, block_r = x.shape[1], bgmv.SHRINK_BLOCK_K, bgmv.SHRINK_BLOCK_R
    r_blocks = triton.cdiv(max_rank, block_r)
    split, k_per_split = bgmv.split_k(rows * r_blocks, k, block_k, bgmv.SHRINK_PROGRAMS)
    _paged_shrink_kernel[(rows, r_blocks, split)](
        x, pool, a_off, buf, slots32, ranks, k, max_rank, x.stride(0), buf.stride(0), k_per_split,
        BLOCK_R=block_r, BLOCK_K=block_k, ATOMIC=split > 1, num_warps=bgmv.SHRINK_WARPS,
    )  # fmt: skip
    _paged_expand_kernel[(rows, triton.cdiv(n_dim, bgmv.EXPAND_BLOCK_N))](
        buf, pool, b_off, y_rows, slots32, ranks, scalings, n_dim, max_rank, y_offset, buf.stride(0), y.stride(0),
        BLOCK_N=bgmv.EXPAND_BLOCK_N, BLOCK_R=bgmv.EXPAND_BLOCK_R, num_warps=bgmv.EXPAND_WARPS,
    )  # fmt: skip
