"""vLLM's ``/tokenize`` and ``/detokenize`` bodies."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from loraplane.serving.http.protocol.chat import ChatTemplating
from loraplane.serving.http.protocol.common import ModelName, _Strict


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
