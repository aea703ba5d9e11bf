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


def test_kv_write_matches_index_assignment() -> None:
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(10, 2, 32, generator=g), torch.randn(10, 2, 32, generator=g)
    blocks = torch.randperm(6, generator=g)[:5].repeat_interleave(2).int()
    offsets = torch.tensor([0, 3] * 5, dtype=torch.int32)
    caches = [torch.zeros(6, 4, 2, 32) for _ in range(4)]
    cpu_layer.kv_write(k, v, caches[0], caches[1], blocks, offsets)
    caches[2][blocks.long(), offsets.long()] = k
    caches[3][blocks.long(), offsets.long()] = v
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_shapes_that_do_not_agree_are_refused_before_any_read() -> None:
    """numba does not check bounds, so a mismatch must fail in Python, naming the op."""
    with pytest.raises(ValueError, match="rms_norm"):
        cpu_layer.rms_norm(torch.zeros(2, 8), torch.ones(6), 1e-5)
    case = make_case([(3, 1)], heads=4, kv_heads=2)
    out = torch.empty_like(case.q)
    rows = case.query_starts[:-1].contiguous()
    with pytest.raises(ValueError, match="decode_attention"):
        cpu_layer.decode_attention(case.q[:, :3], case.k_cache, case.v_cache, case.block_tables, case.seq_lens, rows, out)
