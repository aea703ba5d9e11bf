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

import torch

from loraplane.serving.engine.sequence import Sequence


def _padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)


def _occurrences(rows: list[list[int]], vocab: int) -> torch.Tensor:
    """[len(rows), vocab] counts of each token id per row (the pad id lands in a dropped column)."""
    ids = _padded(rows, vocab)
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.float32)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def _ends_with(tokens: list[int], tail: tuple[int, ...]) -> bool:
    return not tail or (len(tokens) >= len(tail) and tuple(tokens[-len(tail) :]) == tail)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], eos_ids: Iterable[int]) -> torch.Tensor:
    """``logits`` [len(seqs), vocab] adjusted in place for the sequences whose requests ask for it."""
    rows = [i for i, s in enumerate(seqs) if s.params.penalised]
    if not rows:
        return logits
    group = [seqs[i] for i in rows]
    index = torch.tensor(rows, dtype=torch.long)
    x = logits.index_select(0, index).float()
    vocab = x.shape[1]
    params = [s.params for s in group]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32).unsqueeze(1)

    if any(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0 for p in params):
        counts = _occurrences([s.output_token_ids for s in group], vocab)
        if any(p.repetition_penalty != 1.0 for p in params):  # first, as vLLM orders them
            seen = (counts > 0) | (_occurrences([s.prompt_token_ids for s in group], vocab) > 0)
            penalty = column([p.repetition_penalty for p in params])
            x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
        x -= column([p.frequency_penalty for p in params]) * counts
        x -= column([p.presence_penalty for p in params]) * (counts > 0)
    biased = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias]
    if biased:
        r, t, b = zip(*biased, strict=True)
        x.index_put_((torch.tensor(r), torch.tensor(t)), torch.tensor(b, dtype=torch.float32), accumulate=True)
    limited = [(r, t) for r, p in enumerate(params) for t in p.allowed_token_ids]
    if limited:
        r, t = zip(*limited, strict=True)
        allowed = torch.ones_like(x, dtype=torch.bool)  # rows without a list keep every token
        allowed[sorted(set(r))] = False
        allowed[torch.tensor(r), torch.tensor(t)] = True
        x = x.masked_fill(~allowed, float("-inf"))
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
    if banned:
        r, t = zip(*banned, strict=True)
        x[torch.tensor(r), torch.tensor(t)] = float("-inf")
    logits.index_copy_(0, index, x.to(logits.dtype))
    return logits
