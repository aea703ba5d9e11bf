"""A step's new keys and values into the paged KV cache, both in one kernel.

Semantics::

    for each row t:  k_cache[slot_blocks[t], slot_offsets[t]] = k[t];  v_cache[...] = v[t]

Shapes: k, v [T, KV, D] (views of the fused q/k/v output: rows and heads strided, D contiguous);
caches [num_blocks, block_size, KV, D] (strided views of the page pool under unified paging, so
each dimension's stride is passed); slot_blocks, slot_offsets [T] int32. Grid: (row block, k or v).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    blocks_ptr,
    offsets_ptr,
    T,
    KV,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_co,
    stride_ch,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_HD: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    hd = tl.arange(0, BLOCK_HD)
    head, d = hd // D, hd % D
    mask = (rows[:, None] < T) & (hd[None, :] < KV * D)
    rows64 = rows.to(tl.int64)
    block = tl.load(blocks_ptr + rows, mask=rows < T, other=0).to(tl.int64)
    offset = tl.load(offsets_ptr + rows, mask=rows < T, other=0).to(tl.int64)
    dest = block[:, None] * stride_cb + offset[:, None] * stride_co + head[None, :] * stride_ch + d[None, :]
    if tl.program_id(1) == 0:
        x = tl.load(k_ptr + rows64[:, None] * stride_kt + head[None, :] * stride_kh + d[None, :], mask=mask)
        tl.store(k_cache_ptr + dest, x, mask=mask)
    else:
        x = tl.load(v_ptr + rows64[:, None] * stride_vt + head[None, :] * stride_vh + d[None, :], mask=mask)
        tl.store(v_cache_ptr + dest, x, mask=mask)


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    t, kv, d = k.shape
    if t == 0:
        return
    block_hd = triton.next_power_of_2(kv * d)
    block_m = max(1, min(64, 8192 // block_hd))
    grid = (triton.cdiv(t, block_m), 2)
    _kv_write_kernel[grid](
        k, v, k_cache, v_cache, slot_blocks, slot_offsets, t, kv, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), D=d, BLOCK_M=block_m, BLOCK_HD=block_hd,
    )  # fmt: skip
