"""The obviously correct paged attention, one sequence at a time in float64, that the kernel is tested against.

Semantics are those of :func:`loraplane.kernels.paged_attention.paged_attention`: sequence ``b``'s
``n`` new queries are rows ``query_starts[b]:query_starts[b+1]``, the ``i``-th sits at position
``seq_lens[b] - n + i`` and sees keys ``0..`` that position, key ``j`` living at
``cache[block_tables[b, j // block_size], j % block_size]``; query head ``h`` reads kv head
``h // (H // KV)``. This module deliberately shares no code with the kernel.
"""

from __future__ import annotations

import torch


def reference_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Attention output ``[T, H, D]`` in float64; rows that belong to no sequence stay zero."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    block_size = k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    starts = query_starts.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        first, last = starts[b], starts[b + 1]
        num_new = last - first
        positions = torch.arange(seq_len, device=q.device)
        blocks = block_tables[b].long()[positions // block_size]
        # Explicit gather by (block, offset): the cache may be a strided view of a page pool.
        keys = k_cache[blocks, positions % block_size].to(torch.float64)  # [L, KV, D]
        values = v_cache[blocks, positions % block_size].to(torch.float64)
        keys = keys.repeat_interleave(group, dim=1)  # [L, H, D]: head h reads kv head h // group
        values = values.repeat_interleave(group, dim=1)
        queries = q[first:last].to(torch.float64)  # [n, H, D]
        scores = torch.einsum("nhd,lhd->hnl", queries, keys) * scale
        query_pos = torch.arange(seq_len - num_new, seq_len, device=q.device)
        visible = positions[None, :] <= query_pos[:, None]  # [n, L]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[first:last] = torch.einsum("hnl,lhd->nhd", scores.softmax(dim=-1), values)
    return out
