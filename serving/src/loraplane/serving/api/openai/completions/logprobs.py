"""Log-probabilities in the shapes OpenAI and vLLM answer them: a completion's legacy shape
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``), chat's and the Responses
API's entries (each token with its bytes and top alternatives), and vLLM's ``prompt_logprobs``.

JSON has no -inf, and a token the request rules out (``allowed_token_ids``, an output format,
``min_tokens``) has a log-probability of -inf among the alternatives shown; Starlette refuses to
encode it (a 500) and a stream would send the invalid ``-Infinity``. vLLM sends such a value as
-9999.0, and so does every log-probability field here (``finite``).

vLLM's ``prompt_logprobs``: for each prompt token, a map from token id to its ``logprob``,
``rank`` and ``decoded_token``, the prompt's own token first and then the ``k`` most likely ones;
``null`` for the first token, which nothing predicts. Clients that score prompts through vLLM
(reward models' rollouts, perplexity checks, lm-evaluation-harness's vLLM backend) read it in
this shape: per choice on ``/v1/completions``, once per response on ``/v1/chat/completions``.

A completion's legacy shape, streamed or not: with ``echo``, the prompt's entries first, the first
of them null (nothing predicts it), as OpenAI and vLLM give them. A choice's first chunk carries
the prompt's entries; the route says which chunk that is, as it does for the prompt's text.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from loraplane.serving.api.openai.completions.streaming import Sent
from loraplane.serving.engine.async_engine import AsyncEngine
from loraplane.serving.engine.outputs import RequestOutput
from loraplane.serving.engine.sequence import TokenLogprob

LOWEST_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return LOWEST_LOGPROB if math.isnan(logprob) else max(logprob, LOWEST_LOGPROB)


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


def prompt_logprobs_field(engine: AsyncEngine, out: RequestOutput, k: int) -> list[Any]:
    """vLLM's ``prompt_logprobs`` field of an output, ``k`` alternatives per token, each token
    decoded to its text (whatever ``return_tokens_as_token_ids`` says, as vLLM's)."""
    assert out.prompt_logprobs is not None, "prompt_logprobs asks the engine for the prompt's entries"
    return prompt_logprobs_body(out.prompt_logprobs, k, engine.engine.tokenizer.token_text)


def token_namer(engine: AsyncEngine, as_ids: bool) -> Callable[[int], str]:
    """How log-probabilities name a token: its text, or with vLLM's ``return_tokens_as_token_ids``
    ``token_id:{id}``, which tells apart tokens whose text is the same (pieces of characters)."""
    return (lambda t: f"token_id:{t}") if as_ids else engine.engine.tokenizer.token_text


def token_entries(engine: AsyncEngine, as_ids: bool) -> Callable[[Sequence[TokenLogprob]], list[dict[str, Any]]]:
    """Chat's (and the Responses API's) log-probability entries: each token with its bytes and
    its top alternatives."""
    tok, shown = engine.engine.tokenizer, token_namer(engine, as_ids)

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": shown(token_id), "logprob": finite(logprob), "bytes": tok.token_bytes(token_id)}

    def entries(logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]

    return entries


class CompletionLogprobs:
    def __init__(self, name: Callable[[int], str], k: int, *, generated: bool) -> None:
        """``name``: how a token is shown (its text, or ``token_id:{id}``); ``k``: the request's
        ``logprobs``, the alternatives shown per token (the prompt's entries may hold more, when
        vLLM's ``prompt_logprobs`` asked for more); ``generated`` False leaves the generated
        tokens out (echo with ``max_tokens: 0``)."""
        self.name, self.k, self.generated = name, k, generated
        self.offset: dict[int, int] = defaultdict(int)  # where the next entry's text starts, per choice

    def of(self, index: int, out: RequestOutput, sent: Sent, *, with_prompt: bool) -> dict[str, Any]:
        """The entries of choice ``index`` its earlier chunks did not carry (``sent``), after the
        prompt's when ``with_prompt``, each token's ``text_offset`` counted, as vLLM's, over the
        texts of the tokens before it."""
        entries: list[tuple[int, TokenLogprob | None]] = []
        if with_prompt:
            assert out.prompt_logprobs is not None, "echo with logprobs asks the engine for the prompt's"
            entries += zip(out.prompt_token_ids, out.prompt_logprobs, strict=True)
        if self.generated:
            entries += [(lp.token_id, lp) for lp in out.logprobs[sent.logprobs :]]
        tokens = [self.name(t) for t, _ in entries]
        offsets = []
        for text in tokens:
            offsets.append(self.offset[index])
            self.offset[index] += len(text)
        return {
            "text_offset": offsets,
            "tokens": tokens,
            "token_logprobs": [None if lp is None else finite(lp.logprob) for _, lp in entries],
            # As vLLM: the chosen token is among its step's entries too, so logprobs=0 gives it alone.
            "top_logprobs": [
                None if lp is None else {**{self.name(t): finite(v) for t, v in lp.top[: self.k]}, text: finite(lp.logprob)}
                for (_, lp), text in zip(entries, tokens, strict=True)
            ],
        }
