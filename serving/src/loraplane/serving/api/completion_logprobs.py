"""A completion's log-probabilities in OpenAI's legacy shape (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``), streamed or not; with ``echo``, the prompt's entries first,
the first of them null (nothing predicts it), as OpenAI and vLLM give them. A choice's first
chunk carries the prompt's entries; the route says which chunk that is, as it does for the
prompt's text."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from loraplane.serving.api.json_logprob import finite
from loraplane.serving.api.streaming import Sent
from loraplane.serving.engine.outputs import RequestOutput
from loraplane.serving.engine.sequence import TokenLogprob


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
