"""A seeded request's sampling noise: Exp(1) per token from a counter-based hash of (seed, output
position, token id), written into the seeded rows of the step's noise in one launch.

Semantics, for each seeded row i and token j::

    key  = mix(mix(seed_lo[i]) ^ seed_hi[i]);  key = mix(key ^ position[i])
    bits = mix(mix(key ^ j) ^ key)                          (32-bit words; mix: xor-shift-multiply)
    noise[rows[i], j] = float32(-log((bits + 0.5) / 2**32))  (the log in float64: never log(0))

Why a kernel: the same hash as torch operations on int64 tensors was 68 launches a step (the
host-overhead benchmark's sampled decode at batch 256, half its rows seeded: 109 launches outside
the graph, 41 with this kernel), 28 of them over the whole [seeded rows, vocabulary] block, each
reading and writing 8 bytes a token: about 7 GB of device traffic a step for 128 seeded rows of a
128,256-token vocabulary (computed from the sizes, some 2 ms of an H200's copy bandwidth; not
measured on a GPU). Here it is one launch that reads three words a row and writes each token's 4
bytes once. The torch version below is the reference and the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one stays inside int64 in the torch version.
MUL_A, MUL_B = 0x7FEB352D, 0x4C957F2D
_MUL_A: tl.constexpr = tl.constexpr(MUL_A)  # a jitted function reads globals only as constexprs
_MUL_B: tl.constexpr = tl.constexpr(MUL_B)


def _mix_reference(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash on int64 tensors holding values below 2**32."""
    x = x ^ (x >> 16)
    x = (x * MUL_A) & MASK32
    x = x ^ (x >> 15)
    x = (x * MUL_B) & MASK32
    return x ^ (x >> 16)


def seeded_noise_reference(seed_lo: torch.Tensor, seed_hi: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] Exp(1) noise that depends only on each row's 64-bit seed (two 32-bit halves,
    any integer dtype), its output position and the token id."""
    key = _mix_reference(_mix_reference(seed_lo.long() & MASK32) ^ (seed_hi.long() & MASK32))
    key = _mix_reference(key ^ (position.long() & MASK32))
    ids = torch.arange(vocab, device=key.device, dtype=torch.long)
    bits = _mix_reference(_mix_reference(key.unsqueeze(1) ^ ids) ^ key.unsqueeze(1))
    u = (bits.double() + 0.5) / 2.0**32
    return (-torch.log(u)).float()


@triton.jit
def _mix(x):
    # uint32 arithmetic wraps at 2**32 and shifts right logically: the reference's masks.
    x = x ^ (x >> 16)
    x = x * _MUL_A
    x = x ^ (x >> 15)
    x = x * _MUL_B
    return x ^ (x >> 16)


@triton.jit
def _seeded_noise_kernel(noise_ptr, rows_ptr, seed_lo_ptr, seed_hi_ptr, position_ptr, vocab, stride_n, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.load(seed_lo_ptr + i).to(tl.uint32, bitcast=True)
    hi = tl.load(seed_hi_ptr + i).to(tl.uint32, bitcast=True)
    pos = tl.load(position_ptr + i).to(tl.uint32, bitcast=True)
    key = _mix(_mix(lo) ^ hi)
    key = _mix(key ^ pos)
    bits = _mix(_mix(key ^ cols.to(tl.uint32)) ^ key)
    u = (bits.to(tl.float64) + 0.5) / 4294967296.0
    row = tl.load(rows_ptr + i).to(tl.int64)
    tl.store(noise_ptr + row * stride_n + cols, (-tl.log(u)).to(tl.float32), mask=cols < vocab)


def seeded_noise(
    noise: torch.Tensor, rows: torch.Tensor, seed_lo: torch.Tensor, seed_hi: torch.Tensor, position: torch.Tensor
) -> None:
    """Write each seeded row's noise into ``noise`` [n, vocab] (float32, rows contiguous) at
    ``rows`` (int32); ``seed_lo``, ``seed_hi`` and ``position`` are int32 words, one a seeded row."""
    seeded, vocab = rows.shape[0], noise.shape[1]
    if seeded == 0:
        return
    block = min(4096, triton.next_power_of_2(vocab))
    grid = (seeded, triton.cdiv(vocab, block))
    _seeded_noise_kernel[grid](noise, rows, seed_lo, seed_hi, position, vocab, noise.stride(0), BLOCK=block)
