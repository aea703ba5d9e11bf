"""The CPU path's per-layer work besides its GEMMs, numba-compiled: norms, the rotation, KV writes
and decode attention over the paged cache, all in float32.

Why: at a decode batch a layer's elementwise work is a few thousand numbers, and torch paid tens
of microseconds of dispatch for it (``F.rms_norm`` about 45 us on [16, 576] on a 2-core AMD EPYC,
a rotation five ops), while decode attention gathered every row's blocks into a padded copy twice
a layer (keys, then values) before SDPA read them: about 500 us a layer of the embedded base's
decode step at batch 16 (``benchmarks/cpu_step.py``). These loops read the cache through the
block tables in place, as the Triton kernel does on a GPU, and do a norm or a rotation in one
pass. The MLP's activation stays with torch, whose vectorised ``exp`` numba lacks here (190
against 70 us on [16, 3072]).

They run single-threaded below ``PARALLEL_MIN_ROWS`` rows (decode attention: below
``PARALLEL_MIN_WORK``), as :mod:`loraplane.kernels.cpu`'s do: a parallel region costs more than a
decode batch's work and its threads compete with torch's OpenMP threads for the same cores.
Shapes are checked before a loop runs (numba checks no bounds); the values the loops index with
(block ids, offsets, lengths, rows) are the engine's to keep in range, as for the Triton kernels.
Only float32 takes this path (the CPU engine's dtype where the CPU has no native bfloat16); other
dtypes keep the torch ops, which round where transformers rounds.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange

from loraplane.kernels.cpu import PARALLEL_MIN_ROWS, serial


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    rows, n = x.shape
    for t in prange(rows):
        acc = np.float32(0.0)
        for j in range(n):
            acc += x[t, j] * x[t, j]
        inv = np.float32(1.0) / np.sqrt(acc / np.float32(n) + np.float32(eps))
        for j in range(n):
            out[t, j] = weight[j] * (x[t, j] * inv)


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """x [T, heads, D] in place by its rows' cos and sin [T, D], the rotate-half layout:
    (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    rows, heads, dim = x.shape
    half = dim // 2
    for t in prange(rows):
        for h in range(heads):
            for j in range(half):
                a, b = x[t, h, j], x[t, h, half + j]
                x[t, h, j] = a * cos[t, j] - b * sin[t, j]
                x[t, h, half + j] = b * cos[t, half + j] + a * sin[t, half + j]


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _kv_write(
    k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, blocks: np.ndarray, offsets: np.ndarray
) -> None:
    rows, kv_heads, dim = k.shape
    for t in prange(rows):
        b, o = blocks[t], offsets[t]
        for h in range(kv_heads):
            for d in range(dim):
                k_cache[b, o, h, d] = k[t, h, d]
                v_cache[b, o, h, d] = v[t, h, d]


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _decode_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    tables: np.ndarray,
    lens: np.ndarray,
    rows: np.ndarray,
    scale: float,
    out: np.ndarray,
) -> None:
    """One query row per sequence against its whole context, read through its block table. One
    task per sequence, walking its cache in address order: a token's keys for every KV head are
    one contiguous row, read once for all the query heads (grouped-query attention), and a
    block's tokens follow each other, so the reads stream (a task per KV head read strided rows
    and took twice as long on contexts that had left the caches). The loops walk blocks, then
    their tokens, then KV heads and their query heads, so no index is divided: a division per
    token and head (``j // block_size``, ``h // group``) cost a sixth of the kernel's time (250
    against 208 us for 16 sequences of 60 tokens, 9 heads over 3, a one-off timing)."""
    num_seqs = rows.shape[0]
    heads, dim = q.shape[1], q.shape[2]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    for i in prange(num_seqs):
        t, length = rows[i], lens[i]
        # The query row copied once, scaled: q is often a strided view (of the fused q/k/v
        # projection), and a unit-stride copy is what lets LLVM vectorise the dots below.
        qs = np.empty((heads, dim), dtype=np.float32)
        for h in range(heads):
            for d in range(dim):
                qs[h, d] = q[t, h, d] * np.float32(scale)
        scores = np.empty((heads, length), dtype=np.float32)
        j = 0
        for blk in range((length + block_size - 1) // block_size):
            b = tables[i, blk]
            for o in range(min(block_size, length - j)):
                for g in range(kv_heads):
                    key = k_cache[b, o, g]
                    for h in range(g * group, (g + 1) * group):
                        acc = np.float32(0.0)
                        for d in range(dim):
                            acc += qs[h, d] * key[d]
                        scores[h, j] = acc
                j += 1
        for h in range(heads):
            top = scores[h, 0]
            for j in range(1, length):
                top = max(top, scores[h, j])
            total = np.float32(0.0)
            for j in range(length):
                e = np.exp(scores[h, j] - top)
                scores[h, j] = e
                total += e
            inv = np.float32(1.0) / total
            for j in range(length):
                scores[h, j] *= inv
        acc_out = np.zeros((heads, dim), dtype=np.float32)
        j = 0
        for blk in range((length + block_size - 1) // block_size):
            b = tables[i, blk]
            for o in range(min(block_size, length - j)):
                for g in range(kv_heads):
                    value = v_cache[b, o, g]
                    for h in range(g * group, (g + 1) * group):
                        p = scores[h, j]
                        for d in range(dim):
                            acc_out[h, d] += p * value[d]
                j += 1
        for h in range(heads):
            for d in range(dim):
                out[t, h, d] = acc_out[h, d]


# Decode attention opens a parallel region from this many multiply-adds of scores (the tables'
# width in tokens times the query features: 16 sequences of about 30 tokens at 9 x 64). On the
# embedded base at batch 16 with 43- to 83-token contexts (serial below 1 << 20 then), the two
# threads took 4.4 and 5.5 ms of a step's attention against 6.2 and 8.7 ms serial, alternated in
# an engine on a 2-core AMD EPYC (a one-off timing, the script not kept).
PARALLEL_MIN_WORK = 1 << 18

_rms_norm_serial = serial(_rms_norm)
_rotate_serial = serial(_rotate)
_kv_write_serial = serial(_kv_write)
_decode_attention_serial = serial(_decode_attention)


def applies(*tensors: torch.Tensor) -> bool:
    """Whether these tensors take this path: every one float32 on the CPU."""
    return all(t.dtype == torch.float32 and t.is_cpu for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` per row of x [T, N]."""
    if weight.shape != x.shape[1:]:  # numba does not check bounds: a mismatch would read past weight
        raise ValueError(f"rms_norm: x {list(x.shape)} and weight {list(weight.shape)} do not agree")
    out = torch.empty((x.shape[0], x.shape[1]), dtype=torch.float32)
    kernel = _rms_norm if x.shape[0] >= PARALLEL_MIN_ROWS else _rms_norm_serial
    kernel(x.detach().numpy(), weight.detach().numpy(), eps, out.numpy())
    return out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x [T, heads, D] (a view is fine: queries and keys side by side) rotated in place by its
    rows' cos and sin [T, D]."""
    if cos.shape != sin.shape or cos.shape != (x.shape[0], x.shape[2]):
        raise ValueError(f"rotate: x {list(x.shape)}, cos {list(cos.shape)}, sin {list(sin.shape)} do not agree")
    kernel = _rotate if x.shape[0] >= PARALLEL_MIN_ROWS else _rotate_serial
    kernel(x.detach().numpy(), cos.numpy(), sin.numpy())


def kv_write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor
) -> None:
    """Row t of k and v [T, KV, D] into slot ``offsets[t]`` of block ``blocks[t]`` of the caches."""
    rows = k.shape[0]
    if v.shape != k.shape or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:] or blocks.shape != (rows,):
        raise ValueError(f"kv_write: k {list(k.shape)}, v {list(v.shape)}, caches {list(k_cache.shape)} do not agree")
    if offsets.shape != (rows,):
        raise ValueError(f"kv_write: {rows} rows but {list(offsets.shape)} offsets")
    kernel = _kv_write if k.shape[0] >= PARALLEL_MIN_ROWS else _kv_write_serial
    kernel(k.detach().numpy(), v.detach().numpy(), k_cache.numpy(), v_cache.numpy(), blocks.numpy(), offsets.numpy())


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``out[rows[i]]`` <- attention of ``q[rows[i]]`` [H, D] over the first ``lens[i]`` keys and
    values of sequence i, read through ``tables[i]`` from the caches [blocks, block_size, KV, D]."""
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2] or out.shape != q.shape or v_cache.shape != k_cache.shape:
        raise ValueError(f"decode_attention: q {list(q.shape)}, out {list(out.shape)}, caches {list(k_cache.shape)} do not agree")
    if not (rows.shape == lens.shape == tables.shape[:1]):
        raise ValueError(f"decode_attention: {list(rows.shape)} rows, {list(lens.shape)} lengths, {list(tables.shape)} tables")
    scale = 1.0 / math.sqrt(q.shape[-1])
    # At most this many multiply-adds for the scores: the tables' width, not the lengths' sum (a
    # reduction here cost 20 us, a fifth of a short decode's attention).
    work = tables.shape[0] * tables.shape[1] * k_cache.shape[1] * q.shape[1] * q.shape[2]
    kernel = _decode_attention if work >= PARALLEL_MIN_WORK else _decode_attention_serial
    kernel(
        q.detach().numpy(), k_cache.numpy(), v_cache.numpy(), tables.numpy(), lens.numpy(), rows.numpy(), scale, out.numpy()
    )  # fmt: skip
