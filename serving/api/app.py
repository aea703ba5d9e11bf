"""The FastAPI application: OpenAI-compatible completions and chat, model listing, vLLM's LoRA
load/unload calls, admin calls for the adapter tiers, Prometheus metrics and health checks.

The engine loads in the background at startup; ``/health`` answers at once (liveness) and
``/ready`` only once the base model is in memory (readiness), so Kubernetes neither kills a pod
that is still converting its base nor routes requests to it early.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from loraplane.serving.api.admin_routes import router as admin_router
from loraplane.serving.api.async_engine import AsyncEngine
from loraplane.serving.api.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from loraplane.serving.api.choices import Choice, Choices, CleanupResponse
from loraplane.serving.api.deps import Caller, Engine, ServerState
from loraplane.serving.api.errors import APIError, api_error_handler, error_body, require_admin, validation_error_handler
from loraplane.serving.api.metering import RequestMeter
from loraplane.serving.api.metrics_port import view as metrics_view
from loraplane.serving.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    Usage,
    new_id,
    now,
)
from loraplane.serving.api.tenants import TenantConfig, Tenants
from loraplane.serving.api.usage_metrics import UsageCollector
from loraplane.serving.engine.llm_engine import LLMEngine, RequestError, RequestOutput
from loraplane.serving.engine.sampling_params import SamplingError, SamplingParams
from loraplane.serving.engine.sequence import FinishReason
from loraplane.serving.engine.structured import GrammarError, Guide
from loraplane.serving.lora.manager import AdapterNotFound, AdapterUnavailable
from loraplane.serving.tokenizer import PromptTooLong
from loraplane.usage import Metering

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


def create_app(
    make_engine: Callable[[], LLMEngine],
    *,
    admin_token: str | None = None,
    tenants: Tenants | None = None,
    max_pending_requests: int = 256,
    metering: Metering | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """``max_pending_requests`` bounds the requests queued or running in the engine; beyond it the
    server sheds load with 503 and ``Retry-After`` instead of queueing without bound, from the
    tenants over their share of it first (see ``load_shedding``). ``metering``
    receives one usage record per request (by default they are only counted, not spooled)."""
    state = ServerState(make_engine, admin_token, max_pending_requests)
    tenants = tenants or Tenants(None)
    meters = metering or Metering("local")

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        state.start()
        yield
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)
        await asyncio.to_thread(meters.close)  # after the last request's record

    app = FastAPI(title="loraplane", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.state.server = state
    app.state.tenants = tenants
    app.state.metering = meters

    # health -----------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> dict[str, str]:
        state.ready()
        return {"status": "ready"}

    usage_registry = CollectorRegistry()
    usage_registry.register(UsageCollector(meters))
    # What `loraplane serve --metrics-port` serves too (see metrics_port).
    app.state.metrics = metrics_view(
        lambda: [usage_registry] if state.engine is None else [state.engine.engine.metrics.registry, usage_registry]
    )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Open on an open server, as vLLM's; with tenants the series would show every tenant's
        adapters to any of them, so only the admin token reads them here (Prometheus scrapes the
        metrics port)."""
        if not tenants.open:
            require_admin(request.headers.get("authorization"), state.admin_token)
        return Response(generate_latest(app.state.metrics), media_type=CONTENT_TYPE_LATEST)

    # models -----------------------------------------------------------------------------------
    def visible(engine: AsyncEngine, tenant: TenantConfig | None) -> list[str]:
        entries = engine.engine.adapters.entries
        return sorted(n for n, e in list(entries.items()) if Tenants.may_use(tenant, e.spec.tenant))

    def cards(engine: AsyncEngine, tenant: TenantConfig | None) -> list[ModelCard]:
        """The base (for a tenant allowed it) and the adapters the caller may use, each with the
        source it is served from as ``root`` (vLLM's field)."""
        base = engine.engine.base.shape.name
        entries = engine.engine.adapters.entries
        found = [ModelCard(id=base, root=engine.engine.config.model)] if tenant is None or tenant.allow_base else []
        for name in visible(engine, tenant):
            entry = entries.get(name)
            if entry is not None:
                found.append(ModelCard(id=name, root=entry.spec.source, parent=base))
        return found

    @app.get("/v1/models")
    async def models(engine: Engine, tenant: Caller) -> ModelList:
        return ModelList(data=cards(engine, tenant))

    @app.get("/v1/models/{model:path}")
    async def model(model: str, engine: Engine, tenant: Caller) -> ModelCard:
        """One card, as OpenAI's API retrieves it; another tenant's adapter is as missing as none."""
        for card in cards(engine, tenant):
            if card.id == model:
                return card
        raise APIError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")

    def resolve_model(engine: AsyncEngine, model: str, tenant: TenantConfig | None) -> str | None:
        """The adapter to use (None for the base). Another tenant's adapter, or the base for a
        tenant without base access, answers exactly as a missing model."""
        if model == engine.engine.base.shape.name and (tenant is None or tenant.allow_base):
            return None
        entry = engine.engine.adapters.entries.get(model)
        if entry is not None and Tenants.may_use(tenant, entry.spec.tenant):
            return model
        raise APIError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")

    # generation -------------------------------------------------------------------------------
    async def sampling(req: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
        guide = await guide_for(req)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                seed=req.seed,
                stop=req.stop_list(),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                logprobs=logprobs,
                ignore_eos=req.ignore_eos,
                frequency_penalty=req.frequency_penalty,
                presence_penalty=req.presence_penalty,
                repetition_penalty=req.repetition_penalty,
                min_tokens=req.min_tokens,
                logit_bias=req.bias_list(),
                guide=guide,
            )
        except SamplingError as err:
            raise APIError(400, str(err)) from None

    async def guide_for(req: CompletionRequest | ChatCompletionRequest) -> Guide | None:
        """The structured-output guide for ``response_format`` (None for plain text), compiled off
        the event loop; a schema the grammar library cannot compile is a 400 with its message."""
        fmt = req.response_format
        if fmt is None or fmt.type == "text":
            return None
        schema = fmt.json_schema.schema_ if fmt.type == "json_schema" and fmt.json_schema is not None else None
        try:
            return await asyncio.to_thread(state.ready().engine.grammars.compile, schema)
        except GrammarError as err:
            raise APIError(400, f"response_format: {err}", param="response_format") from None

    async def first_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput | None:
        """Start the request so that refusals (unknown adapter, too long) become 4xx before any
        streaming response has been committed."""
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            return None
        except (RequestError, SamplingError) as err:
            raise APIError(400, str(err)) from None
        except AdapterNotFound as err:
            raise APIError(404, str(err), code="model_not_found", param="model") from None
        except AdapterUnavailable as err:
            raise APIError(503, str(err), type_="server_error", code="adapter_load_failed") from None

    def failure(out: RequestOutput) -> APIError | None:
        """The OpenAI error a request that failed in the engine ends in: 503 when its adapter
        could not load (retrying elsewhere may help), 500 otherwise."""
        if out.finish_reason is not FinishReason.ERROR:
            return None
        code = out.error_code or "engine_error"
        return APIError(503 if code == "adapter_load_failed" else 500, out.error or "the request failed",
                        type_="server_error", code=code)  # fmt: skip

    async def run(
        engine: AsyncEngine, prompts: list[str | list[int]], params: SamplingParams, n: int, meter: RequestMeter,
        tenant: TenantConfig | None,
    ) -> Choices:  # fmt: skip
        """Admit the request and start one engine sequence per choice; the request's choices,
        which release it once (its quota slot, its pending count, its tokens) however it ends.
        A choice refused at its start refuses the request, and the others are aborted."""
        # Counted here on the event loop (not read from the engine thread), so a burst of
        # handlers cannot all pass the check before any of them reaches the engine.
        adapter = meter.adapter
        total = len(prompts) * n
        if not state.pending.admit(meter.tenant, total):
            raise APIError(
                503, "the server is at capacity; retry shortly", type_="server_error", code="overloaded", retry_after=1
            )
        # The most it can use, reserved against a token quota until it ends: the prompts (each
        # once, as usage counts them) and max_tokens for every choice.
        most = sum(len(p) for p in prompts if isinstance(p, list)) + params.max_tokens * total
        try:
            reservation = tenants.admit(tenant, adapter, most)
        except APIError as err:  # a quota refusal: billed nothing, recorded once as refused
            state.pending.release(meter.tenant, total)
            await meters.refuse(meter.request_id, err.status, tenant=meter.tenant, model=meter.model, adapter=adapter,
                                base=meter.base, endpoint=meter.endpoint)  # fmt: skip
            raise
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                state.pending.release(meter.tenant, total)
                prompt_tokens, _, completion_tokens = meter.tokens()
                tenants.finish(
                    tenant,
                    {"adapter": adapter, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
                    reservation,
                )

        request = Choices([], meter, release)
        choices = request.choices
        for i, prompt in enumerate(prompts):
            leader: str | None = None
            for j in range(n):
                index = i * n + j
                rid = meter.request_id if total == 1 else f"{meter.request_id}-{index}"
                meter.expect(rid, i, index)
                # As vLLM: the samples of a seeded request differ from each other and are each reproducible.
                p = params if j == 0 or params.seed is None else dataclasses.replace(params, seed=params.seed + j)
                stream = engine.generate(prompt, p, adapter, rid, tenant=meter.tenant, after=leader)
                choices.append(Choice(index, rid, stream))
                leader = leader or rid
        try:
            firsts = await asyncio.gather(*(first_output(c.stream) for c in choices), return_exceptions=True)
        except BaseException:  # cancelled (the client left, the server stops): nothing stays held
            request.close()
            raise
        error = next((f for f in firsts if isinstance(f, BaseException)), None)
        for c, first in zip(choices, firsts, strict=True):
            if isinstance(first, RequestOutput):
                c.first = first
                meter.seen(first)
                error = error or failure(first)  # failed at its first token: an error status, not a 200 stream
        if error is not None:
            request.close()
            raise error
        return request

    async def tokenised(engine: AsyncEngine, prompts: list[str | list[int]]) -> list[str | list[int]]:
        """Each prompt as token ids, encoded off the event loop and the engine thread; one longer
        than the context is a 400 before most of it is encoded."""
        tokenizer, limit = engine.engine.tokenizer, engine.engine.max_model_len

        def encode() -> list[str | list[int]]:
            return [tokenizer.encode_within(p, limit) if isinstance(p, str) else p for p in prompts]

        try:
            return await asyncio.to_thread(encode)
        except PromptTooLong as err:
            raise APIError(400, str(err), param="prompt") from None

    def meter_for(request_id: str, endpoint: str, model: str, adapter: str | None, tenant: TenantConfig | None) -> RequestMeter:
        base = state.ready().engine.base.shape.name
        return RequestMeter(meters, request_id, endpoint, model, adapter, tenant.name if tenant else None, base)

    async def final(request: Choices) -> list[RequestOutput]:
        """Drain a non-streamed request: every choice's last output (its usage record written),
        or the OpenAI error one of them ended in."""
        outs = await request.drain()
        for out in outs:
            if (err := failure(out)) is not None:
                raise err
        return outs

    def finish_reason(out: RequestOutput) -> str | None:
        if out.finish_reason is None:
            return None
        return "length" if out.finish_reason is FinishReason.LENGTH else "stop"

    def usage(meter: RequestMeter) -> dict[str, int]:
        prompt_tokens, _, completion_tokens = meter.tokens()
        return Usage(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
        ).model_dump()

    def with_running_usage(
        req: CompletionRequest | ChatCompletionRequest, event: dict[str, Any], meter: RequestMeter
    ) -> dict[str, Any]:
        """vLLM's ``continuous_usage_stats``: the usage so far on every streamed chunk."""
        if req.stream_options is not None and req.stream_options.continuous_usage_stats:
            event["usage"] = usage(meter)
        return event

    def tokens_left(engine: AsyncEngine, prompt_len: int) -> int:
        return max(1, engine.engine.max_model_len - prompt_len)

    async def sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    def streamed(
        req: CompletionRequest | ChatCompletionRequest, base: dict[str, Any], request: Choices,
        choice_event: Callable[[int, RequestOutput, str], dict[str, Any]],
    ) -> StreamingResponse:  # fmt: skip
        """The SSE response of a streamed request: one event per choice's delta, the stream's last
        event carrying the error a choice failed with, and the usage chunk when asked for."""

        async def events() -> AsyncIterator[dict[str, Any]]:
            async for c, out, delta in request.deltas():
                if (err := failure(out)) is not None:
                    request.close()  # the other choices end here too
                    yield error_body(err.message, err.type, err.code)
                    return
                yield with_running_usage(req, {**base, "choices": [choice_event(c.index, out, delta)]}, request.meter)
            if req.stream_options and req.stream_options.include_usage:
                yield {**base, "choices": [], "usage": usage(request.meter)}

        return CleanupResponse(sse(events()), request, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, engine: Engine, tenant: Caller) -> Any:
        adapter = resolve_model(engine, req.model, tenant)
        params = await sampling(req, req.max_tokens or DEFAULT_COMPLETION_TOKENS, req.logprobs)
        rid, created = new_id("cmpl"), now()
        meter = meter_for(rid, "/v1/completions", req.model, adapter, tenant)
        prompts = await tokenised(engine, req.prompts())
        request = await run(engine, prompts, params, req.n, meter, tenant)

        def logprobs_of(out: RequestOutput, start: int = 0) -> dict[str, Any] | None:
            """The entries of ``out``'s tokens from ``start`` on (a streamed chunk carries its new ones)."""
            if req.logprobs is None:
                return None
            tok, entries = engine.engine.tokenizer, out.logprobs[start:]
            return {
                "tokens": [tok.token_text(lp.token_id) for lp in entries],
                "token_logprobs": [lp.logprob for lp in entries],
                # As vLLM: the chosen token is among its step's entries too, so logprobs=0 gives it alone.
                "top_logprobs": [
                    {**{tok.token_text(t): v for t, v in lp.top}, tok.token_text(lp.token_id): lp.logprob} for lp in entries
                ],
            }

        base = {"id": rid, "object": "text_completion", "created": created, "model": req.model}
        if not req.stream:
            outs = await final(request)
            body = {**base, "usage": usage(meter), "choices": [
                {"index": c.index, "text": out.text, "finish_reason": finish_reason(out), "logprobs": logprobs_of(out)}
                for c, out in zip(request.choices, outs, strict=True)
            ]}  # fmt: skip
            return JSONResponse(body)

        sent: dict[int, int] = defaultdict(int)  # log-probabilities sent per choice

        def event(index: int, out: RequestOutput, delta: str) -> dict[str, Any]:
            start, sent[index] = sent[index], len(out.logprobs)
            return {"index": index, "text": delta, "finish_reason": finish_reason(out), "logprobs": logprobs_of(out, start)}

        return streamed(req, base, request, event)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, engine: Engine, tenant: Caller) -> Any:
        adapter = resolve_model(engine, req.model, tenant)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:  # templated and encoded off the event loop and the engine thread
            prompt = await asyncio.to_thread(engine.engine.tokenizer.chat, messages, limit=engine.engine.max_model_len)
        except ValueError as err:  # no chat template, or a conversation beyond the context
            raise APIError(400, str(err), param="messages") from None
        limit = req.max_completion_tokens or req.max_tokens or tokens_left(engine, len(prompt))
        params = await sampling(req, limit, (req.top_logprobs or 0) if req.logprobs else None)
        rid, created = new_id("chatcmpl"), now()
        meter = meter_for(rid, "/v1/chat/completions", req.model, adapter, tenant)
        request = await run(engine, [prompt], params, req.n, meter, tenant)

        def logprobs_of(out: RequestOutput, start: int = 0) -> dict[str, Any] | None:
            if not req.logprobs:
                return None
            tok = engine.engine.tokenizer
            return {"content": [
                {"token": tok.token_text(lp.token_id), "logprob": lp.logprob, "bytes": None,
                 "top_logprobs": [{"token": tok.token_text(t), "logprob": v, "bytes": None} for t, v in lp.top]}
                for lp in out.logprobs[start:]
            ]}  # fmt: skip

        base = {"id": rid, "object": "chat.completion", "created": created, "model": req.model}
        if not req.stream:
            outs = await final(request)
            body = {**base, "usage": usage(meter), "choices": [
                {"index": c.index, "message": {"role": "assistant", "content": out.text},
                 "finish_reason": finish_reason(out), "logprobs": logprobs_of(out)}
                for c, out in zip(request.choices, outs, strict=True)
            ]}  # fmt: skip
            return JSONResponse(body)

        sent: dict[int, int] = {}  # log-probabilities sent per choice; a choice's first chunk carries its role

        def event(index: int, out: RequestOutput, delta: str) -> dict[str, Any]:
            message: dict[str, str] = {"content": delta} if delta else {}
            if index not in sent:
                message = {"role": "assistant", "content": delta}
            start, sent[index] = sent.get(index, 0), len(out.logprobs)
            return {"index": index, "delta": message, "finish_reason": finish_reason(out), "logprobs": logprobs_of(out, start)}

        return streamed(req, {**base, "object": "chat.completion.chunk"}, request, event)

    app.include_router(admin_router)
    return app
