"""Attention over a paged KV cache.

The cache of one layer is ``[num_blocks, block_size, kv_heads, head_dim]`` for keys and again
for values; a sequence's tokens live in the blocks its block table lists, in order. New keys
and values are scattered into their slots first, then:

- prefill spans (a prompt or a chunk of one, possibly after a cached prefix) attend causally to
  their sequence's whole context, one span at a time;
- decode rows (one new token each) are attended together.

On a CPU, plain ``scaled_dot_product_attention`` with grouped-query heads does the arithmetic for
prefill spans. In float32 the decode rows and the KV writes go through numba loops that read and
write the cache in place (:mod:`loraplane.kernels.cpu_layer`); in other dtypes the decode rows'
block tables are gathered into one padded batch for SDPA, and a mask hides the padding.

With the Triton backend (CUDA), one kernel (``loraplane::paged_attention``, see
:mod:`loraplane.kernels.paged_attention`) attends every sequence of the step, prefill spans and
decode rows alike, reading keys through the block tables in place.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from loraplane.kernels import cpu_layer, ops  # noqa: F401  (ops registers torch.ops.loraplane.*)
from loraplane.serving.model.context import PrefillSpan, StepContext
from loraplane.serving.model.page_pool import PagePool


class KVCache:
    """Keys and values for every layer: ``[layers, num_blocks, block_size, kv_heads, head_dim]``."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        pool: PagePool | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """Its own tensors, or views of a shared page pool (one page per block) for unified paging."""
        if pool is None:
            shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        else:
            self.k, self.v = pool.kv_views(num_layers, block_size, kv_heads, head_dim, dtype)
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """SDPA in float32 whatever the model dtype: the CPU's bf16 SDPA is several times slower than
    its fp32 one at decode shapes, and fp32 softmax is the accurate choice anyway."""
    dtype = q.dtype
    out = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal, enable_gqa=True
    )  # fmt: skip
    return out.to(dtype)


def _prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: PrefillSpan, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> torch.Tensor:
    rows = slice(span.start, span.start + span.num_new)
    qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if span.context_len == span.num_new:
        # Nothing cached before this span: its own keys are the whole context.
        ks, vs = k[rows], v[rows]
        mask = None
    else:
        kv_heads, head_dim = k.shape[1], k.shape[2]
        ks = k_cache[span.block_ids].reshape(-1, kv_heads, head_dim)[: span.context_len]
        vs = v_cache[span.block_ids].reshape(-1, kv_heads, head_dim)[: span.context_len]
        past = span.context_len - span.num_new
        query_pos = torch.arange(span.num_new).unsqueeze(1) + past
        mask = torch.arange(span.context_len).unsqueeze(0) <= query_pos
    out = _attend(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0), mask, mask is None)
    return out.squeeze(0).transpose(0, 1)


def _decode(q: torch.Tensor, ctx: StepContext, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """The decode rows through one padded gather of their blocks and SDPA, a mask hiding each
    row's padding (dtypes the numba loop does not take)."""
    assert ctx.decode_rows is not None and ctx.decode_block_tables is not None and ctx.decode_lens is not None
    tables = ctx.decode_block_tables
    n, width = tables.shape
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    length = width * k_cache.shape[1]
    mask = (torch.arange(length, device=q.device).unsqueeze(0) < ctx.decode_lens.unsqueeze(1)).view(n, 1, 1, length)
    ks = k_cache[tables].view(n, length, kv_heads, head_dim).transpose(1, 2)
    vs = v_cache[tables].view(n, length, kv_heads, head_dim).transpose(1, 2)
    qs = q[ctx.decode_rows].unsqueeze(2)  # [n, H, 1, D]
    return _attend(qs, ks, vs, mask, False).squeeze(2)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KV, D] for this step's tokens; returns [T, H, D]."""
    # (block, offset) indexing rather than a flat view: the cache may be a strided view of the page pool.
    in_place = not ctx.fused and cpu_layer.applies(q, k, k_cache)  # the CPU's float32 loops
    if ctx.fused:
        torch.ops.loraplane.kv_write(k, v, k_cache, v_cache, ctx.slot_blocks, ctx.slot_offsets)
    elif in_place:
        cpu_layer.kv_write(k, v, k_cache, v_cache, ctx.slot_blocks, ctx.slot_offsets)
    else:
        k_cache[ctx.slot_blocks, ctx.slot_offsets] = k
        v_cache[ctx.slot_blocks, ctx.slot_offsets] = v
    out = torch.empty_like(q)
    if ctx.paged is not None:  # the Triton kernel: every sequence through its block table, no padded copy
        p = ctx.paged
        scale = q.shape[-1] ** -0.5
        torch.ops.loraplane.paged_attention(
            out, q, k_cache, v_cache, p.block_tables, p.query_starts, p.seq_lens, scale, p.max_query_len, p.tiles
        )  # fmt: skip
        return out
    for span in ctx.prefills:
        out[span.start : span.start + span.num_new] = _prefill(q, k, v, span, k_cache, v_cache)
    if ctx.decode_rows is not None and ctx.decode_rows.numel():
        if in_place:
            assert ctx.decode_block_tables is not None and ctx.decode_lens is not None
            cpu_layer.decode_attention(q, k_cache, v_cache, ctx.decode_block_tables, ctx.decode_lens, ctx.decode_rows, out)
        else:
            out[ctx.decode_rows] = _decode(q, ctx, k_cache, v_cache)
    return out
