"""Reduce an adapter above ``max_lora_rank`` to the cap, for adapters that opt in.

The update a LoRA pair applies is ``scale * B A`` (rank r). Its best rank-k approximation in the
Frobenius norm is the truncated SVD (Eckart-Young), computed here without forming the
out x in matrix: with ``B = Qb Rb`` and ``A^T = Qa Ra``, ``B A = Qb (Rb Ra^T) Qa^T`` and only the
small r x r core needs an SVD. The reduced pair is ``B' = Qb U_k sqrt(S_k)``,
``A' = sqrt(S_k) V_k^T Qa^T``, so the scale stays the adapter's own.
"""

from __future__ import annotations

import math

import torch

Pair = tuple[torch.Tensor, torch.Tensor]


def truncate_pair(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[Pair, float, float]:
    """(A' [k, in], B' [out, k]), squared Frobenius norm of the dropped part, of the whole."""
    a64, b64 = a.double(), b.double()
    qb, rb = torch.linalg.qr(b64)  # [out, r], [r, r]
    qa, ra = torch.linalg.qr(a64.T)  # [in, r], [r, r]
    u, s, vh = torch.linalg.svd(rb @ ra.T)
    root = s[:rank].sqrt()
    new_b = (qb @ u[:, :rank]) * root
    new_a = root[:, None] * (vh[:rank] @ qa.T)
    return (new_a.to(a.dtype), new_b.to(b.dtype)), float((s[rank:] ** 2).sum()), float((s**2).sum())


def truncate_adapter(weights: dict[tuple[int, str], Pair], rank: int) -> tuple[dict[tuple[int, str], Pair], float]:
    """Every pair reduced to ``rank``; returns the relative Frobenius error of the whole update
    (all layers and modules together), which the load reports."""
    out: dict[tuple[int, str], Pair] = {}
    dropped = total = 0.0
    for key, (a, b) in weights.items():
        out[key], d, t = truncate_pair(a, b, rank)
        dropped += d
        total += t
    return out, math.sqrt(dropped / total) if total else 0.0
