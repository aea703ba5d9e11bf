"""vLLM's ``/tokenize`` and ``/detokenize``: the base's tokenizer (adapters share it) and the chat
template as the completion routes apply them, so a client can count a prompt's tokens against
``max_model_len`` before sending it. A tenant names a model it may use (the base or one of its
adapters' served names, as vLLM takes them), as on the OpenAI routes.

Tokenising is work on this replica's CPU, bounded as a generation's prompt is. A prompt may run
past the context, as vLLM counts it (a client learns by how much), but not past
``TOKENIZE_CONTEXTS`` contexts (or ``TOKENIZE_MIN_TOKENS`` for a small one): beyond, a 400
before most of it is encoded (three 7 MiB prompts took 17.5 s of tokenizer work before). Each
call counts as a request against the server's pending bound and the tenant's and the adapter's
quotas (concurrency, and its tokens against a tokens-per-minute quota). It is not billed: no
usage record is written."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import APIRouter

from loraplane.serving.api.deps import Caller, Engine, Server, ServerState
from loraplane.serving.api.openai.completions.generation import templated
from loraplane.serving.api.openai.models_routes import resolve_model
from loraplane.serving.http.errors import APIError
from loraplane.serving.http.protocol.tokenize import (
    TOKENIZE_CONTEXTS,
    TOKENIZE_MIN_TOKENS,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    tokenize_limit,
    tokens_estimate,
)
from loraplane.serving.http.tenants import TenantConfig
from loraplane.serving.tokenizer import PromptTooLong

router = APIRouter()


def _too_long(limit: int, context: int, param: str) -> APIError:
    return APIError(400, f"{param}: more than {limit} tokens; /tokenize counts at most {TOKENIZE_CONTEXTS} times this "
                    f"model's context of {context} tokens, or {TOKENIZE_MIN_TOKENS}", param=param,
                    code="context_length_exceeded")  # fmt: skip


@contextlib.asynccontextmanager
async def admitted(server: ServerState, tenant: TenantConfig | None, adapter: str | None, most: int) -> AsyncIterator[list[int]]:
    """One tokenizer call admitted as a request is: the pending bound, then the quotas, with
    ``most`` tokens reserved (``tokens_estimate``, as the router's edge reserves); yields a list
    to put the tokens it counted in, which count in the quota windows when it ends."""
    who = tenant.name if tenant is not None else None
    if not server.pending.admit(who, 1):
        raise APIError(503, "the server is at capacity; retry shortly", type_="server_error", code="overloaded", retry_after=1)
    counted: list[int] = []
    try:
        reservation = server.tenants.admit(tenant, adapter, most)
        try:
            yield counted
        finally:
            server.tenants.finish(tenant, {"adapter": adapter, "prompt_tokens": sum(counted)}, reservation)
    finally:
        server.pending.release(who, 1)


@router.post("/tokenize")
async def tokenize(
    req: TokenizeCompletionRequest | TokenizeChatRequest, engine: Engine, tenant: Caller, server: Server
) -> TokenizeResponse:
    adapter = resolve_model(engine, req.model, tenant)
    tok, context = engine.engine.tokenizer, engine.engine.max_model_len
    limit = tokenize_limit(context)
    async with admitted(server, tenant, adapter, tokens_estimate(req, limit)) as counted:
        if isinstance(req, TokenizeChatRequest):
            try:
                ids = await templated(engine, req, limit=limit)
            except APIError as err:
                if err.code != "context_length_exceeded":
                    raise
                raise _too_long(limit, context, "messages") from None
        else:
            try:
                ids = await asyncio.to_thread(tok.encode_within, req.prompt, limit, add_special_tokens=req.add_special_tokens)
            except PromptTooLong:
                raise _too_long(limit, context, "prompt") from None
        counted.append(len(ids))
    strs = [tok.token_piece(t) for t in ids] if req.return_token_strs else None  # as vLLM: vocabulary pieces
    return TokenizeResponse(count=len(ids), max_model_len=context, tokens=ids, token_strs=strs)


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, engine: Engine, tenant: Caller, server: Server) -> DetokenizeResponse:
    adapter = resolve_model(engine, req.model, tenant)
    vocab, context = engine.engine.base.config.vocab_size, engine.engine.max_model_len
    limit = tokenize_limit(context)
    if any(t >= vocab for t in req.tokens):
        raise APIError(400, f"tokens: token ids must be in [0, {vocab})", param="tokens")
    if len(req.tokens) > limit:
        raise _too_long(limit, context, "tokens")
    tok = engine.engine.tokenizer
    async with admitted(server, tenant, adapter, tokens_estimate(req, limit)) as counted:
        counted.append(len(req.tokens))
        return DetokenizeResponse(prompt=await asyncio.to_thread(tok.decode, req.tokens, skip_special_tokens=False))
