"""Each row's top-k and top-p cut-off as one value: the tokens at or above it are what the two
filters keep, so the sampler masks with one comparison instead of sorting the vocabulary.

Semantics, for a row of logits scaled by its temperature (x = logits / T; T <= 0, a greedy row,
divides by 1), k = top_k and p = top_p::

    t_k = the k-th largest value of x                     (every value when k >= vocab)
    q   = softmax of x over the values >= t_k
    t   = the largest value v >= t_k with  sum(q[x >= v]) >= p      (t_k when p >= 1)
    threshold = t:  keep x >= t                           (-inf where a row cuts nothing)

This is the sorted definition (sort descending, keep a token while the mass before it is below
p; the first token always stays) for distinct values; tied values at the cut-off all stay,
as ties at the k-th value always did.

Why not the sort: sorting a decode batch's rows (256 x 128,256 float32 with their indices) is a
segmented radix sort of 33 million pairs each step, plus some 15 launches around it for the
gather, the masks, the softmax, the cumulative sum and the scatter back. The kernel searches
each row's cut-off instead, over the float's ordered bit pattern: each pass over the row counts
the tokens (top-k) or sums their exponentials (top-p) at or above 16 pivots at once, so 8 passes
a filter find the cut-off exactly; with the maximum and top-p's sum, 18 passes over the row when
both filters are asked for (from the sizes: about 2.4 GB read for 256 rows of 128,256 tokens, the
order of the sort's own traffic; which is faster is for a GPU to say, ``gpu_check.py`` times both).
The torch version below (the sort) is the reference and the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def scale(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Each row of ``logits`` divided by its temperature (by 1 where it is 0: a greedy row)."""
    return logits / torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)


def threshold_reference(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """[rows] float32 cut-offs (on the scaled logits) from the sorted definition; ``top_k`` int
    [rows] (``vocab`` for none), ``top_p`` float32 [rows] (1.0 for none)."""
    scaled = scale(logits, temperature)
    ordered = torch.sort(scaled, dim=-1, descending=True).values
    kth = ordered.gather(1, (top_k.long() - 1).clamp(0, scaled.shape[1] - 1).unsqueeze(1))
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    mass = torch.softmax(ordered, dim=-1)
    keep = (mass.cumsum(-1) - mass) < top_p.unsqueeze(1)
    keep |= (top_p >= 1.0).unsqueeze(1)  # no top-p: the sums round to 1 before the tail ends
    keep &= ordered > float("-inf")
    keep[:, 0] = True
    last = keep.sum(dim=-1, keepdim=True) - 1  # the kept tokens are a prefix of the order
    cut = ordered.gather(1, last).squeeze(1)
    return cut.masked_fill((top_k >= scaled.shape[1]) & (top_p >= 1.0), float("-inf"))


@triton.jit
def _key(x):
    # float32 -> int32 in the same order: negative floats' magnitude bits flipped.
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _value(key):
    b = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _scaled(base, cols, vocab, t):
    # Divided as IEEE rounds (``div_rn``; Triton's ``/`` on float32 is the GPU's approximate
    # division), so the scaled logits are the torch reference's and the race kernel's, bit for bit.
    return tl.math.div_rn(tl.load(base + cols, mask=cols < vocab, other=float("-inf")), t)


# A search pass counts against WAYS pivots at once, cutting the key range into WAYS + 1 parts:
# 17**8 > 2**32, so 8 passes over the row find a key exactly (a halving a pass would take 32).
WAYS, PASSES = 16, 8
_WAYS: tl.constexpr = tl.constexpr(WAYS)
_PASSES: tl.constexpr = tl.constexpr(PASSES)


@triton.jit
def _largest_key(base, vocab, t, top, lo, hi, goal, BLOCK: tl.constexpr, MASS: tl.constexpr):
    # The largest key in [lo, hi] whose tokens at or above it reach ``goal``: in number, or (MASS)
    # in exp(x - top), their probability times the softmax's sum. Both fall as the key rises; keys
    # above hi are known to fall short. The count adds in float32, exact to 2**24 tokens.
    # The columns as a [BLOCK, 1] tensor, so a step's loads already sit in the tile's layout
    # (a 1-D load broadcast against the pivots went through shared memory every step).
    offs = tl.arange(0, BLOCK)[:, None]
    ways = tl.arange(0, _WAYS).to(tl.int64)
    for _ in range(_PASSES):
        step = (hi - lo) // (_WAYS + 1) + 1
        pivots = lo + (ways + 1) * step
        # int32 for the comparisons: a pivot past int32 is past every finite key, as 2**31 - 1 is.
        narrow = tl.minimum(pivots, 2**31 - 1).to(tl.int32)[None, :]
        tile = tl.zeros([BLOCK, _WAYS], tl.float32)  # summed across the program once a pass, not a step
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            x = _scaled(base, cols, vocab, t)
            w = tl.where(cols < vocab, tl.exp(x - top), 0.0) if MASS else (cols < vocab).to(tl.float32)
            tile += tl.where(_key(x) >= narrow, w, 0.0)
        enough = tl.sum(tile, axis=0) >= goal
        hi = tl.minimum(hi, tl.min(tl.where(enough, hi, pivots - 1), 0))  # below the first pivot short of it
        lo = tl.max(tl.where(enough, pivots, lo), 0)  # the last pivot that reaches it
    return lo


@triton.jit
def _top_k_top_p_kernel(
    x_ptr, temperature_ptr, top_k_ptr, top_p_ptr, out_ptr, vocab, stride, BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride
    t = tl.load(temperature_ptr + row)
    t = tl.where(t > 0, t, 1.0)
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        m = tl.maximum(m, _scaled(base, start + offs, vocab, t))
    top = tl.max(m, 0)
    # Every column's key is at least -inf's, the searches' floor: a row that cuts nothing gets -inf.
    cut = _key(tl.full([], float("-inf"), tl.float32)).to(tl.int64)
    if k < vocab:  # the largest key with k tokens at or above it: the k-th largest
        cut = _largest_key(base, vocab, t, top, cut, _key(top).to(tl.int64), k.to(tl.float32), SEARCH_BLOCK, False)
    if p < 1.0:  # then the largest key at or above that whose tokens' mass reaches p
        total = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            x = _scaled(base, start + offs, vocab, t)
            total += tl.where(_key(x).to(tl.int64) >= cut, tl.exp(x - top), 0.0)
        cut = _largest_key(base, vocab, t, top, cut, _key(top).to(tl.int64), p * tl.sum(total, 0), SEARCH_BLOCK, True)
    tl.store(out_ptr + row, _value(cut.to(tl.int32)))


def threshold(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, out: torch.Tensor
) -> None:
    """Write each row's cut-off (on its scaled logits) into ``out`` [rows] float32; ``logits``
    [rows, vocab] float32 with contiguous rows, ``temperature`` and ``top_p`` float32 and
    ``top_k`` int32 [rows]."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    block = min(2048, triton.next_power_of_2(vocab))
    search = min(256, block)  # a [search, WAYS] tile of comparisons a step
    _top_k_top_p_kernel[(rows,)](
        logits, temperature, top_k, top_p, out, vocab, logits.stride(0), BLOCK=block, SEARCH_BLOCK=search
    )
