"""The layer's fused Triton kernels (RMSNorm with the residual add, rotary, SiLU-and-multiply, the KV
write) against the eager torch ops the CPU path runs (transformers' Llama's order and rounding),
in Triton's interpreter (``TRITON_INTERPRET=1``, set by the root conftest).

float32: the same to float32's rounding (the kernels sum the norm's squares in another order).
bfloat16: within a few bfloat16 steps. The kernels round where the eager ops round, but the
interpreter casts float32 to bfloat16 by truncation where a GPU rounds to nearest (Triton's
``create_fp_trunc``), so each of an element's roundings may be one step off here; the bit-level
agreement is the GPU check's (``benchmarks/gpu_check.py``, parity).
"""

from __future__ import annotations

import pytest
import torch

from loraplane.kernels import ops  # noqa: F401  (registers torch.ops.loraplane.*)
from loraplane.serving.model.layers import RMSNorm, RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    if want.dtype == torch.bfloat16:  # a few bf16 steps (2^-8 relative each), of the values' own scale where terms cancel
        scale = float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-5, atol=2**-6 * scale)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_rms_norm_with_and_without_the_residual_add(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = (torch.rand(96, generator=g) + 0.5).to(dtype)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    residual = torch.randn(rows, 96, generator=g).to(dtype)
    close(norm.fused(x), norm(x))
    summed = x + residual  # the eager layer's residual add, rounded once
    stream = residual.clone()
    close(norm.fused(x, stream), norm(summed))
    close(stream, summed)  # the residual stream holds the rounded sum


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_views_of_the_fused_projection(dtype: torch.dtype) -> None:
    heads, kv_heads, dim, rows = 4, 2, 16, 9
    rope = RotaryEmbedding([1.0 / (10000 ** (i / dim)) for i in range(0, dim, 2)], 64)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    positions = torch.tensor([0, 3, 5, 63, 1, 2, 2, 40, 7], dtype=torch.int32)
    q = qkv[:, : heads * dim].view(rows, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    want_q, want_k = rope(positions.long(), q.clone(), k.clone())
    rope.fused(positions, q, k)
    close(q, want_q)
    close(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before), "the values are not touched"


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gate_up = torch.randn(13, 2 * 40, generator=torch.Generator().manual_seed(1)).to(dtype) * 3
    out = torch.empty(13, 40, dtype=dtype)
    torch.ops.loraplane.silu_and_mul(gate_up, out)
    close(out, torch.nn.functional.silu(gate_up[:, :40]) * gate_up[:, 40:])


@pytest.mark.parametrize("strided_cache", [False, True], ids=["own", "page-pool view"])
def test_kv_write_puts_each_rows_key_and_value_in_its_slot(strided_cache: bool) -> None:
    blocks, block_size, kv_heads, dim, rows = 6, 4, 2, 8, 5
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(rows, (2 + 2 * kv_heads) * dim, generator=g)
    k = qkv[:, 2 * dim : (2 + kv_heads) * dim].view(rows, kv_heads, dim)
    v = qkv[:, (2 + kv_heads) * dim :].view(rows, kv_heads, dim)
    if strided_cache:  # as unified paging lays a layer's cache out in the page pool
        pool = torch.zeros(blocks, 2, block_size, kv_heads, dim)
        k_cache, v_cache = pool[:, 0], pool[:, 1]
    else:
        k_cache, v_cache = torch.zeros(blocks, block_size, kv_heads, dim), torch.zeros(blocks, block_size, kv_heads, dim)
    slot_blocks = torch.tensor([5, 0, 2, 2, 3], dtype=torch.int32)
    slot_offsets = torch.tensor([3, 0, 1, 2, 0], dtype=torch.int32)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[slot_blocks.long(), slot_offsets.long()] = k
    want_v[slot_blocks.long(), slot_offsets.long()] = v
    torch.ops.loraplane.kv_write(k, v, k_cache, v_cache, slot_blocks, slot_offsets)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
