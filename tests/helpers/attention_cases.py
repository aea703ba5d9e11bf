"""Paged-attention test cases: shuffled block tables over a cache whose every slot outside a
sequence's context, and the block table padding points at, holds NaN, so an attention that reads
past a context (or a padding entry) fails loudly; ``check`` compares an output with the float64
reference computed from the same rounded inputs (float32 1e-5, float16 and bfloat16 1e-2: output
rounding dominates). Used by the Triton kernel's tests and the CPU loops'."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loraplane.kernels.attention_reference import reference_paged_attention

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
POISON_BLOCK = 0  # padding entries of every block table point here, and it is all NaN


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    query_starts: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    scale: float


def make_case(
    spans: list[tuple[int, int]],
    *,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    strided: bool = False,
    seed: int = 0,
) -> Case:
    """``spans`` lists (tokens already cached, new tokens) per sequence; the cache holds both."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [cached + new for cached, new in spans]
    num_seq_blocks = [-(-length // block_size) for length in seq_lens]
    num_blocks = 1 + sum(num_seq_blocks) + 1  # the poison block, every sequence's, one never used
    if strided:
        # Exactly how the unified page pool views its bytes: [pages, k/v, layers, block, kv, d].
        layers, layer = 3, 1
        page_bytes = 2 * layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        pool = torch.zeros(num_blocks, page_bytes, dtype=torch.uint8)
        pages = pool.view(dtype).view(num_blocks, 2, layers, block_size, kv_heads, head_dim)
        pages.fill_(float("nan"))
        k_cache = pages[:, 0].transpose(0, 1)[layer]
        v_cache = pages[:, 1].transpose(0, 1)[layer]
        assert not k_cache.is_contiguous() and k_cache.stride(0) != block_size * kv_heads * head_dim
    else:
        shape = (num_blocks, block_size, kv_heads, head_dim)
        k_cache = torch.full(shape, float("nan"), dtype=dtype)
        v_cache = torch.full(shape, float("nan"), dtype=dtype)
    # Blocks are handed out in a shuffled order, so a sequence's blocks are not adjacent.
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    width = max(num_seq_blocks) + 1  # one padding column at least
    tables = torch.full((len(spans), width), POISON_BLOCK, dtype=torch.int32)
    for b, length in enumerate(seq_lens):
        blocks = torch.tensor([free.pop() for _ in range(num_seq_blocks[b])], dtype=torch.long)
        tables[b, : len(blocks)] = blocks.int()
        positions = torch.arange(length)
        where = (blocks[positions // block_size], positions % block_size)
        k_cache[where] = torch.randn(length, kv_heads, head_dim, generator=g).to(dtype)
        v_cache[where] = torch.randn(length, kv_heads, head_dim, generator=g).to(dtype)
    news = [new for _, new in spans]
    starts = torch.tensor([0, *news], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(sum(news), heads, head_dim, generator=g).to(dtype)
    return Case(
        q, k_cache, v_cache, tables, starts, torch.tensor(seq_lens, dtype=torch.int32), max(news), 1 / math.sqrt(head_dim)
    )


def check(case: Case, out: torch.Tensor) -> None:
    ref = reference_paged_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.query_starts, case.seq_lens, scale=case.scale
    )
    assert out.dtype == case.q.dtype
    tol = TOL[case.q.dtype]
    torch.testing.assert_close(out.to(torch.float64), ref, rtol=tol, atol=tol)
