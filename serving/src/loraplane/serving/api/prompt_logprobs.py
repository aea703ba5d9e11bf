"""vLLM's ``prompt_logprobs`` response field: for each prompt token, a map from token id to its
``logprob``, ``rank`` and ``decoded_token``, the prompt's own token first and then the ``k`` most
likely ones; ``null`` for the first token, which nothing predicts. Clients that score prompts
through vLLM (reward models' rollouts, perplexity checks, lm-evaluation-harness's vLLM backend)
read it in this shape: per choice on ``/v1/completions``, once per response on
``/v1/chat/completions``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loraplane.serving.api.json_logprob import finite
from loraplane.serving.engine.sequence import TokenLogprob


def prompt_logprobs_body(
    entries: list[TokenLogprob | None], k: int, text: Callable[[int], str]
) -> list[dict[str, dict[str, Any]] | None]:
    """The field for one prompt's ``entries`` (the engine's, which may hold more alternatives
    than ``k`` when ``echo`` asked for more); ``text`` decodes one token."""

    def one(token: int, logprob: float, rank: int | None) -> tuple[str, dict[str, Any]]:
        return str(token), {"logprob": finite(logprob), "rank": rank, "decoded_token": text(token)}

    body: list[dict[str, dict[str, Any]] | None] = []
    for lp in entries:
        if lp is None:
            body.append(None)
            continue
        # The prompt's token first; when it is also among the top k, its one entry stays first.
        ranked = dict([one(lp.token_id, lp.logprob, lp.rank)])
        for rank, (token, logprob) in enumerate(lp.top[:k], start=1):
            ranked.setdefault(*one(token, logprob, rank))
        body.append(ranked)
    return body
