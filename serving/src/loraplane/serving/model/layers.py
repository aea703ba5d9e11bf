"""Norm, rotary embedding and the base-plus-adapter linear layer.

:class:`LoraLinear` is where the brief's equation lives: one shared base matmul for the whole
batch, then the gathered low-rank products of the slices an adapter targets, added in place by the
step's :class:`~loraplane.kernels.lora_batch.LoraBatch`. Fused
projections (q/k/v, gate/up) keep one slot table per slice so an adapter can target ``q_proj``
without ``k_proj``. Base weights stay unmerged; adapters are never folded into them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from loraplane.kernels import LoraSlots, PagedLoraSlots, StackedLoraSlots, cpu, cpu_layer, ops  # noqa: F401  (ops registers torch.ops.loraplane.*)
from loraplane.kernels.lora_batch import LoraBatch, Slices, cpu_row_slices
from loraplane.serving.model import cpu_gemm

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and cpu_layer.applies(x, self.weight):
            # One pass, the same numbers up to summation order: in float32 the casts below are no-ops.
            return cpu_layer.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One op, the same numbers: in float32 the casts below are no-ops (checked bit for bit).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Same order of operations as transformers' LlamaRMSNorm: normalise in fp32, cast, scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The same norm as one kernel; with ``residual``, ``x`` is first added into it (in
        place: the residual stream) and the sum is what is normalised."""
        out = torch.empty_like(x)
        torch.ops.loraplane.rms_norm(x, self.weight, self.eps, out, residual)
        return out


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, indexed by each token's position."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, inv_freq: list[float], max_positions: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), torch.tensor(inv_freq, dtype=torch.float32))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, KV, D]; the rotate-half layout of Hugging Face checkpoints."""
        rotation = self.at(positions, q.dtype)
        return rotation.apply(q), rotation.apply(k)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """The rows' cos and sin, looked up once for a step's every layer (the eager path)."""
        return Rotation(self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype))

    def fused(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """The same rotation as one kernel, in place on ``q`` and ``k``."""
        torch.ops.loraplane.rotary(q, k, positions, self.cos, self.sin)


class Rotation:
    """A step's rows' cos and sin [T, 1, D], in the activations' dtype."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, heads, D] rotated: queries and keys alike (or both at once, side by side)."""
        return x * self.cos + _rotate_half(x) * self.sin

    def rotated(self, x: torch.Tensor) -> torch.Tensor:
        """``apply(x)``, for a caller done with ``x``: in float32 on a CPU rotated in place in one
        pass (``cpu_layer.rotate``; a view is fine) and returned, otherwise a new tensor."""
        if cpu_layer.applies(x, self.cos):
            cpu_layer.rotate(x, self.cos.squeeze(1), self.sin.squeeze(1))
            return x
        return self.apply(x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LoraLinear(nn.Module):
    """``y = x W^T (+ b) + scale_a (x A_a^T) B_a^T`` per row, for one or more fused output slices.

    ``slice_names`` are the PEFT target-module names of the slices in output order (for example
    ``q_proj, k_proj, v_proj``). The weight is either dense or float8_e4m3fn with one scale per
    output channel (:meth:`to_fp8`). An FP8 weight runs as a native FP8 GEMM where the hardware
    has one (``torch._scaled_mm`` with the activations quantised per token, see
    :func:`fp8_linear`); elsewhere it is dequantised per call, so that only one layer's weight
    is ever held at full precision.
    """

    def __init__(self, in_features: int, slice_sizes: list[int], slice_names: list[str], *, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.slice_names = tuple(slice_names)
        self.slice_offsets = tuple(sum(slice_sizes[:i]) for i in range(len(slice_sizes)))
        self.slice_sizes = tuple(slice_sizes)
        out = sum(slice_sizes)
        self.weight = nn.Parameter(torch.zeros(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None
        self.weight_scale: torch.Tensor | None = None
        self.fp8_gemm = False  # whether an FP8 weight runs as a native FP8 GEMM
        self.packed: torch.Tensor | None = None  # the weight in oneDNN's blocked layout (cpu_gemm.pack)
        self.lora: list[LoraSlots | PagedLoraSlots | None] = [None] * len(slice_names)
        # The slices' slots in one table (views of it in ``lora``), where the kernels take a fused
        # projection in one launch: set by the slot table on the Triton backend.
        self.stacked: StackedLoraSlots | None = None
        self._slices: dict[tuple[object, ...], tuple[Slices, cpu.RowSlices | None]] = {}  # _active_slices

    def to_fp8(self, native: bool = False) -> None:
        """Quantise the weight to float8_e4m3fn per output channel; ``native`` runs it as an FP8
        GEMM (where :func:`fp8_gemm_supported` says so), else it is dequantised per call."""
        w = self.weight.data.float()
        scale = (w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX).to(torch.float32)
        self.weight = nn.Parameter((w / scale[:, None]).to(torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale = scale
        self.fp8_gemm = native and self.in_features % 16 == 0 and sum(self.slice_sizes) % 16 == 0

    def base_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.weight_scale is None:
            return self.weight
        return self.weight.to(dtype) * self.weight_scale.to(dtype)[:, None]

    def forward(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        if self.packed is not None:
            y = cpu_gemm.linear(x, self.packed, self.bias)
        elif self.fp8_gemm and self.weight_scale is not None:
            y = fp8_linear(x, self.weight, self.weight_scale, self.bias)
        else:
            y = F.linear(x, self.base_weight(x.dtype), self.bias)
        if lora is None:
            return y
        slices, prepared = self._active_slices(lora.active_modules)
        lora.add(y, x, slices, self.stacked, prepared)
        return y

    def _active_slices(self, active: frozenset[str]) -> tuple[Slices, cpu.RowSlices | None]:
        """The slices an adapter of this step targets, with their CPU row-kernel arguments
        (``cpu_row_slices``), made once per set of active modules and kept: a decode step asks
        for them in each of its some 120 projections. Keyed by the slot tables too, so tables put
        in place later are picked up."""
        key = (active, *map(id, self.lora))
        hit = self._slices.get(key)
        if hit is None:
            slices = [
                (offset, slots)
                for name, offset, slots in zip(self.slice_names, self.slice_offsets, self.lora, strict=True)
                if slots is not None and name in active
            ]  # fmt: skip
            if len(self._slices) >= 256:  # a bound: subsets of seven targets, and replaced tables kept alive
                self._slices.clear()
            hit = self._slices[key] = (slices, cpu_row_slices(slices) if slices else None)
        return hit


def fp8_gemm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """FP8 tensor cores (compute capability 8.9: Ada, Hopper and later) and a bfloat16 model: the
    row-wise scaled GEMM writes bfloat16."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (weight * weight_scale[:, None]).T`` as one FP8 GEMM: each token's activations are
    quantised with their own scale (dynamic, per token; a per-tensor scale would let one outlier
    token flatten every other row), and the GEMM applies both scales to its float32 accumulator.

    Semantics: ``y[t, n] = sum_k (xq[t, k] * sx[t]) * (wq[n, k] * sw[n])`` with xq, wq float8_e4m3fn.
    Shapes: x [T, K] bf16, weight [N, K] float8_e4m3fn, weight_scale [N] float32; y [T, N] in x's dtype.
    """
    x_scale = (x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX).contiguous()
    xq = (x.float() / x_scale).to(torch.float8_e4m3fn)
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale[None, :], out_dtype=x.dtype)
    return y if bias is None else y + bias
