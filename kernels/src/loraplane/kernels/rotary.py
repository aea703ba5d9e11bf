"""Rotary position embedding of a step's queries and keys, in place, in one kernel.

Semantics (Hugging Face's rotate-half layout, rounded where the eager model rounds)::

    for each row t and head h of q and of k, with c = bf(cos[positions[t]]), s = bf(sin[positions[t]]):
        x1, x2 = x[:D/2], x[D/2:]
        x <- cat(bf(bf(x1 * c1) + bf(-x2 * s1)), bf(bf(x2 * c2) + bf(x1 * s2)))

Shapes: q [T, H, D], k [T, KV, D] (views of the fused q/k/v output: only D need be contiguous),
positions [T] int32, cos and sin [max_positions, D] float32. Grid: (row block, head of q or k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    T,
    H,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    HALF: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < T) & (cols[None, :] < HALF)
    rows64 = rows.to(tl.int64)
    if head < H:
        base = q_ptr + rows64[:, None] * stride_qt + head * stride_qh
    else:
        base = k_ptr + rows64[:, None] * stride_kt + (head - H) * stride_kh
    pos = tl.load(positions_ptr + rows, mask=rows < T, other=0).to(tl.int64)
    table = pos[:, None] * stride_cos + cols[None, :]
    dtype = q_ptr.dtype.element_ty
    c1 = tl.load(cos_ptr + table, mask=mask, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(cos_ptr + table + HALF, mask=mask, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(sin_ptr + table, mask=mask, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(sin_ptr + table + HALF, mask=mask, other=0.0).to(dtype).to(tl.float32)
    x1 = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a1 = (x1 * c1).to(dtype).to(tl.float32)
    b1 = (-x2 * s1).to(dtype).to(tl.float32)
    a2 = (x2 * c2).to(dtype).to(tl.float32)
    b2 = (x1 * s2).to(dtype).to(tl.float32)
    tl.store(base + cols[None, :], (a1 + b1).to(dtype), mask=mask)
    tl.store(base + HALF + cols[None, :], (a2 + b2).to(dtype), mask=mask)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``q`` and ``k`` in place by each row's position."""
    t, h, d = q.shape
    if t == 0:
        return
    half = d // 2
    block_d = triton.next_power_of_2(half)
    block_m = max(1, min(32, 4096 // block_d))
    grid = (triton.cdiv(t, block_m), h + k.shape[1])
    _rotary_kernel[grid](
        q, k, positions, cos, sin, t, h, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        HALF=half, BLOCK_M=block_m, BLOCK_D=block_d,
    )  # fmt: skip
