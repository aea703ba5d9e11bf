"""Temperature, top-k, top-p and min-p sampling (and log-probabilities) for a whole batch on the
device, so only the sampled token ids cross back, not a vocabulary-wide row per sequence.

Penalties, biases and token masks (``penalties.apply_penalties``) and a grammar's bitmask
(``structured.mask_guided``) are applied on the device first, on the same rows. What stays on the
host: rows with logits processors (Python callables over a row), which ``Sampler`` samples there.

The filters are the host path's, step for step (``Sampler._draw``): temperature, top-k by value
(ties at the k-th logit stay), top-p over what top-k left (the first token always stays), then
min-p on the probabilities. Top-k and top-p come to one cut-off value a row, only when a row asks
for either (``kernels.top_k_top_p``: a search per row on a GPU, no sort; the sort on the CPU).
The draw is the exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)`` per token picks token
``i`` with probability ``p_i``, with no cumulative sum (vLLM's sampler draws the same way); one
kernel (``kernels.race``) runs it with the filters, the greedy rows' argmax and the checks for
rows with no token to give.

Seeds: a request's ``seed`` must give the same tokens whatever else shares its batch. A device
generator per request would cost a kernel per seeded row each step; instead a seeded row's noise
is a counter-based hash of (seed, output position, token id), written for all the seeded rows by
one kernel on a GPU (``kernels.seeded_noise``; its torch reference on the CPU). Unseeded rows take
one ``exponential_`` from the device's generator.

The step's per-row parameters travel in one host-to-device copy (``transfers.to_device``, int32:
the floats as their bit patterns), and the result in one read-back (``transfers.to_host``): the
token ids, or, when a row asked for log-probabilities, ids and figures packed in one float64
tensor (exact for ids below 2**53).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loraplane.kernels import ops  # noqa: F401  (registers torch.ops.loraplane.*)
from loraplane.kernels.race import NONE_ALLOWED, NOT_FINITE  # what a row's token id says when it has none
from loraplane.serving.engine import transfers
from loraplane.serving.engine.sequence import Sequence, TokenLogprob
from loraplane.serving.host_side import host_side

__all__ = ["NONE_ALLOWED", "NOT_FINITE", "Drawn", "choose", "deferrable", "draw", "on_device"]


def on_device(seq: Sequence) -> bool:
    """Whether this row can be sampled on the device (no Python callable touches its logits)."""
    return not seq.params.logits_processors


def deferrable(seq: Sequence) -> bool:
    """Whether this row's token may stay on the device until after the next step is launched
    (async scheduling): sampled on the device from its logits, a ``logit_bias`` and an
    ``allowed_token_ids`` list included. Not so for penalties, bad words and ``min_tokens`` (they
    read the output so far, whose last token would still be in flight), a grammar (its matcher
    must see each token before masking the next), log-probabilities (read back with the token) or
    prompt log-probabilities (read back from the prompt's rows)."""
    p = seq.params
    return on_device(seq) and not p.reads_output and p.guide is None and p.logprobs is None and p.prompt_logprobs is None


@dataclass(frozen=True)
class Drawn:
    """One row's result: its token, and its log-probabilities when it asked for them; ``token``
    is ``NOT_FINITE`` when its logits held a NaN or +inf, ``NONE_ALLOWED`` when its masks ruled
    out every token (that row alone fails)."""

    token: int
    logprob: TokenLogprob | None


def choose(
    logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator | None = None, backend: str = "auto"
) -> torch.Tensor:
    """Each row's token id, on the device (``NOT_FINITE`` or ``NONE_ALLOWED`` where it has none):
    :func:`draw` without the read-back, which async scheduling feeds to the next step first.
    ``backend`` runs the sampler's kernels (``kernels.ops``: "auto" is Triton on a GPU): the
    top-k/top-p cut-off, the seeded rows' noise and the race, each a launch for the whole batch."""
    n, vocab = logits.shape
    params = [s.params for s in seqs]
    greedy = [p.greedy for p in params]
    seeded = [i for i, (p, g) in enumerate(zip(params, greedy, strict=True)) if not g and p.seed is not None]
    seeds = np.asarray([params[i].seed or 0 for i in seeded], dtype=np.uint64)  # below 2**64 (SEED_RANGE)
    columns: list[tuple[np.ndarray | list[int], tuple[int, ...]]] = [
        (transfers.float_bits([0.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]), (n,)),
        # A greedy row's filters are not searched for: no top-k (vocab), no top-p (1.0).
        ([p.top_k if not g and 0 < p.top_k < vocab else vocab for p, g in zip(params, greedy, strict=True)], (n,)),
        (transfers.float_bits([1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]), (n,)),
        (transfers.float_bits([p.min_p for p in params]), (n,)),
    ]
    if seeded:  # the seeded rows, their seeds' two halves and their output positions
        columns += [
            (seeded, (len(seeded),)),
            (seeds.astype(np.uint32).view(np.int32), (len(seeded),)),  # the low word
            ((seeds >> np.uint64(32)).astype(np.uint32).view(np.int32), (len(seeded),)),
            ([len(seqs[i].output_token_ids) for i in seeded], (len(seeded),)),
        ]
    temp_i, top_k, top_p_i, min_p_i, *seeded_columns = transfers.to_device(columns, logits.device)
    temperature, top_p, min_p = temp_i.view(torch.float32), top_p_i.view(torch.float32), min_p_i.view(torch.float32)
    x = logits.float().contiguous()
    cut = noise = None
    if not all(greedy):
        if any(not g and (0 < p.top_k < vocab or p.top_p < 1.0) for p, g in zip(params, greedy, strict=True)):
            cut = torch.empty(n, dtype=torch.float32, device=x.device)
            torch.ops.loraplane.top_k_top_p_threshold(x, temperature, top_k, top_p, cut, backend)
        noise = torch.empty_like(x).exponential_(generator=generator)
        if seeded:
            torch.ops.loraplane.seeded_noise(noise, *seeded_columns, backend)
    token = torch.empty(n, dtype=torch.long, device=x.device)
    torch.ops.loraplane.race(x, temperature, cut, min_p, noise, token, backend)
    return token


def draw(
    logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator | None = None, backend: str = "auto"
) -> list[Drawn]:
    """Sample every row of ``logits`` [len(seqs), vocab] (float32, on any device) for its
    sequence, all of which satisfy :func:`on_device`. Unseeded rows draw from ``generator`` (a
    generator on the logits' device; the device's default when None)."""
    token = choose(logits, seqs, generator, backend)
    x = logits.float()
    wanted = [s.params.logprobs for s in seqs]
    if all(k is None for k in wanted):
        back = transfers.to_host(token)
        with host_side():
            ids = back.tolist()
        return [Drawn(t, None) for t in ids]
    k = max(w or 0 for w in wanted)
    lp = torch.log_softmax(x, dim=-1)  # before temperature and the filters, as the host path
    chosen = lp.gather(1, token.clamp(min=0).unsqueeze(1))
    top = torch.topk(lp, k, dim=-1) if k else None
    parts = [token.double().unsqueeze(1), chosen.double()]
    if top is not None:
        parts += [top.values.double(), top.indices.double()]
    back = transfers.to_host(torch.cat(parts, dim=1))
    with host_side():
        packed = back.tolist()
    out = []
    for row, w in zip(packed, wanted, strict=True):
        t = int(row[0])
        if t < 0:
            out.append(Drawn(t, None))
            continue
        alts = tuple(zip((int(i) for i in row[2 + k : 2 + k + (w or 0)]), row[2 : 2 + (w or 0)], strict=True))
        out.append(Drawn(t, TokenLogprob(t, row[1], alts) if w is not None else None))
    return out
