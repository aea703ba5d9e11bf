"""The CPU path's numba layer loops (``loraplane.kernels.cpu_layer``) against torch and the float64
attention reference: decode attention over shuffled blocks whose every slot outside a context is
NaN (a loop that reads past a length, or a padding entry, fails loudly), grouped-query heads, a
strided query view and the unified page pool's strided cache views; the norm against
``F.rms_norm``; the rotation against the eager ops; KV writes against index assignment."""

from __future__ import annotations

import pytest
import torch
from attention_cases import Case, check, make_case
from torch.nn import functional as F

from loraplane.kernels import cpu_layer

DECODES = [(5, 1), (40, 1), (16, 1), (0, 1), (130, 1)]  # lengths 6..131, within and across blocks


def decode(case: Case, q: torch.Tensor | None = None) -> torch.Tensor:
    q = case.q if q is None else q
    out = torch.full(q.shape, float("nan"))
    rows = case.query_starts[:-1].contiguous()
    cpu_layer.decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, rows, out)
    return out


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (9, 3)])
@pytest.mark.parametrize("strided", [False, True], ids=["own cache", "page pool view"])
def test_decode_attention_matches_the_reference(heads: int, kv_heads: int, strided: bool) -> None:
    case = make_case(DECODES, heads=heads, kv_heads=kv_heads, strided=strided, seed=heads)
    check(case, decode(case))


def test_decode_attention_reads_a_strided_query_and_runs_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine hands it the query heads as a view of the fused q/k/v output, and long
    contexts take the parallel loop: both give the reference's numbers."""
    case = make_case(DECODES, heads=8, kv_heads=2, seed=3)
    fused = torch.randn(case.q.shape[0], 8 + 2 * 2, case.q.shape[2])
    fused[:, :8] = case.q
    view = fused[:, :8]
    assert not view.is_contiguous()
    check(case, decode(case, view))
    monkeypatch.setattr(cpu_layer, "PARALLEL_MIN_WORK", 1)
    check(case, decode(case, view))


def test_rms_norm_matches_torch() -> None:
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(70, 576, generator=g) * 3, torch.randn(576, generator=g)
    for rows in (x[:16], x):  # the serial loop (a decode batch) and the parallel one
        torch.testing.assert_close(cpu_layer.rms_norm(rows, weight, 1e-5), F.rms_norm(rows, (576,), weight, 1e-5))


def test_rotation_in_place_matches_the_eager_ops() -> None:
    from loraplane.serving.model.layers import RotaryEmbedding

    g = torch.Generator().manual_seed(1)
    rotary = RotaryEmbedding([10000 ** (-i / 32) for i in range(32)], 256)
    positions = torch.randint(0, 256, (20,), generator=g)
    qkv = torch.randn(20, 16, 64, generator=g)  # 12 query/key heads rotated, 4 value heads not
    rotation = rotary.at(positions, torch.float32)
    expected = rotation.apply(qkv[:, :12])
    values = qkv[:, 12:].clone()
    rotated = rotation.rotated(qkv[:, :12])
    assert rotated.data_ptr() == qkv.data_ptr()  # in place, on the view
    torch.testing.assert_close(rotated, expected)
    assert torch.equal(qkv[:, 12:], values)


@pytest.mark.parametrize("strided", [False, True], ids=["own cache", "page pool view"])
def test_kv_write_matches_index_assignment(strided: bool) -> None:
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(10, 2, 32, generator=g), torch.randn(10, 2, 32, generator=g)
    blocks = torch.randperm(6, generator=g)[:5].repeat_interleave(2).int()
    offsets = torch.tensor([0, 3] * 5, dtype=torch.int32)
    if strided:  # as the unified page pool views a layer: [pages, k/v, layers, block, kv, d][:, i, layer]
        pages = torch.zeros(2, 6, 2, 3, 4, 2, 32)
        caches = [pages[c, :, kv, 1] for c in (0, 1) for kv in (0, 1)]
        assert not caches[0].is_contiguous()
    else:
        caches = [torch.zeros(6, 4, 2, 32) for _ in range(4)]
    cpu_layer.kv_write(k, v, caches[0], caches[1], blocks, offsets)
    caches[2][blocks.long(), offsets.long()] = k
    caches[3][blocks.long(), offsets.long()] = v
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    if strided:  # nothing outside the slots was written: the other layers' rows are still zero
        assert int((pages != 0).sum()) == 2 * 2 * k.numel()


def test_single_threaded_copies_are_cached_apart_from_the_parallel_loops() -> None:
    """numba files its on-disk cache by function name and signature, not by ``parallel``: a
    single-threaded copy under the parallel loop's name loads whichever compiled first. Each
    copy must have an index file of its own."""
    from loraplane.kernels import cpu

    pairs = [(getattr(m, name), getattr(m, f"{name}_serial")) for m, names in [
        (cpu, ["_shrink_rows", "_expand_rows", "_add_lora_slices_rows", "_add_lora_rows_paged"]),
        (cpu_layer, ["_rms_norm", "_rotate", "_kv_write", "_decode_attention"]),
    ] for name in names]  # fmt: skip
    for parallel, single in pairs:
        assert parallel.targetoptions.get("parallel") and not single.targetoptions.get("parallel")
        # Both release the GIL, as torch's ops do: the server's threads run while a step is in one.
        assert parallel.targetoptions.get("nogil") and single.targetoptions.get("nogil")
        assert parallel._cache._cache_file._index_name != single._cache._cache_file._index_name


def test_shapes_that_do_not_agree_are_refused_before_any_read() -> None:
    """numba does not check bounds, so a mismatch must fail in Python, naming the op."""
    with pytest.raises(ValueError, match="rms_norm"):
        cpu_layer.rms_norm(torch.zeros(2, 8), torch.ones(6), 1e-5)
    case = make_case([(3, 1)], heads=4, kv_heads=2)
    out = torch.empty_like(case.q)
    rows = case.query_starts[:-1].contiguous()
    with pytest.raises(ValueError, match="decode_attention"):
        cpu_layer.decode_attention(case.q[:, :3], case.k_cache, case.v_cache, case.block_tables, case.seq_lens, rows, out)
    with pytest.raises(ValueError, match="decode_attention"):
        cpu_layer.decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens[:0], rows, out)
    k, slots = torch.zeros(3, case.k_cache.shape[2], case.k_cache.shape[3]), torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_write"):
        cpu_layer.kv_write(k, k[:2], case.k_cache, case.v_cache, slots, slots)
    with pytest.raises(ValueError, match="kv_write"):
        cpu_layer.kv_write(k, k, case.k_cache, case.v_cache, slots, slots[:2])
    with pytest.raises(ValueError, match="rotate"):
        cpu_layer.rotate(torch.zeros(3, 2, 8), torch.zeros(3, 6), torch.zeros(3, 6))
