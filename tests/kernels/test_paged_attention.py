"""The Triton paged-attention kernel (interpreted on CPU) against the float64 reference, and the
reference against the engine's current CPU attention.

Every cache slot outside a sequence's context, and the block that block-table padding points at,
holds NaN: a kernel that reads past a context (or a padding entry) fails loudly. Tolerances are
relative to the float64 reference computed from the same rounded inputs: float32 1e-5, float16
and bfloat16 1e-2 (output rounding dominates).
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import TOL, Case, check, make_case

from loraplane.kernels import cpu_layer
from loraplane.kernels.paged_attention import launch_config, paged_attention


def run_kernel(case: Case, *, max_query_len: int | None = None) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))  # every row must be written
    paged_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.query_starts,
        case.seq_lens,
        out,
        scale=case.scale,
        max_query_len=case.max_query_len if max_query_len is None else max_query_len,
    )
    return out


MIXED = [(0, 19), (7, 1), (24, 12), (50, 1), (3, 0), (2, 1)]  # prompt, decodes, a cached-prefix chunk, an idle sequence

SHAPES = {
    # name: (spans, heads, kv_heads)
    "decode, lengths 1..41 over up to 3 blocks": ([(5, 1), (40, 1), (16, 1), (0, 1)], 4, 2),
    "prefill, nothing cached": ([(0, 37), (0, 5)], 2, 2),
    "chunked prefill, second chunk after an unaligned first": ([(20, 13)], 8, 1),
    "prefix-cached span (two whole blocks)": ([(32, 9)], 4, 2),
    "mixed prefill spans and decode rows": (MIXED, 4, 2),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_matches_reference(name: str) -> None:
    spans, heads, kv_heads = SHAPES[name]
    case = make_case(spans, heads=heads, kv_heads=kv_heads)
    check(case, run_kernel(case))


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 1), (9, 3)])  # MHA, GQA, MQA, SmolLM2's 3-group
@pytest.mark.parametrize("head_dim", [64, 48, 80])
def test_heads_and_head_dims(heads: int, kv_heads: int, head_dim: int) -> None:
    case = make_case(MIXED, heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=1)
    check(case, run_kernel(case))


@pytest.mark.parametrize("dtype", list(TOL), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("strided", [False, True], ids=["own cache", "page-pool view"])
def test_dtypes_and_page_pool_views(dtype: torch.dtype, strided: bool) -> None:
    case = make_case(MIXED, dtype=dtype, strided=strided, seed=2)
    check(case, run_kernel(case))


@pytest.mark.parametrize("block_size", [5, 8, 16, 32])  # below, at and above the kernel's key tile
def test_block_sizes(block_size: int) -> None:
    case = make_case(MIXED, heads=8, kv_heads=2, block_size=block_size, seed=3)
    check(case, run_kernel(case))


def test_grid_bound_above_the_longest_span_changes_nothing() -> None:
    case = make_case(MIXED, seed=4)
    torch.testing.assert_close(run_kernel(case, max_query_len=case.max_query_len + 40), run_kernel(case), rtol=0, atol=0)


@pytest.mark.parametrize("spare", [0, 5])
def test_a_work_list_grid_matches_the_per_sequence_grid(spare: int) -> None:
    """A CUDA graph's attention: one program per work-list entry (kernels.tiles), with spare
    entries that must do nothing, gives what the per-sequence grid gives, bit for bit. The
    query block is the one ``launch_config`` picks for the graph's token bound."""
    from loraplane.kernels.tiles import tiles

    case = make_case(MIXED, heads=8, kv_heads=2, seed=5)
    bound = int(case.query_starts[-1])  # a graph sizes its tiles by its token bucket
    cfg = launch_config(
        num_seqs=len(MIXED), num_heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, max_query_len=bound
    )
    block_q = int(cfg.constexprs["BLOCK_Q"])
    needed = len(tiles(case.query_starts.tolist(), block_q))
    work = torch.from_numpy(tiles(case.query_starts.tolist(), block_q, needed + spare))
    out = torch.full_like(case.q, float("nan"))
    paged_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.query_starts, case.seq_lens, out, scale=case.scale,
        max_query_len=bound, tiles=work,
    )  # fmt: skip
    torch.testing.assert_close(out, run_kernel(case, max_query_len=bound), rtol=0, atol=0)
    check(case, out)


