"""The CPU's dense GEMMs through oneDNN with weights packed once, not MKL on plain row-major weights.

A decode step on a CPU is mostly its GEMMs (a few rows against every weight of the model), and
torch's default ``F.linear`` (MKL's sgemm on a row-major weight) left most of the cores' FMA
throughput unused at those shapes: on a 2-core AMD EPYC (AVX2), float32, 16 rows, the embedded
base's LM head took 26 ms and its gate/up projection 0.84 ms; with the weight reordered once into
oneDNN's blocked layout (what torch.compile's CPU "freezing" does, and vLLM's CPU backend), 10.4
and 0.49 ms (``benchmarks/cpu_step.py`` measures the whole step). The packed weight works for any
number of rows; the results agree with ``F.linear`` to the last bits of float32 (another order of
accumulation). The plain weight stays beside it: loading, FP8 conversion and the tests read it.
"""

from __future__ import annotations

import torch


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX).

    oneDNN's own check (``torch.ops.mkldnn._is_mkldnn_bf16_supported``) also says yes on plain
    AVX-512, where it converts every bf16 operand to float32 first: there the embedded base's
    decode step at batch 16 took 140 ms in bfloat16 against 66 ms in float32 (an Intel Xeon with
    AVX-512 and no BF16, ``benchmarks/cpu_step.py --dtype``), so ``dtype: auto`` asks this instead."""
    cpu = torch.cpu
    return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())


def available(dtype: torch.dtype) -> bool:
    """oneDNN's linear for ``dtype`` on this CPU: float32 anywhere oneDNN runs; bfloat16 where
    oneDNN takes it (natively on AVX-512 BF16 and AMX, which is when ``resolve_dtype`` picks it;
    converted on plain AVX-512, when asked for)."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor, rows_hint: int = 16) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's layout, tuned for about ``rows_hint`` rows (a decode batch)."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows_hint)
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the weight :func:`pack` made."""
    y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return y
