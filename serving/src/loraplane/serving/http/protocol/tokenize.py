"""vLLM's ``/tokenize`` and ``/detokenize`` bodies."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from loraplane.serving.http.protocol.chat import ChatTemplating
from loraplane.serving.http.protocol.common import ModelName, _Strict

TOKENIZE_CONTEXTS = 4  # the longest prompt /tokenize counts, in contexts (max_model_len)
TOKENIZE_MIN_TOKENS = 65536  # ... or this many, for a small context (about 0.3 s of tokenizer work here)


def tokenize_limit(context: int) -> int:
    """The most tokens one tokenizer call counts, at the replica and at the router's edge."""
    return max(TOKENIZE_CONTEXTS * context, TOKENIZE_MIN_TOKENS)


class TokenizeCompletionRequest(_Strict):
    model: ModelName
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplating):
    """A conversation as ``/v1/chat/completions`` would template it."""

    model: ModelName
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: ModelName
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokens_estimate(body: TokenizeCompletionRequest | TokenizeChatRequest | DetokenizeRequest, most: int) -> int:
    """What a tokenizer call reserves against the tenant's token quota before it runs, at most
    ``most``: a detokenize its ids, a text about one token per four characters. The replica and
    the router's edge reserve the same figure; the tokens counted replace it when the call ends."""
    if isinstance(body, DetokenizeRequest):
        return min(most, len(body.tokens))
    if isinstance(body, TokenizeChatRequest):
        return min(most, sum(len(m.text()) for m in body.messages) // 4)
    return min(most, len(body.prompt) // 4)
