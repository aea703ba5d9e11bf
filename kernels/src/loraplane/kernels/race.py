"""Each row's token from its logits in one launch: the argmax for a greedy row, the exponential
race over the tokens the filters keep for a sampled one, and a failure code for a row with no
token to give.

Semantics, for a row of logits x with temperature T, cut-off c (``kernels.top_k_top_p``; none:
-inf), min-p m and Exp(1) noise q::

    T <= 0:  token = argmax(x)                                   (the first of equal maxima)
    T > 0:   s = x / T;  e = exp(s - max(s))                     (each token's probability times Z)
             kept = (s >= c) and not (e < m)                     (min-p: p < m * max p, as e < m)
             token = argmax over kept of e / max(q, tiny)        (picks i with probability p_i)
             (argmax(x) where nothing is kept: only when x / T overflows float32)
    NOT_FINITE   where x holds a NaN or +inf
    NONE_ALLOWED where every x is -inf (the masks left no token)

The softmax's normaliser cancels in the race, so a sampled row needs two passes over its logits
(the maximum, then the race) and no probability tensor.

Why a kernel: the same as torch operations was some twenty launches a step over the whole
[rows, vocabulary] block (the division, the mask, the softmax, min-p, the noise's clamp, the race's
division and argmax, the finiteness checks and the three selections), each reading and writing it:
a few GB of device traffic a step at a 256-row batch of a 128,256-token vocabulary. The kernel
reads the logits twice and the noise once. The torch version below is the reference and the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplane.kernels.top_k_top_p import scale

NOT_FINITE, NONE_ALLOWED = -1, -2  # what a row's token says when it has none
_NOT_FINITE: tl.constexpr = tl.constexpr(NOT_FINITE)
_NONE_ALLOWED: tl.constexpr = tl.constexpr(NONE_ALLOWED)
TINY = torch.finfo(torch.float32).tiny  # noise is never 0: a zero-probability token's 0 / 0 is a NaN
_TINY: tl.constexpr = tl.constexpr(TINY)
_LAST: tl.constexpr = tl.constexpr(2**31 - 1)  # an index past every column: loses every min


def race_reference(
    logits: torch.Tensor, temperature: torch.Tensor, cut: torch.Tensor | None, min_p: torch.Tensor, noise: torch.Tensor | None
) -> torch.Tensor:
    """[rows] int64 tokens (or the failure codes); ``noise`` None when no row samples."""
    token = logits.argmax(dim=-1)
    if noise is not None:
        scaled = scale(logits, temperature)
        if cut is not None:
            scaled = scaled.masked_fill(scaled < cut.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        probs = probs.masked_fill(probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True), 0.0)
        score = (probs / noise.clamp(min=TINY)).nan_to_num(nan=-1.0)
        drawn = (temperature > 0) & (score >= 0).any(dim=-1)  # else the scaled row overflowed: greedy
        token = torch.where(drawn, score.argmax(dim=-1), token)
    broken = ~(torch.isfinite(logits) | (logits == float("-inf"))).all(dim=-1)  # a NaN or +inf
    token = torch.where((logits > float("-inf")).any(dim=-1), token, NONE_ALLOWED)
    return torch.where(broken, NOT_FINITE, token)


@triton.jit
def _race_kernel(
    x_ptr, temperature_ptr, cut_ptr, min_p_ptr, noise_ptr, token_ptr, vocab, stride_x, stride_noise,
    HAS_CUT: tl.constexpr, SAMPLED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    xrow = x_ptr + row.to(tl.int64) * stride_x
    offs = tl.arange(0, BLOCK)
    # The maximum (each lane keeps its first), and whether any logit is NaN, +inf or above -inf.
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    at = tl.full([BLOCK], _LAST, tl.int32)
    bad = tl.zeros([BLOCK], tl.int32)
    alive = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        x = tl.load(xrow + cols, mask=cols < vocab, other=float("-inf"))
        bad |= ((x != x) | (x == float("inf"))).to(tl.int32)
        alive |= (x > float("-inf")).to(tl.int32)
        take = x > best
        best = tl.where(take, x, best)
        at = tl.where(take, cols, at)
    top = tl.max(best, 0)
    token = tl.min(tl.where(best == top, at, _LAST), 0)
    if SAMPLED:
        t = tl.load(temperature_ptr + row)
        if t > 0:
            m = tl.load(min_p_ptr + row)
            c = float("-inf")
            if HAS_CUT:
                c = tl.load(cut_ptr + row)
            nrow = noise_ptr + row.to(tl.int64) * stride_noise
            peak = tl.math.div_rn(top, t)  # IEEE division, as the cut-off kernel's and torch's
            score = tl.full([BLOCK], -1.0, tl.float32)
            at = tl.full([BLOCK], _LAST, tl.int32)
            for start in range(0, vocab, BLOCK):
                cols = start + offs
                inside = cols < vocab
                s = tl.math.div_rn(tl.load(xrow + cols, mask=inside, other=float("-inf")), t)
                e = tl.exp(s - peak)
                q = tl.maximum(tl.load(nrow + cols, mask=inside, other=1.0), _TINY)
                r = tl.where(inside & (s >= c) & (e >= m), tl.math.div_rn(e, q), -1.0)
                take = r > score
                score = tl.where(take, r, score)
                at = tl.where(take, cols, at)
            high = tl.max(score, 0)
            # No token kept (logits so far out that dividing by T overflowed): the greedy token.
            token = tl.where(high >= 0, tl.min(tl.where(score == high, at, _LAST), 0), token)
    token = tl.where(tl.max(alive, 0) > 0, token, _NONE_ALLOWED)
    token = tl.where(tl.max(bad, 0) > 0, _NOT_FINITE, token)
    tl.store(token_ptr + row, token.to(tl.int64))


def race(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    cut: torch.Tensor | None,
    min_p: torch.Tensor,
    noise: torch.Tensor | None,
    token: torch.Tensor,
) -> None:
    """Write each row's token into ``token`` [rows] int64: ``logits`` [rows, vocab] float32 with
    contiguous rows; ``temperature``, ``min_p`` and ``cut`` float32 [rows]; ``noise`` float32
    like ``logits`` (None when no row samples; ``cut`` None when no row cuts)."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    block = min(2048, triton.next_power_of_2(vocab))
    _race_kernel[(rows,)](
        logits, temperature, logits if cut is None else cut, min_p, logits if noise is None else noise, token,
        vocab, logits.stride(0), 0 if noise is None else noise.stride(0),
        HAS_CUT=cut is not None, SAMPLED=noise is not None, BLOCK=block,
    )  # fmt: skip
