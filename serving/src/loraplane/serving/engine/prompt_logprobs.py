"""vLLM's ``prompt_logprobs``: each prompt token's log-probability given the tokens before it.

What OpenAI's ``echo`` with ``logprobs`` returns, and what evaluation harnesses score a model by
(lm-evaluation-harness's log-likelihood tasks send exactly that, with ``max_tokens: 0``). The
forward pass computes every prompt position's hidden state anyway; the row at position ``i``
predicts token ``i + 1``, so a sequence that asks keeps the log-softmax of its chunk's rows. Only
positions computed in a step have rows: a sequence that asks is never given cached prefix blocks
(``BlockManager``), and a chunked prompt fills its entries chunk by chunk. The model's raw
distribution, before any sampling setting, as vLLM's; each entry also carries the token's rank in
it, which vLLM's own ``prompt_logprobs`` response field shows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loraplane.serving.engine import transfers
from loraplane.serving.engine.sequence import Sequence, TokenLogprob

# Rows turned into logits at once: a chunk of thousands of rows times a large vocabulary would
# otherwise hold gigabytes of logits.
ROWS_PER_SLICE = 256


def record(items: list[tuple[Sequence, int]], hidden: torch.Tensor, logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Fill the entries of this step's prompt rows for the sequences that ask; ``hidden`` holds
    the step's rows in ``items`` order, ``logits`` is the model's head."""
    start = 0
    for seq, n in items:
        first, k = seq.num_computed_tokens, seq.params.prompt_logprobs
        # Rows first .. end-1 predict prompt tokens first+1 .. end; the last prompt position
        # predicts the first generated token, which sampling reports.
        end = min(first + n, len(seq.prompt_token_ids) - 1)
        if k is not None and seq.prompt_logprobs is not None:
            for a in range(first, end, ROWS_PER_SLICE):
                b = min(a + ROWS_PER_SLICE, end)
                _slice(seq, a, b, logits(hidden[start + a - first : start + b - first]), k)
        start += n


def _slice(seq: Sequence, a: int, b: int, logits: torch.Tensor, k: int) -> None:
    lp = torch.log_softmax(logits.float(), dim=-1)
    targets = seq.prompt_token_ids[a + 1 : b + 1]
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device).unsqueeze(1))
    ranks = transfers.to_host((lp > chosen).sum(dim=1) + 1).tolist()
    top = torch.topk(lp, k) if k else None
    values = transfers.to_host(chosen.squeeze(1)).tolist()
    alts_ids = transfers.to_host(top.indices).tolist() if top is not None else [[] for _ in targets]
    alts_vals = transfers.to_host(top.values).tolist() if top is not None else [[] for _ in targets]
    assert seq.prompt_logprobs is not None
    for j, token in enumerate(targets):
        alts = tuple(zip(alts_ids[j], alts_vals[j], strict=True))
        seq.prompt_logprobs[a + 1 + j] = TokenLogprob(token, values[j], alts, rank=ranks[j])
