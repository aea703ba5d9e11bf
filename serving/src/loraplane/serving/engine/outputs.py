"""What the engine reports of a request after each step: its tokens and text so far, why it
finished, and the adapter version that served it."""

from __future__ import annotations

from dataclasses import dataclass

from loraplane.serving.engine.sequence import PENDING, FinishReason, Sequence, TokenLogprob


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    adapter: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob]
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None
    adapter_version: str | None = None
    adapter_digest: str | None = None
    error_code: str | None = None


def output_of(seq: Sequence) -> RequestOutput:
    """What a request's caller sees so far: while it runs, its text without a tail that might yet
    turn out to be a stop string; without the placeholders of tokens still in flight (async
    scheduling), which the caller gets once they are read back."""
    tokens = seq.output_token_ids
    end = len(tokens)
    while end and tokens[end - 1] == PENDING:
        end -= 1
    text = seq.output_text if seq.is_finished or seq.detokenizer is None else seq.detokenizer.visible
    return RequestOutput(
        request_id=seq.request_id,
        adapter=seq.adapter,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=tokens[:end],
        text=text,
        finished=seq.is_finished,
        finish_reason=seq.finish_reason,
        logprobs=list(seq.logprobs),
        num_cached_tokens=seq.num_cached_tokens,
        prompt_logprobs=list(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None,
        error=seq.error,
        adapter_version=seq.adapter_version,
        adapter_digest=seq.adapter_digest,
        error_code=seq.error_code,
    )
