"""The response side of completions and chat: OpenAI's finish reasons and usage blocks, and the
server-sent events of a streamed request, whose last event carries the error a choice failed with
(a stream has already answered 200 by then) and, when asked, the usage chunk."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from loraplane.serving.api.metering import RequestMeter
from loraplane.serving.api.openai.completions.choices import Choices
from loraplane.serving.api.openai.completions.generation import Request, failure
from loraplane.serving.engine.outputs import RequestOutput
from loraplane.serving.engine.sequence import FinishReason
from loraplane.serving.http.cleanup_response import CleanupResponse
from loraplane.serving.http.errors import error_body
from loraplane.serving.http.protocol.common import PromptTokensDetails, Usage


@dataclass(frozen=True)
class Sent:
    """What a choice's earlier chunks carried: nothing (its next chunk is its first), or its
    output's first ``tokens`` token ids and ``logprobs`` log-probability entries. A plain
    answer is one chunk after nothing (``NOTHING_SENT``)."""

    first: bool = True
    tokens: int = 0
    logprobs: int = 0


NOTHING_SENT = Sent()
# (choice index, its output, new text, what its earlier chunks carried) -> the choice's part of a chunk
ChoiceEvent = Callable[[int, RequestOutput, str, Sent], dict[str, Any]]


def finish_reason(out: RequestOutput) -> str | None:
    if out.finish_reason is None:
        return None
    return "length" if out.finish_reason is FinishReason.LENGTH else "stop"


def usage(meter: RequestMeter) -> dict[str, Any]:
    """OpenAI's usage block, with the prompt tokens the prefix cache served as OpenAI reports them."""
    prompt_tokens, cached, completion_tokens = meter.tokens()
    total = prompt_tokens + completion_tokens
    details = PromptTokensDetails(cached_tokens=cached)
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=total, prompt_tokens_details=details
    ).model_dump()


def with_running_usage(req: Request, event: dict[str, Any], meter: RequestMeter) -> dict[str, Any]:
    """vLLM's ``continuous_usage_stats``: the usage so far on every streamed chunk."""
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        event["usage"] = usage(meter)
    return event


async def sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async for event in events:
        yield f"data: {json.dumps(event)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def streamed(
    req: Request,
    base: dict[str, Any],
    request: Choices,
    choice_event: ChoiceEvent,
    first: Callable[[RequestOutput], dict[str, Any]] | None = None,
) -> StreamingResponse:
    """The SSE response of a streamed request: one event per choice's delta, the stream's last
    event carrying the error a choice failed with, and the usage chunk when asked for. Each
    choice's event is told what its earlier chunks carried (``Sent``), kept here once for every
    field that streams by parts; ``first`` gives fields of each choice's first chunk beside its
    choice (chat's ``prompt_token_ids``, as vLLM's)."""

    async def events() -> AsyncIterator[dict[str, Any]]:
        sent: dict[int, Sent] = {}
        async for c, out, delta in request.deltas():
            if (err := failure(out)) is not None:
                request.close()  # the other choices end here too
                yield error_body(err.message, err.type, err.code)
                return
            before = sent.get(c.index, NOTHING_SENT)
            sent[c.index] = Sent(first=False, tokens=len(out.token_ids), logprobs=len(out.logprobs))
            head = first(out) if first is not None and before.first else {}
            event = {**base, **head, "choices": [choice_event(c.index, out, delta, before)]}
            yield with_running_usage(req, event, request.meter)
        if req.stream_options and req.stream_options.include_usage:
            yield {**base, "choices": [], "usage": usage(request.meter)}

    return CleanupResponse(sse(events()), request.close, media_type="text/event-stream")
