"""OpenAI's and vLLM's per-request logit adjustments, applied to the whole batch at once.

Each is one tensor operation over the rows that ask for any, with per-row coefficients as
columns, so a batch of many penalised requests costs a few kernels rather than a Python loop of
small ones per sequence:

- ``frequency_penalty`` and ``presence_penalty`` (OpenAI): minus the coefficient times the
  token's count in the output so far, and minus the coefficient once the token has appeared.
- ``repetition_penalty`` (vLLM, from the CTRL paper): a token seen in the prompt or the output
  has its logit divided by the penalty when positive, multiplied when negative.
- ``logit_bias`` (OpenAI): added to the named tokens' logits.
- ``allowed_token_ids`` (vLLM): every other token is impossible.
- ``bad_words`` (vLLM): a word's last token is impossible wherever the output so far ends with
  the word's other tokens (a one-token word is never drawn). Only the output is read, as vLLM
  reads it, so a word begun in the prompt is not caught.
- ``min_tokens`` (vLLM): end-of-sequence (unless ``ignore_eos``) and the request's stop tokens are
  impossible until that many tokens are generated.

Repetition comes before frequency and presence, as in vLLM, so a request combining them gets
vLLM's numbers.

Token ids in biases and allowed lists are checked against the vocabulary when the request is
added, so nothing here depends on one request's input being valid.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from loraplane.serving.engine import transfers
from loraplane.serving.engine.sequence import Sequence


def _padded(rows: list[list[int]], pad: int) -> np.ndarray:
    width = max(1, max(len(r) for r in rows))
    out = np.full((len(rows), width), pad, dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _occurrences(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] counts of each token id per row of ``ids`` (the pad id, ``vocab``, lands in a
    dropped column)."""
    ids = ids.long()
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def _ends_with(tokens: list[int], tail: tuple[int, ...]) -> bool:
    return not tail or (len(tokens) >= len(tail) and tuple(tokens[-len(tail) :]) == tail)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], eos_ids: Iterable[int]) -> torch.Tensor:
    """``logits`` [len(seqs), vocab] adjusted in place for the sequences whose requests ask for it,
    on whatever device ``logits`` is: what the rows need (their token ids, coefficients, biases
    and masks, gathered from host state here) goes over in one ``transfers.to_device`` copy."""
    rows = [i for i, s in enumerate(seqs) if s.params.penalised]
    if not rows:
        return logits
    group = [seqs[i] for i in rows]
    vocab = logits.shape[1]
    params = [s.params for s in group]
    counted = any(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0 for p in params)
    repeated = any(p.repetition_penalty != 1.0 for p in params)
    biased = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias]
    limited = [(r, t) for r, p in enumerate(params) for t in p.allowed_token_ids]
    eos = tuple(eos_ids)
    banned = [
        (r, t)
        for r, (s, p) in enumerate(zip(group, params, strict=True))
        if len(s.output_token_ids) < p.min_tokens
        for t in (*(() if p.ignore_eos else eos), *p.stop_token_ids)
        if t < vocab
    ]
    banned += [
        (r, word[-1])
        for r, s in enumerate(group)
        for word in s.params.bad_words_token_ids
        if _ends_with(s.output_token_ids, word[:-1]) and word[-1] < vocab
    ]
    arrays: list[tuple[Any, tuple[int, ...]]] = [(rows, (len(rows),))]
    if counted:
        output = _padded([s.output_token_ids for s in group], vocab)
        coefficients = [
            *(p.repetition_penalty for p in params),
            *(p.frequency_penalty for p in params),
            *(p.presence_penalty for p in params),
        ]
        arrays += [(output, output.shape), (transfers.float_bits(coefficients), (3, len(group)))]
    if repeated:
        prompt = _padded([s.prompt_token_ids for s in group], vocab)
        arrays.append((prompt, prompt.shape))
    for pairs in (biased, limited, banned):
        if pairs:
            arrays.append(([v for pair in pairs for v in pair[:2]], (len(pairs), 2)))
    if biased:
        arrays.append((transfers.float_bits([b for _, _, b in biased]), (len(biased),)))
    parts = iter(transfers.to_device(arrays, logits.device))
    index = next(parts).long()
    x = logits.index_select(0, index).float()
    if counted:
        counts = _occurrences(next(parts), vocab)
        repetition, frequency, presence = next(parts).view(torch.float32).unsqueeze(2)
        if repeated:  # first, as vLLM orders them
            seen = (counts > 0) | (_occurrences(next(parts), vocab) > 0)
            x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        x -= frequency * counts
        x -= presence * (counts > 0)
    bias_at = next(parts).long() if biased else None
    allowed_at = next(parts).long() if limited else None
    banned_at = next(parts).long() if banned else None
    if bias_at is not None:
        x.index_put_((bias_at[:, 0], bias_at[:, 1]), next(parts).view(torch.float32), accumulate=True)
    if allowed_at is not None:
        allowed = torch.ones_like(x, dtype=torch.bool)  # rows without a list keep every token
        allowed[allowed_at[:, 0]] = False
        allowed[allowed_at[:, 0], allowed_at[:, 1]] = True
        x = x.masked_fill(~allowed, float("-inf"))
    if banned_at is not None:
        x[banned_at[:, 0], banned_at[:, 1]] = float("-inf")
    logits.index_copy_(0, index, x.to(logits.dtype))
    return logits
