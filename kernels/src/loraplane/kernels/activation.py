"""SiLU-and-multiply, the gated MLP's activation, in one kernel.

Semantics::

    out[t, :] = bf(bf(silu(gate_up[t, :I])) * gate_up[t, I:])      silu(g) = g / (1 + exp(-g))

rounded where the eager ``F.silu(gate) * up`` rounds. Shapes: gate_up [T, 2I], out [T, I].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, T, N, stride_gm, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < T) & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_up_ptr + rows64[:, None] * stride_gm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + rows64[:, None] * stride_gm + N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + rows64[:, None] * stride_om + cols[None, :], (s * u).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    t, i = out.shape
    if t == 0:
        return
    block_n = min(1024, triton.next_power_of_2(i))
    block_m = max(1, 4096 // block_n)
    grid = (triton.cdiv(t, block_m), triton.cdiv(i, block_n))
    _silu_and_mul_kernel[grid](gate_up, out, t, i, gate_up.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n)
