"""The FP8 base as a native FP8 GEMM (``torch._scaled_mm``), where the hardware has one.

The GEMM runs here through torch's CPU implementation of the same row-wise scaled op, so what is
checked is the arithmetic: per-token activation scales, per-channel weight scales, the bias, and
the LoRA update added on top in the slots' precision. On a GPU only the kernel differs.
"""

from __future__ import annotations

import pytest
import torch

from loraplane.kernels import LoraSlots
from loraplane.kernels.lora_batch import LoraBatch
from loraplane.serving.model.layers import LoraLinear, fp8_gemm_supported


def _layer(native: bool, bias: bool = False) -> LoraLinear:
    torch.manual_seed(0)
    layer = LoraLinear(64, [32, 16, 16], ["q_proj", "k_proj", "v_proj"], bias=bias)
    layer.weight.data.normal_(0, 0.05)
    if layer.bias is not None:
        layer.bias.data.normal_(0, 0.1)
    layer.to(torch.bfloat16)
    layer.to_fp8(native)
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_the_fp8_gemm_matches_the_dequantised_weight(bias: bool) -> None:
    dequant, gemm = _layer(False, bias), _layer(True, bias)
    assert gemm.fp8_gemm and not dequant.fp8_gemm
    x = torch.randn(7, 64).to(torch.bfloat16)
    x[3] *= 50  # rows of very different magnitudes, each quantised with its own scale
    exact = x.float() @ dequant.base_weight(torch.float32).T + (dequant.bias.float() if bias else 0)  # type: ignore[union-attr]
    ours = gemm(x, None).float()
    # e4m3 keeps 3 mantissa bits: about 6% per product, averaging out over 64 terms.
    err = (ours - exact).abs() / exact.abs().amax(dim=1, keepdim=True)
    assert err.max() < 0.05


def test_an_adapter_adds_on_top_of_the_fp8_gemm() -> None:
    layer = _layer(True)
    slots = LoraSlots.empty(2, 4, 64, 32)
    a, b = torch.randn(4, 64) * 0.1, torch.randn(32, 4) * 0.1
    slots.write(1, a, b, 2.0)
    layer.lora[0] = slots
    x = torch.randn(3, 64).to(torch.bfloat16)
    rows = torch.tensor([1, -1, 1], dtype=torch.int32)
    batch = LoraBatch(row_slots=rows, seg_starts=None, seg_slots=None, active_modules=frozenset({"q_proj"}))
    with_lora, base = layer(x, batch).float(), layer(x, None).float()
    update = 2.0 * (x.float() @ a.T) @ b.T * torch.tensor([[1.0], [0.0], [1.0]])  # row 1 has no adapter
    torch.testing.assert_close(with_lora[:, :32] - base[:, :32], update, atol=0.05, rtol=0.05)
    assert torch.equal(with_lora[:, 32:], base[:, 32:])


def test_fp8_gemms_run_where_fp8_tensor_cores_are() -> None:
    assert not fp8_gemm_supported(torch.device("cpu"), torch.bfloat16)
    if torch.cuda.is_available():  # on a GPU machine: capability 8.9 (Ada) and up
        device = torch.device("cuda", 0)
        assert fp8_gemm_supported(device, torch.bfloat16) == (torch.cuda.get_device_capability(device) >= (8, 9))
        assert not fp8_gemm_supported(device, torch.float16)  # the row-wise GEMM writes bfloat16
