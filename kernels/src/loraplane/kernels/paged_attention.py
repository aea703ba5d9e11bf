"""Paged attention for prefill and decode in one kernel (flash-style, over a block-table KV cache).

Semantics::

    for b in sequences:  n = query_starts[b+1] - query_starts[b], L = seq_lens[b]
        for i < n, h < H:  t = query_starts[b] + i, p = L - n + i, g = h // (H // KV)
            keys j = 0..p:  K[j] = k_cache[block_tables[b, j // block_size], j % block_size, g]
            out[t, h] = softmax(scale * q[t, h] @ K.T) @ V           (float32 softmax and sums)

Shapes: q/out [T, H, D], k_cache/v_cache [num_blocks, block_size, KV, D] (any strides: under unified
paging they are views into the page pool), block_tables [B, max_blocks] int32, query_starts [B+1]
int32, seq_lens [B] int32. Decode is ``n = 1``; a prefill chunk after cached tokens (chunked
prefill, prefix caching) is ``n < L``; one launch serves any mix of them.

Grid: (sequence, block of ``BLOCK_Q`` query tokens, kv head), sized on the host from shapes and
``max_query_len``; programs past their sequence's new tokens exit at once. Given a work list
(``tiles``, ``kernels.tiles``), the first two are one, a program per entry: the grid then depends
on the step's tokens only, as a CUDA graph for steps with prompts needs. A program's M
dimension packs its ``BLOCK_Q`` tokens times the ``GROUP`` query heads that share its kv head
(vLLM's unified attention does the same), so a decode row with GQA still hands ``tl.dot`` an M
of 16 and each K/V tile is read once for the whole group. The context is walked in tiles of
``BLOCK_N`` keys up to the causal limit of the program's last query; each key's block id is read
through the block table, so ``BLOCK_N`` and ``block_size`` need not divide each other.

Operands are widened to float32 before ``tl.dot``: Triton's CPU interpreter multiplies bf16 bit
patterns otherwise. On a GPU the float32 dots of half-precision inputs run as TF32, which holds
fp16 and bf16 values exactly (only the probabilities are rounded, to 10 mantissa bits, as
FlashAttention rounds them to half precision); float32 caches use IEEE dots so the result stays
within float32 rounding of the reference. Not here yet: splitting long contexts across programs
for small decode batches (flash-decoding), and native bf16 dots on the GPU (twice TF32's rate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplane.kernels.precision import dot_precision
from loraplane.kernels.tiles import program_work

_LOG2E = math.log2(math.e)  # the kernel takes exp2 of scores in log2 units
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_starts_ptr,
    seq_lens_ptr,
    tiles_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_tb,
    stride_tn,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq, pid_q, live = program_work(tiles_ptr, TILED)  # (sequence, query block): the grid's, or a work list's
    kv_head = tl.program_id(2)
    q_start = tl.load(query_starts_ptr + seq)
    num_new = tl.where(live, tl.load(query_starts_ptr + seq + 1) - q_start, 0)
    if pid_q * BLOCK_Q < num_new:
        seq_len = tl.load(seq_lens_ptr + seq)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        offs_n = tl.arange(0, BLOCK_N)
        # Row m is query token m // GROUP of this block, query head m % GROUP of this kv head.
        token = pid_q * BLOCK_Q + offs_m // GROUP
        head = kv_head * GROUP + offs_m % GROUP
        row_ok = (offs_m < BLOCK_Q * GROUP) & (token < num_new)
        d_ok = offs_d < HEAD_DIM
        # Padding rows get positions too; every position is >= 0, so every row sees key 0 and
        # the running max is finite after the first tile (no inf - inf in the rescaling).
        query_pos = seq_len - num_new + token
        rows = (q_start + token).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        last_token = tl.minimum((pid_q + 1) * BLOCK_Q, num_new) - 1
        kv_end = seq_len - num_new + last_token + 1  # keys past the last query's position are never read
        table_row = block_tables_ptr + seq.to(tl.int64) * stride_tb
        k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
        v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM_PAD), dtype=tl.float32)
        for n0 in range(0, kv_end, BLOCK_N):
            key = n0 + offs_n
            key_ok = key < kv_end
            block = tl.load(table_row + (key // BLOCK_SIZE) * stride_tn, mask=key_ok, other=0).to(tl.int64)
            slot = key % BLOCK_SIZE
            k = tl.load(
                k_head + block[None, :] * stride_kb + slot[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                mask=key_ok[None, :] & d_ok[:, None],
                other=0.0,
            ).to(tl.float32)
            # Scale after the dot, not into q: q stays exact in the dot's TF32 inputs.
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(key[None, :] <= query_pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                v_head + block[:, None] * stride_vb + slot[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                mask=key_ok[:, None] & d_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
            m_i = m_new
        acc = acc / l_i[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
            acc.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@dataclass(frozen=True)
class LaunchConfig:
    """What :func:`paged_attention` launches: ``_paged_attention_kernel[grid](..., **constexprs,
    num_warps=..., num_stages=...)``; a compile check can hand the same values to ``triton.compile``."""

    grid: tuple[int, int, int]
    constexprs: dict[str, int | str]
    num_warps: int
    num_stages: int


def launch_config(
    *,
    num_seqs: int,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    max_query_len: int,
    num_tiles: int | None = None,
) -> LaunchConfig:
    """The grid, compile-time sizes and launch options for one step; pure host arithmetic.

    ``BLOCK_M`` (rows of a program: ``BLOCK_Q`` tokens x ``GROUP`` heads, padded) is the smallest
    power of two >= 16 (``tl.dot``'s minimum on GPUs) that holds the step's longest span times the
    group, capped at 64 rows unless the group alone needs more, so a long prompt is split over
    programs. Decode steps get the smallest tile ``tl.dot`` accepts, and at most three variants
    (16, 32, 64 rows) are compiled per model. With ``num_tiles`` (a work list of ``BLOCK_Q``-token
    blocks, ``kernels.tiles``) the grid is a program per entry and kv head, whatever the sequences.
    """
    if num_heads <= 0 or kv_heads <= 0 or num_heads % kv_heads:
        raise ValueError(f"{num_heads} query heads cannot be shared evenly by {kv_heads} kv heads")
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is outside 1..{MAX_HEAD_DIM} (larger tiles would not fit in registers)")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if dtype not in _DTYPES:
        raise ValueError(f"paged attention runs in float32, float16 or bfloat16, not {dtype}")
    group = num_heads // kv_heads
    block_m = min(triton.next_power_of_2(max(max_query_len, 1) * group), 64)
    block_m = max(block_m, 16, triton.next_power_of_2(group))
    block_q = block_m // group
    # Decode tiles are short in M, so take more keys per step; prefill tiles keep the S tile small.
    block_n = 64 if block_m <= 16 else 32
    constexprs: dict[str, int | str] = {
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": max(16, triton.next_power_of_2(head_dim)),
        "BLOCK_SIZE": block_size,
        "BLOCK_Q": block_q,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "TILED": num_tiles is not None,
        "DOT_PRECISION": dot_precision(dtype),
    }
    grid = (num_seqs, triton.cdiv(max(max_query_len, 0), block_q), kv_heads) if num_tiles is None else (num_tiles, 1, kv_heads)
    return LaunchConfig(grid=grid, constexprs=constexprs, num_warps=4, num_stages=2)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    max_query_len: int,
    tiles: torch.Tensor | None = None,
) -> None:
    """Write each new token's attention over its sequence's cached context into ``out``.

    ``k_cache``/``v_cache`` must already hold this step's keys and values. ``max_query_len`` is
    the host's bound on any sequence's new-token count (it sizes the grid; a larger bound only
    adds programs that exit at once). ``tiles``: the programs' work list [n, 2] int32, of
    ``launch_config(..., max_query_len).constexprs["BLOCK_Q"]``-token blocks (a CUDA graph's
    fixed grid). Nothing is read back from the device.
    """
    if q.dim() != 3 or out.shape != q.shape:
        raise ValueError(f"q and out must both be [T, H, D], got {tuple(q.shape)} and {tuple(out.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"head_dim differs: q has {q.shape[2]}, the cache {k_cache.shape[3]}")
    if not q.dtype == out.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"q, caches and out must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}, {out.dtype}")
    for name, index in (("block_tables", block_tables), ("query_starts", query_starts), ("seq_lens", seq_lens)):
        if index.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {index.dtype}")
    num_seqs = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or query_starts.shape[0] != num_seqs + 1:
        raise ValueError(
            f"{num_seqs} sequences need block_tables [{num_seqs}, max_blocks] and query_starts [{num_seqs + 1}], "
            f"got {tuple(block_tables.shape)} and {tuple(query_starts.shape)}"
        )
    cfg = launch_config(
        num_seqs=num_seqs,
        num_heads=q.shape[1],
        kv_heads=k_cache.shape[2],
        head_dim=q.shape[2],
        block_size=k_cache.shape[1],
        dtype=q.dtype,
        max_query_len=max_query_len,
        num_tiles=None if tiles is None else tiles.shape[0],
    )
    if q.shape[0] == 0 or num_seqs == 0 or max_query_len <= 0 or (tiles is not None and tiles.shape[0] == 0):
        return
    _paged_attention_kernel[cfg.grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_starts,
        seq_lens,
        seq_lens if tiles is None else tiles,
        scale * _LOG2E,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        *block_tables.stride(),
        **cfg.constexprs,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
