"""vLLM's ``/tokenize`` and ``/detokenize``: the base's tokenizer (adapters share it) and the chat
template as the completion routes apply them, so a client can count a prompt's tokens against
``max_model_len`` before sending it. A tenant names a model it may use, as on the OpenAI routes."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from loraplane.serving.api.deps import Caller, Engine
from loraplane.serving.api.openai.completions.generation import templated
from loraplane.serving.api.openai.models_routes import resolve_model
from loraplane.serving.http.errors import APIError
from loraplane.serving.http.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

router = APIRouter()


@router.post("/tokenize")
async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest, engine: Engine, tenant: Caller) -> TokenizeResponse:
    resolve_model(engine, req.model, tenant)
    tok = engine.engine.tokenizer
    if isinstance(req, TokenizeChatRequest):
        ids = await templated(engine, req)
    else:
        ids = await asyncio.to_thread(tok.encode, req.prompt, add_special_tokens=req.add_special_tokens)
    strs = [tok.token_piece(t) for t in ids] if req.return_token_strs else None  # as vLLM: vocabulary pieces
    return TokenizeResponse(count=len(ids), max_model_len=engine.engine.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, engine: Engine, tenant: Caller) -> DetokenizeResponse:
    resolve_model(engine, req.model, tenant)
    vocab = engine.engine.base.config.vocab_size
    if any(t >= vocab for t in req.tokens):
        raise APIError(400, f"tokens: token ids must be in [0, {vocab})", param="tokens")
    tok = engine.engine.tokenizer
    return DetokenizeResponse(prompt=await asyncio.to_thread(tok.decode, req.tokens, skip_special_tokens=False))
