"""The edge's admission of one generation request before it is forwarded: the body checked as
strictly as the replicas check it, another tenant's adapter hidden, and the tenant's and the
adapter's quotas reserved with an estimate of the request's tokens. What the router refuses
itself it records as a usage refusal; what reaches a replica is recorded there, so nothing counts
twice."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from fastapi import Request, Response
from pydantic import ValidationError

from loraplane.serving.http.errors import APIError, invalid_request
from loraplane.serving.http.protocol.chat import ChatCompletionRequest
from loraplane.serving.http.protocol.common import new_id
from loraplane.serving.http.protocol.completions import DEFAULT_COMPLETION_TOKENS, CompletionRequest
from loraplane.serving.http.protocol.responses import ResponsesRequest
from loraplane.serving.http.protocol.tokenize import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    tokenize_limit,
    tokens_estimate,
)
from loraplane.serving.http.tenants import TenantConfig, Tenants
from loraplane.serving.router.state import RouterState

RESPONSES = "/v1/responses"
BODIES: dict[str, type[CompletionRequest] | type[ChatCompletionRequest] | type[ResponsesRequest]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    RESPONSES: ResponsesRequest,
}


def forwarded_headers(request: Request) -> dict[str, str]:
    headers = {"content-type": "application/json"}
    if "authorization" in request.headers:
        headers["authorization"] = request.headers["authorization"]
    return headers


async def relay(state: RouterState, request: Request, path: str) -> Response:
    """Admit and forward one request; a refusal is recorded, then raised as its APIError."""
    tenant = state.tenants.authenticate(request.headers.get("authorization"))  # an unknown key is nobody's to bill
    seen: dict[str, str | None] = {"adapter": None}
    try:
        return await _admitted(state, request, path, tenant, seen)
    except APIError as err:
        await state.meters.refuse(new_id("rtr"), err.status, source="router", tenant=tenant.name if tenant else None,
                                  model=seen["adapter"] or "", adapter=seen["adapter"], endpoint=path)  # fmt: skip
        raise


def _body(raw: bytes, path: str) -> tuple[dict[str, Any], CompletionRequest | ChatCompletionRequest]:
    try:
        payload = json.loads(raw)
    except ValueError:
        raise APIError(400, "the body is not valid JSON", code="invalid_request") from None
    if not isinstance(payload, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_request")
    try:  # as strictly as the replicas: a body they would refuse never counts against a quota
        request_model = BODIES[path].model_validate(payload)
    except ValidationError as err:
        raise invalid_request(err.errors()) from None
    payload["stream"] = request_model.stream  # what the replica will do (false when left out)
    if isinstance(request_model, ResponsesRequest):  # the chat completion it stands for
        return payload, request_model.chat()
    return payload, request_model


async def _replica_serves(state: RouterState, request: Request, model: str) -> bool:
    """For a name no replica's stats list (the base, or an adapter registered since the last
    read), the replica's own lookup decides, with the caller's key, as ``GET /v1/models/{model}``
    answers it. A replica that cannot answer decides nothing: the request goes on, and the
    forward reports what it finds."""
    r = await state.forward().ask_any(f"/v1/models/{quote(model, safe='')}", forwarded_headers(request))
    return r is None or r.status_code != 404


def estimate_tokens(request_model: CompletionRequest | ChatCompletionRequest, context: int, going_on: bool = False) -> int:
    """The most a request may use, without tokenising: the prompt at about four characters a
    token (as OpenAI estimates for its own limits) and the completion tokens the body allows for
    every choice. A chat without ``max_tokens`` may write up to the context (``context``: the
    replicas' ``max_model_len``), a completion OpenAI's default of 16; a Responses call going on
    from a stored response (``going_on``) carries a conversation the router cannot see, so each
    choice counts the whole context. The replica counts exactly and may refuse what the edge let
    through (it then records the refusal itself, once)."""
    if isinstance(request_model, CompletionRequest):
        prompts = request_model.prompts()
    else:  # one prompt: the conversation
        prompts = [" ".join(m.text() for m in request_model.messages)]
    prompt = sum(len(p) if isinstance(p, list) else len(p) // 4 for p in prompts)
    choices = request_model.n * len(prompts)
    if going_on:
        return context * choices
    limit = getattr(request_model, "max_completion_tokens", None) or request_model.max_tokens
    if limit is None:
        limit = DEFAULT_COMPLETION_TOKENS if isinstance(request_model, CompletionRequest) else max(1, context - prompt)
    return prompt + limit * choices


async def _admitted(
    state: RouterState, request: Request, path: str, tenant: TenantConfig | None, seen: dict[str, str | None]
) -> Response:
    """Forward a request the edge admits; raises the APIError of one it refuses (``seen``
    gets the model it named, for the refusal's record)."""
    payload, request_model = _body(await request.body(), path)
    adapter = seen["adapter"] = request_model.model
    listed, owner = state.table.owner(adapter)
    # Before any quota can tell a missing name from another tenant's adapter, both answer 404.
    if (listed and not Tenants.may_use(tenant, owner)) or (not listed and not await _replica_serves(state, request, adapter)):
        raise APIError(404, f"The model `{adapter}` does not exist.", code="model_not_found", param="model")
    going_on = payload.get("previous_response_id") if path == RESPONSES else None  # validated: a string or null
    estimate = estimate_tokens(request_model, state.table.max_model_len, going_on is not None)
    reservation = state.tenants.admit(tenant, adapter, estimate)

    def done(usage: dict[str, Any] | None, tenant: TenantConfig | None = tenant) -> None:
        usage = usage or {}  # the Responses API names the counts input and output tokens
        prompt_tokens = usage.get("prompt_tokens", usage.get("input_tokens", 0))
        completion_tokens = usage.get("completion_tokens", usage.get("output_tokens", 0))
        state.tenants.finish(tenant, {"adapter": adapter, "prompt_tokens": prompt_tokens,
                                      "completion_tokens": completion_tokens}, reservation)  # fmt: skip

    headers = forwarded_headers(request)
    try:
        home = await state.forward().home_of(going_on, headers) if going_on is not None else None
        return await state.forward().post(path, payload, headers, done, ask_usage=path != RESPONSES, prefer=home)
    except BaseException:  # refused, or cancelled (the client went away) before an answer began
        done(None)  # the reservation goes back; an answer under way calls done itself, once
        raise


TOKENIZER_BODIES = {"/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest), "/detokenize": (DetokenizeRequest,)}


async def tokenizer_call(state: RouterState, request: Request, path: str) -> Response:
    """vLLM's ``/tokenize`` or ``/detokenize`` through the edge: the body checked, another
    tenant's adapter hidden, the tenant's and the adapter's quotas held for the call with an
    estimate of its tokens (what it counted is what counts when it ends), then any replica up
    answers. Tokenising is a replica's CPU time like a prompt's: without this a tenant over its
    quota could still keep replicas busy."""
    tenant = state.tenants.authenticate(request.headers.get("authorization"))
    raw = await request.body()
    try:
        payload = json.loads(raw)
    except ValueError:
        raise APIError(400, "the body is not valid JSON", code="invalid_request") from None
    body: TokenizeCompletionRequest | TokenizeChatRequest | DetokenizeRequest | None = None
    errors: list[Any] = []
    for model in TOKENIZER_BODIES[path]:  # as the replica's route takes its union: the first that fits
        try:
            body = model.model_validate(payload)
            break
        except ValidationError as err:
            errors += err.errors()
    if body is None:
        raise invalid_request(errors)
    listed, owner = state.table.owner(body.model)
    if (listed and not Tenants.may_use(tenant, owner)) or (not listed and not await _replica_serves(state, request, body.model)):
        raise APIError(404, f"The model `{body.model}` does not exist.", code="model_not_found", param="model")
    estimate = tokens_estimate(body, tokenize_limit(state.table.max_model_len))
    adapter = body.model if listed else None
    reservation = state.tenants.admit(tenant, adapter, estimate)
    counted = 0
    try:
        r = await state.forward().ask_any(path, forwarded_headers(request), raw)
        if r is None:
            raise APIError(503, "no serving replica is up", type_="server_error", code="no_replica", retry_after=1)
        if r.status_code == 200:
            counted = estimate if isinstance(body, DetokenizeRequest) else int(r.json().get("count", 0))
        return Response(r.content, status_code=r.status_code, media_type="application/json")
    finally:
        state.tenants.finish(tenant, {"adapter": adapter, "prompt_tokens": counted}, reservation)
