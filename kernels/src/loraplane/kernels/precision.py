"""The precision of the Triton kernels' ``tl.dot`` for a model's dtype, one rule for all of them.

The kernels widen their operands to float32 before every dot (Triton's CPU interpreter multiplies
bf16 bit patterns otherwise), so the dot's ``input_precision`` decides the speed: TF32 runs on
the tensor cores and holds bf16 and fp16 values exactly (10 mantissa bits against their 7 and
10), while ``ieee`` float32 dots, which a float32 model keeps, run without them. On an H200 an
``ieee`` SGMV shrink took as long as the base GEMM it rides on (docs/benchmarks.md).
"""

from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for a model in ``dtype``."""
    return "ieee" if dtype == torch.float32 else "tf32"
