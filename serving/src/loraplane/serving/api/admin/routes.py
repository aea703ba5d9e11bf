"""Adapter management over HTTP: vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``,
and our ``/admin/*`` calls for the tiers (register, verify, pin, unpin, prefetch, state, stats,
the base, usage). Every one needs the admin token when the server has one.

Bodies are the contract's models (``loraplane.admin_api``), declared as response models so the
OpenAPI schema is what the operator and the router parse. Engine state is read on the engine's
thread.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from loraplane.adapter_format import AdapterValidationError, BaseShape, ErrorCode
from loraplane.adapter_format.golden import DriftReport
from loraplane.admin_api import LoadLoraRequest, NamedAdapterState, ReplicaStats, UnloadLoraRequest, VerifyRequest
from loraplane.serving.api.admin.quality_gate import load_adapter
from loraplane.serving.api.admin.view import named_adapter_state, replica_stats
from loraplane.serving.api.deps import Admin, Server, StatsReader
from loraplane.serving.engine.async_engine import AsyncEngine
from loraplane.serving.http.disconnect import cancel_on_disconnect
from loraplane.serving.http.errors import APIError
from loraplane.serving.http.tenants import Tenants
from loraplane.serving.lora.entries import AdapterBusy, AdapterNotFound, AdapterSpec, PinLimitReached
from loraplane.usage import UsageRollup

router = APIRouter()


def _spec(req: LoadLoraRequest) -> AdapterSpec:
    return AdapterSpec(req.lora_name, req.lora_path, req.digest, req.tenant, req.allow_rank_truncation, req.version)


async def _state(engine: AsyncEngine, tenants: Tenants, name: str) -> NamedAdapterState:
    quotas = tenants.adapter_limits.get(name)
    try:
        return await engine.call(lambda: named_adapter_state(engine.engine, name, quotas))
    except AdapterNotFound as err:
        raise APIError(404, str(err), code="model_not_found") from None


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora(req: LoadLoraRequest, engine: Admin, server: Server) -> str:
    """vLLM's call: fetch, validate and replay the golden outputs (off the engine thread), then
    serve it under ``lora_name``. A name already served is replaced only with ``load_inplace``,
    as vLLM answers (the operator's promotions go through ``/admin/adapters``)."""
    if req.lora_name in engine.engine.adapters.catalog and not req.load_inplace:
        raise APIError(
            400, f"The lora adapter '{req.lora_name}' has already been loaded. Set load_inplace to replace it.",
            param="lora_name", code="adapter_already_loaded",
        )  # fmt: skip
    try:
        await load_adapter(engine, _spec(req))
    except AdapterValidationError as err:
        # vLLM answers 404 for a path with no adapter, 400 for one it refuses.
        status = 404 if err.code is ErrorCode.MISSING_FILE else 400
        raise APIError(status, str(err), code=err.code.value, param="lora_path") from None
    except (AdapterBusy, ValueError) as err:
        raise APIError(409 if isinstance(err, AdapterBusy) else 400, str(err)) from None
    server.tenants.set_adapter_limits(req.lora_name, req.quotas)
    return f"Success: LoRA adapter '{req.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora(req: UnloadLoraRequest, engine: Admin, server: Server) -> str:
    try:
        await engine.call(lambda: engine.engine.unload_lora(req.lora_name))
    except AdapterNotFound as err:
        raise APIError(404, str(err), code="model_not_found") from None
    except AdapterBusy as err:
        raise APIError(409, str(err)) from None
    server.tenants.set_adapter_limits(req.lora_name, None)
    return f"Success: LoRA adapter '{req.lora_name}' removed successfully."


@router.post("/admin/adapters")
async def register(req: LoadLoraRequest, engine: Admin, server: Server) -> NamedAdapterState:
    """Declare an adapter without loading it; it loads on first use or on prefetch."""
    try:
        await engine.call(lambda: engine.engine.register_lora(_spec(req)))
    except (AdapterBusy, ValueError) as err:
        raise APIError(409 if isinstance(err, AdapterBusy) else 400, str(err)) from None
    server.tenants.set_adapter_limits(req.lora_name, req.quotas)
    return await _state(engine, server.tenants, req.lora_name)


@router.post("/admin/verify")
@cancel_on_disconnect
async def verify(req: VerifyRequest, engine: Admin, server: Server, raw_request: Request) -> DriftReport:
    """Replay a candidate version's golden outputs here (the operator's quality gate); 422
    with the drift when it fails. Nothing is registered. Callers of one version share its replay;
    it stops when they all have gone (``SharedVerifies``)."""
    try:
        return await server.verifies.verify(engine, req)
    except AdapterValidationError as err:
        raise APIError(422, str(err), code=err.code.value, param="lora_path") from None


@router.get("/admin/adapters/{name}")
async def adapter(name: str, engine: Admin, server: Server) -> NamedAdapterState:
    return await _state(engine, server.tenants, name)


async def _act(engine: AsyncEngine, tenants: Tenants, name: str, call: Callable[[str], None]) -> NamedAdapterState:
    try:
        await engine.call(lambda: call(name))
    except AdapterNotFound as err:
        raise APIError(404, str(err), code="model_not_found") from None
    except PinLimitReached as err:
        raise APIError(409, str(err), code="pin_limit_reached") from None
    return await _state(engine, tenants, name)


@router.post("/admin/adapters/{name}/pin")
async def pin(name: str, engine: Admin, server: Server) -> NamedAdapterState:
    """Keep the adapter on the device, never evicted; 409 ``pin_limit_reached`` once all but one
    of the device slots are pinned."""
    return await _act(engine, server.tenants, name, engine.engine.pin_lora)


@router.post("/admin/adapters/{name}/unpin")
async def unpin(name: str, engine: Admin, server: Server) -> NamedAdapterState:
    return await _act(engine, server.tenants, name, engine.engine.unpin_lora)


@router.post("/admin/adapters/{name}/prefetch")
async def prefetch(name: str, engine: Admin, server: Server) -> NamedAdapterState:
    """Start loading the adapter into host memory now, before its first request."""
    return await _act(engine, server.tenants, name, engine.engine.prefetch_lora)


@router.get("/admin/base")
async def base(engine: Admin) -> BaseShape:
    """The base this replica serves (name, revision, fingerprint, shape): what the operator
    validates adapters against before registering them here. Fixed once the engine has loaded."""
    return engine.engine.base.shape


@router.get("/admin/usage")
async def usage(_engine: Admin, server: Server) -> UsageRollup:
    """Per-tenant totals of this replica's last day (the operator writes their sum into the
    BaseModel's status) and the export's backlog."""
    return server.metering.view()


@router.get("/admin/stats")
async def stats(engine: StatsReader, server: Server) -> ReplicaStats:
    """Every adapter's tier, pin, counters and quotas; per-tenant counters; queue depths."""
    quotas = dict(server.tenants.adapter_limits)
    return await engine.call(lambda: replica_stats(engine.engine, quotas))