def test_launch_config_packs_tokens_and_heads() -> None:
    decode = launch_config(
        num_seqs=5, num_heads=32, kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16, max_query_len=1
    )
    assert decode.grid == (5, 1, 8)
    assert decode.constexprs["BLOCK_M"] == 16 and decode.constexprs["BLOCK_Q"] == 4
    prefill = launch_config(
        num_seqs=2, num_heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=torch.float16, max_query_len=1000
    )
    assert prefill.constexprs["BLOCK_M"] == 64 and prefill.constexprs["BLOCK_Q"] == 21  # 63 of 64 rows used
    assert prefill.grid == (2, math.ceil(1000 / 21), 3)
    wide = launch_config(num_seqs=1, num_heads=128, kv_heads=1, head_dim=80, block_size=16, dtype=torch.float32, max_query_len=7)
    assert wide.constexprs["BLOCK_M"] == 128 and wide.constexprs["BLOCK_Q"] == 1 and wide.constexprs["HEAD_DIM_PAD"] == 128
    assert wide.constexprs["DOT_PRECISION"] == "ieee" and prefill.constexprs["DOT_PRECISION"] == "tf32"


def test_rejects_what_it_cannot_run() -> None:
    case = make_case([(3, 2)])
    out = torch.empty_like(case.q)
    args = (case.k_cache, case.v_cache, case.block_tables, case.query_starts, case.seq_lens, out)
    with pytest.raises(ValueError, match="shared evenly"):
        paged_attention(case.q[:, :3], *args[:-1], out[:, :3], scale=1.0, max_query_len=2)
    with pytest.raises(ValueError, match="int32"):
        paged_attention(case.q, *args[:2], case.block_tables.long(), *args[3:], scale=1.0, max_query_len=2)
    with pytest.raises(ValueError, match="head_dim"):
        launch_config(num_seqs=1, num_heads=1, kv_heads=1, head_dim=512, block_size=16, dtype=torch.float16, max_query_len=1)


@pytest.mark.parametrize("in_place", [False, True], ids=["padded gather", "numba in place"])
def test_reference_matches_cpu_attention(in_place: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's CPU attention (SDPA over gathered blocks for the prompts; the decode rows by
    a padded gather and SDPA, or in float32 by ``cpu_layer.decode_attention`` reading the cache
    in place) and the reference agree on a mixed batch, so the kernel can replace it; the kernel
    is checked on the same step too."""
    from loraplane.serving.model.attention import paged_attention as cpu_paged_attention
    from loraplane.serving.model.context import PrefillSpan, StepContext

    if not in_place:  # the path of the dtypes the numba loops do not take, here in float32
        monkeypatch.setattr(cpu_layer, "applies", lambda *tensors: False)

    g = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, bs = 4, 2, 32, 16
    spans = [(0, 6), (3, 1), (16, 5), (20, 1), (9, 7)]  # prompt, decode, cached prefix, decode, second chunk
    k_cache = torch.zeros(12, bs, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    tables: list[list[int]] = [[1], [2], [3, 4], [5, 6], [7]]
    positions, slot_blocks, slot_offsets, prefills, decode_rows, decode_tables = [], [], [], [], [], []
    start = 0
    for (cached, new), table in zip(spans, tables, strict=True):
        for p in range(cached):  # the earlier steps' keys
            k_cache[table[p // bs], p % bs] = torch.randn(kv_heads, head_dim, generator=g)
            v_cache[table[p // bs], p % bs] = torch.randn(kv_heads, head_dim, generator=g)
        span = range(cached, cached + new)
        positions += span
        slot_blocks += [table[p // bs] for p in span]
        slot_offsets += [p % bs for p in span]
        if new == 1:
            decode_rows.append(start)
            decode_tables.append(table)
        else:
            prefills.append(PrefillSpan(start, new, cached + new, torch.tensor(table, dtype=torch.long)))
        start += new
    width = max(len(t) for t in decode_tables)
    decode_lens = torch.tensor([c + n for (c, n) in spans if n == 1])
    ctx = StepContext(
        positions=torch.tensor(positions),
        slot_blocks=torch.tensor(slot_blocks),
        slot_offsets=torch.tensor(slot_offsets),
        prefills=tuple(prefills),
        decode_rows=torch.tensor(decode_rows),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in decode_tables]),
        decode_lens=decode_lens.int(),
    )
    q = torch.randn(start, heads, head_dim, generator=g)
    k = torch.randn(start, kv_heads, head_dim, generator=g)
    v = torch.randn(start, kv_heads, head_dim, generator=g)
    cpu_out = cpu_paged_attention(q, k, v, k_cache, v_cache, ctx)  # also writes this step's k, v

    width = max(len(t) for t in tables)
    case = Case(
        q,
        k_cache,
        v_cache,
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor([0, *[n for _, n in spans]], dtype=torch.int32).cumsum(0, dtype=torch.int32),
        torch.tensor([c + n for c, n in spans], dtype=torch.int32),
        max(n for _, n in spans),
        1 / math.sqrt(head_dim),
    )
    check(case, cpu_out)
    check(case, run_kernel(case))
