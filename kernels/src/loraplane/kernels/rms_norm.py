"""RMSNorm, optionally with the residual add before it, in one kernel (the GPU path's layer norms).

Semantics::

    rms_norm(x, weight, eps):                 out = weight * bf(x / sqrt(mean(x^2) + eps))
    rms_norm(x, weight, eps, residual=r):     r <- bf(x + r);  out = weight * bf(r / sqrt(mean(r^2) + eps))

``bf`` is a rounding to the activations' dtype, where the eager model rounds (transformers'
``LlamaRMSNorm``: normalise in float32, cast, scale); the residual is rounded once, as the
eager ``x + r`` does. Shapes: x, r, out [T, N]; weight [N]. One program normalises ``BLOCK_M``
rows whole (N fits one tile: a model's hidden size), so a layer's two norms and two residual adds
are two launches rather than a dozen.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    T,
    N,
    eps,
    stride_xm,
    stride_rm,
    stride_om,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < T) & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + rows64[:, None] * stride_rm + cols[None, :]
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(r_ptrs, x, mask=mask)
    h = x.to(tl.float32)
    mean = tl.sum(h * h, axis=1) / N
    h = h * tl.rsqrt(mean + eps)[:, None]
    w = tl.load(weight_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    out = (w[None, :] * h.to(out_ptr.dtype.element_ty).to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows64[:, None] * stride_om + cols[None, :], out, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    """``out`` <- the norm of ``x`` (after ``residual`` <- ``x + residual``, when given)."""
    t, n = x.shape
    if t == 0:
        return
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(16, 8192 // block_n))  # a tile of at most 8K elements per program
    res = residual if residual is not None else x
    _rms_norm_kernel[(triton.cdiv(t, block_m),)](
        x, res, weight, out, t, n, eps, x.stride(0), res.stride(0), out.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
