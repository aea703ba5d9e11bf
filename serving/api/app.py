"""The FastAPI application: OpenAI-compatible completions and chat, model listing, vLLM's LoRA
load/unload calls, admin calls for the adapter tiers, Prometheus metrics and health checks.

The engine loads in the background at startup; ``/health`` answers at once (liveness) and
``/ready`` only once the base model is in memory (readiness), so Kubernetes neither kills a pod
that is still converting its base nor routes requests to it early.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from loraplane.adapter_format import AdapterValidationError, ErrorCode
from loraplane.serving.api.async_engine import AsyncEngine
from loraplane.serving.api.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from loraplane.serving.api.errors import APIError, api_error_handler, error_body, require_admin, validation_error_handler
from loraplane.serving.api.metering import RequestMeter
from loraplane.serving.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraRequest,
    ModelCard,
    ModelList,
    UnloadLoraRequest,
    Usage,
    VerifyRequest,
    new_id,
    now,
)
from loraplane.serving.api.quality_gate import verify_candidate
from loraplane.serving.api.tenants import TenantConfig, Tenants
from loraplane.serving.api.usage_metrics import UsageCollector
from loraplane.serving.engine.llm_engine import LLMEngine, RequestError, RequestOutput
from loraplane.serving.engine.sampling_params import SamplingError, SamplingParams
from loraplane.serving.engine.sequence import FinishReason
from loraplane.serving.lora.manager import AdapterBusy, AdapterNotFound, AdapterSpec, AdapterUnavailable
from loraplane.usage import Metering, UsageRollup

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


class ServerState:
    def __init__(self, make_engine: Callable[[], LLMEngine], admin_token: str | None) -> None:
        self.make_engine, self.admin_token = make_engine, admin_token
        self.engine: AsyncEngine | None = None
        self.load_error: str | None = None
        self.pending = 0  # accepted requests not yet finished

    def start(self) -> None:
        def load() -> None:
            try:
                self.engine = AsyncEngine(self.make_engine())
            except Exception as err:  # reported by /ready and every API call
                self.load_error = f"{type(err).__name__}: {err}"

        threading.Thread(target=load, name="engine-load", daemon=True).start()

    def ready(self) -> AsyncEngine:
        if self.engine is None:
            detail = f"the engine failed to start: {self.load_error}" if self.load_error else "the base model is still loading"
            raise APIError(503, detail, type_="server_error", code="not_ready")
        return self.engine


def _engine(request: Request) -> AsyncEngine:
    state: ServerState = request.app.state.server
    return state.ready()


def _admin(request: Request) -> AsyncEngine:
    state: ServerState = request.app.state.server
    require_admin(request.headers.get("authorization"), state.admin_token)
    return state.ready()


def _caller(request: Request) -> TenantConfig | None:
    tenants: Tenants = request.app.state.tenants
    return tenants.authenticate(request.headers.get("authorization"))


# Module level, not inside create_app: FastAPI resolves these annotations in the module's namespace.
Engine = Annotated[AsyncEngine, Depends(_engine)]
Admin = Annotated[AsyncEngine, Depends(_admin)]
Caller = Annotated[TenantConfig | None, Depends(_caller)]


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
    server sheds load with 503 and ``Retry-After`` instead of queueing without bound. ``metering``
    receives one usage record per request (by default they are only counted, not spooled)."""
    state = ServerState(make_engine, admin_token)
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

    @app.get("/metrics")
    async def metrics(engine: Engine) -> Response:
        body = generate_latest(engine.engine.metrics.registry) + generate_latest(usage_registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

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
    def sampling(req: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                seed=req.seed,
                stop=req.stop_list(),
                logprobs=logprobs,
                ignore_eos=req.ignore_eos,
            )
        except SamplingError as err:
            raise APIError(400, str(err)) from None

    async def first_output(stream: AsyncIterator[RequestOutput]) -> tuple[RequestOutput | None, AsyncIterator[RequestOutput]]:
        """Start the request so that refusals (unknown adapter, too long) become 4xx before any
        streaming response has been committed."""
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            return None, stream
        except (RequestError, SamplingError) as err:
            raise APIError(400, str(err)) from None
        except AdapterNotFound as err:
            raise APIError(404, str(err), code="model_not_found", param="model") from None
        except AdapterUnavailable as err:
            raise APIError(503, str(err), type_="server_error", code="adapter_load_failed") from None
        return first, stream

    def failure(out: RequestOutput) -> APIError | None:
        """The OpenAI error a request that failed in the engine ends in: 503 when its adapter
        could not load (retrying elsewhere may help), 500 otherwise."""
        if out.finish_reason is not FinishReason.ERROR:
            return None
        code = out.error_code or "engine_error"
        return APIError(503 if code == "adapter_load_failed" else 500, out.error or "the request failed",
                        type_="server_error", code=code)  # fmt: skip

    def failed(out: RequestOutput) -> None:
        err = failure(out)
        if err is not None:
            raise err

    async def run(
        engine: AsyncEngine, prompt: str | list[int], params: SamplingParams, meter: RequestMeter, tenant: TenantConfig | None
    ) -> tuple[RequestOutput | None, AsyncIterator[RequestOutput]]:
        # Counted here on the event loop (not read from the engine thread), so a burst of
        # handlers cannot all pass the check before any of them reaches the engine.
        adapter = meter.adapter
        if state.pending >= max_pending_requests:
            raise APIError(
                503, "the server is at capacity; retry shortly", type_="server_error", code="overloaded", retry_after=1
            )
        try:
            tenants.admit(tenant, adapter)
        except APIError as err:  # a quota refusal: billed nothing, recorded once as refused
            await meters.refuse(meter.request_id, err.status, tenant=meter.tenant, model=meter.model, adapter=adapter,
                                base=meter.base, endpoint=meter.endpoint)  # fmt: skip
            raise
        state.pending += 1
        try:
            stream = engine.generate(prompt, params, adapter, meter.request_id, tenant=meter.tenant)
            first, stream = await first_output(stream)
        except BaseException:
            state.pending -= 1
            tenants.finish(tenant, {"adapter": adapter, "prompt_tokens": 0, "completion_tokens": 0, "finish_reason": "rejected"})
            raise
        if first is not None:
            meter.seen(first)
            refused = failure(first)
            if refused is not None:  # failed at its first token: an error status, not a 200 stream
                await meter.settle()
                release(tenant, adapter, first)
                raise refused
        return first, stream

    def meter_for(request_id: str, endpoint: str, model: str, adapter: str | None, tenant: TenantConfig | None) -> RequestMeter:
        base = state.ready().engine.base.shape.name
        return RequestMeter(meters, request_id, endpoint, model, adapter, tenant.name if tenant else None, base)

    def release(tenant: TenantConfig | None, adapter: str | None, out: RequestOutput | None) -> None:
        """Release the tenant's slot and count its tokens against its quotas, once per accepted request."""
        record: dict[str, object] = {"adapter": adapter, "prompt_tokens": 0, "completion_tokens": 0}
        if out is not None:
            record.update(prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(out.token_ids))
        state.pending -= 1
        tenants.finish(tenant, record)

    async def final(
        first: RequestOutput | None, stream: AsyncIterator[RequestOutput], tenant: TenantConfig | None, meter: RequestMeter
    ) -> RequestOutput:
        """Drain a non-streamed request; its last output (its usage record written), or the
        OpenAI error it ended in."""
        try:
            async for item in stream:
                meter.seen(item)
            await meter.settle()
        finally:
            meter.settle_nowait()
            release(tenant, meter.adapter, meter.last)
        out = meter.last
        assert out is not None
        failed(out)
        return out

    def finish_reason(out: RequestOutput) -> str | None:
        if out.finish_reason is None:
            return None
        return "length" if out.finish_reason is FinishReason.LENGTH else "stop"

    def usage(out: RequestOutput) -> Usage:
        return Usage(
            prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=len(out.token_ids),
            total_tokens=len(out.prompt_token_ids) + len(out.token_ids),
        )

    def with_running_usage(
        req: CompletionRequest | ChatCompletionRequest, event: dict[str, Any], out: RequestOutput
    ) -> dict[str, Any]:
        """vLLM's ``continuous_usage_stats``: the usage so far on every streamed chunk."""
        if req.stream_options is not None and req.stream_options.continuous_usage_stats:
            event["usage"] = usage(out).model_dump()
        return event

    def tokens_left(engine: AsyncEngine, prompt_len: int) -> int:
        return max(1, engine.engine.max_model_len - prompt_len)

    async def deltas(
        engine: AsyncEngine, first: RequestOutput | None, stream: AsyncIterator[RequestOutput],
        tenant: TenantConfig | None, meter: RequestMeter,
    ) -> AsyncIterator[tuple[RequestOutput, str]]:  # fmt: skip
        """Each step's new text (empty only on the final step), settling the request's quotas and
        usage record when the stream ends however it ends; the record of a finished request is
        written before its last event. Text is re-decoded from all tokens, so a character split
        across tokens is sent once whole."""
        sent = ""
        pending = [first] if first is not None else []
        try:
            async for item in _chain(pending, stream):
                meter.seen(item)
                if item.finished:
                    await meter.settle()
                text = item.text if item.finished else engine.engine.tokenizer.decode(item.token_ids)
                delta, sent = text[len(sent) :], text if text.startswith(sent) else sent
                if delta or item.finished:
                    yield item, delta
        finally:
            meter.settle_nowait()
            release(tenant, meter.adapter, meter.last)

    async def sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, engine: Engine, tenant: Caller) -> Any:
        adapter = resolve_model(engine, req.model, tenant)
        prompt = req.prompt
        if isinstance(prompt, str) and not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        params = sampling(req, req.max_tokens or DEFAULT_COMPLETION_TOKENS, req.logprobs)
        rid, created = new_id("cmpl"), now()
        meter = meter_for(rid, "/v1/completions", req.model, adapter, tenant)
        first, stream = await run(engine, prompt, params, meter, tenant)

        def choice(out: RequestOutput, text: str) -> dict[str, Any]:
            logprobs = None
            if req.logprobs is not None:
                tok = engine.engine.tokenizer
                logprobs = {
                    "tokens": [tok.token_text(lp.token_id) for lp in out.logprobs],
                    "token_logprobs": [lp.logprob for lp in out.logprobs],
                    # As vLLM: the chosen token is among its step's entries too, so logprobs=0 gives it alone.
                    "top_logprobs": [
                        {**{tok.token_text(t): v for t, v in lp.top}, tok.token_text(lp.token_id): lp.logprob}
                        for lp in out.logprobs
                    ],
                }
            return {"index": 0, "text": text, "finish_reason": finish_reason(out), "logprobs": logprobs}

        if not req.stream:
            out = await final(first, stream, tenant, meter)
            body = {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                    "choices": [choice(out, out.text)], "usage": usage(out).model_dump()}  # fmt: skip
            return JSONResponse(body)

        async def events() -> AsyncIterator[dict[str, Any]]:
            base = {"id": rid, "object": "text_completion", "created": created, "model": req.model}
            out = None
            async for out, delta in deltas(engine, first, stream, tenant, meter):
                if (err := failure(out)) is not None:  # the stream's last event carries the error
                    yield error_body(err.message, err.type, err.code)
                    return
                event = {**base, "choices": [{"index": 0, "text": delta, "finish_reason": finish_reason(out), "logprobs": None}]}
                yield with_running_usage(req, event, out)
            if out is not None and req.stream_options and req.stream_options.include_usage:
                yield {**base, "choices": [], "usage": usage(out).model_dump()}

        return StreamingResponse(sse(events()), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, engine: Engine, tenant: Caller) -> Any:
        adapter = resolve_model(engine, req.model, tenant)
        try:
            prompt = engine.engine.tokenizer.chat([{"role": m.role, "content": m.text()} for m in req.messages])
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from None
        limit = req.max_completion_tokens or req.max_tokens or tokens_left(engine, len(prompt))
        params = sampling(req, limit, (req.top_logprobs or 0) if req.logprobs else None)
        rid, created = new_id("chatcmpl"), now()
        meter = meter_for(rid, "/v1/chat/completions", req.model, adapter, tenant)
        first, stream = await run(engine, prompt, params, meter, tenant)

        def logprobs_of(out: RequestOutput) -> dict[str, Any] | None:
            if not req.logprobs:
                return None
            tok = engine.engine.tokenizer
            return {"content": [
                {"token": tok.token_text(lp.token_id), "logprob": lp.logprob, "bytes": None,
                 "top_logprobs": [{"token": tok.token_text(t), "logprob": v, "bytes": None} for t, v in lp.top]}
                for lp in out.logprobs
            ]}  # fmt: skip

        if not req.stream:
            out = await final(first, stream, tenant, meter)
            body = {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                                 "finish_reason": finish_reason(out), "logprobs": logprobs_of(out)}],
                    "usage": usage(out).model_dump()}  # fmt: skip
            return JSONResponse(body)

        async def events() -> AsyncIterator[dict[str, Any]]:
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model}
            yield {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
            out = None
            async for out, delta in deltas(engine, first, stream, tenant, meter):
                if (err := failure(out)) is not None:
                    yield error_body(err.message, err.type, err.code)
                    return
                choice = {"index": 0, "delta": {"content": delta} if delta else {}, "finish_reason": finish_reason(out)}
                yield with_running_usage(req, {**base, "choices": [choice]}, out)
            if out is not None and req.stream_options and req.stream_options.include_usage:
                yield {**base, "choices": [], "usage": usage(out).model_dump()}

        return StreamingResponse(sse(events()), media_type="text/event-stream")

    # adapters (vLLM's calls and our admin API; both need the admin token when one is set) -------
    @app.post("/v1/load_lora_adapter")
    async def load_lora(req: LoadLoraRequest, engine: Admin) -> PlainTextResponse:
        try:
            await engine.call(
                lambda: engine.engine.load_lora(
                    req.lora_name, req.lora_path, expected_digest=req.digest, tenant=req.tenant,
                    allow_rank_truncation=req.allow_rank_truncation,
                )
            )  # fmt: skip
        except AdapterValidationError as err:
            # vLLM answers 404 for a path with no adapter, 400 for one it refuses.
            status = 404 if err.code is ErrorCode.MISSING_FILE else 400
            raise APIError(status, str(err), code=err.code.value, param="lora_path") from None
        except (AdapterBusy, ValueError) as err:
            raise APIError(409 if isinstance(err, AdapterBusy) else 400, str(err)) from None
        tenants.set_adapter_limits(req.lora_name, req.quotas)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(req: UnloadLoraRequest, engine: Admin) -> PlainTextResponse:
        try:
            await engine.call(lambda: engine.engine.unload_lora(req.lora_name))
        except AdapterNotFound as err:
            raise APIError(404, str(err), code="model_not_found") from None
        except AdapterBusy as err:
            raise APIError(409, str(err)) from None
        tenants.set_adapter_limits(req.lora_name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @app.post("/admin/adapters")
    async def register(req: LoadLoraRequest, engine: Admin) -> dict[str, Any]:
        """Declare an adapter without loading it; it loads on first use or on prefetch."""
        spec = AdapterSpec(req.lora_name, req.lora_path, req.digest, req.tenant, req.allow_rank_truncation, req.version)
        try:
            await engine.call(lambda: engine.engine.register_lora(spec))
        except (AdapterBusy, ValueError) as err:
            raise APIError(409 if isinstance(err, AdapterBusy) else 400, str(err)) from None
        tenants.set_adapter_limits(req.lora_name, req.quotas)
        return await adapter_state(req.lora_name, engine)

    @app.post("/admin/verify")
    async def verify(req: VerifyRequest, engine: Admin) -> dict[str, Any]:
        """Replay a candidate version's golden outputs here (the operator's quality gate); 422
        with the drift when it fails. Nothing is registered."""
        try:
            report = await verify_candidate(engine, req)
        except AdapterValidationError as err:
            raise APIError(422, str(err), code=err.code.value, param="lora_path") from None
        return report.model_dump()

    @app.get("/admin/adapters/{name}")
    async def adapter_state(name: str, engine: Admin) -> dict[str, Any]:
        def read() -> dict[str, Any]:
            stats = with_quotas(engine.engine.stats())["adapters"]
            assert isinstance(stats, dict)
            if name not in stats:
                raise AdapterNotFound(name)
            return {"name": name, **stats[name]}

        try:
            return await engine.call(read)
        except AdapterNotFound as err:
            raise APIError(404, str(err), code="model_not_found") from None

    @app.get("/admin/base")
    async def base(engine: Admin) -> dict[str, Any]:
        """The base this replica serves (name, revision, fingerprint, shape): what the operator
        validates adapters against before registering them here."""
        return engine.engine.base.shape.model_dump()

    def with_quotas(stats: dict[str, object]) -> dict[str, object]:
        """Each adapter's own quotas in its stats: what the router enforces at the edge too."""
        adapters = stats["adapters"]
        assert isinstance(adapters, dict)
        for name, entry in adapters.items():
            limits = tenants.adapter_limits.get(name)
            entry["quotas"] = limits.model_dump(exclude_none=True) if limits is not None else None
        return stats

    @app.get("/admin/usage", response_model=UsageRollup)
    async def usage_rollup(_engine: Admin) -> UsageRollup:
        """Per-tenant totals of this replica's last day (the operator writes their sum into the
        BaseModel's status) and the export's backlog."""
        return meters.view()

    @app.get("/admin/stats")
    async def stats(engine: Admin) -> dict[str, object]:
        return with_quotas(await engine.call(engine.engine.stats))

    for action in ("pin", "unpin", "prefetch"):

        def make(action: str) -> Callable[..., Any]:
            async def handler(name: str, engine: Admin) -> dict[str, Any]:
                method = getattr(engine.engine, f"{action}_lora")
                try:
                    await engine.call(lambda: method(name))
                except AdapterNotFound as err:
                    raise APIError(404, str(err), code="model_not_found") from None
                return await adapter_state(name, engine)

            return handler

        app.post(f"/admin/adapters/{{name}}/{action}")(make(action))

    return app


async def _chain(first: list[RequestOutput], rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    for item in first:
        yield item
    async for item in rest:
        yield item
