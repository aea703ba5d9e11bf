"""The router's HTTP face: the OpenAI routes forwarded to replicas, tenant keys and quotas checked
at the edge with the servers' own tenants file and rules, its metrics, and a view of the table."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from loraplane.serving.api.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from loraplane.serving.api.errors import APIError, api_error_handler, invalid_request, require_admin, validation_error_handler
from loraplane.serving.api.protocol import ChatCompletionRequest, CompletionRequest, new_id
from loraplane.serving.api.tenants import TenantConfig, Tenants
from loraplane.serving.api.usage_metrics import UsageCollector
from loraplane.serving.router.config import RouterConfig
from loraplane.serving.router.discovery import EndpointSliceWatch, static_members
from loraplane.serving.router.forward import Forwarder
from loraplane.serving.router.metrics import RouterMetrics
from loraplane.serving.router.policy import Router
from loraplane.serving.router.table import ReplicaTable
from loraplane.serving.router.upkeep import Upkeep
from loraplane.usage import Metering


def create_router_app(
    config: RouterConfig,
    *,
    tenants: Tenants | None = None,
    admin_token: str | None = None,
    kube_api_client: Any = None,
    metering: Metering | None = None,
) -> FastAPI:
    """``admin_token`` guards the router's own view and is what it sends to read the replicas'
    stats (one token for the stack). ``kube_api_client`` is the kubernetes ApiClient used for
    discovery by Service; by default the in-cluster config, or the kubeconfig outside a cluster.
    ``metering`` records the requests the router refuses itself (quotas, no replica, a bad body
    from a known tenant); what reaches a replica is recorded there, so nothing counts twice."""
    meters = metering or Metering("router")
    table = ReplicaTable()
    metrics = RouterMetrics(table)
    metrics.registry.register(UsageCollector(meters))
    tenants = tenants or Tenants(None)
    if config.replicas:
        table.set_members(static_members(config.replicas))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(connect=config.connect_timeout, read=None, write=60, pool=None)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            app.state.forwarder = Forwarder(table, Router(config.policy, config.epsilon), metrics, client)
            upkeep = Upkeep(table, client, admin_token, tenants, interval=config.stats_interval)
            watch = None
            if config.service:
                loop = asyncio.get_running_loop()
                watch = EndpointSliceWatch(
                    kube_api_client or _kube_client(), config.namespace, config.service,
                    lambda members: _call_soon(loop, table.set_members, members),
                )  # fmt: skip
                watch.start()
            await upkeep.once()
            task = asyncio.create_task(upkeep.run())
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                if watch is not None:
                    watch.stop()
                await asyncio.to_thread(meters.close)

    app = FastAPI(title="loraplane router", lifespan=lifespan)
    app.state.metrics = metrics.registry  # what `loraplane router --metrics-port` serves
    app.add_middleware(BodyLimit, max_bytes=DEFAULT_MAX_BODY_BYTES)  # the replicas' own cap: refused here first
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)

    def forwarded_headers(request: Request) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        return headers

    async def relay(request: Request, path: str) -> Response:
        tenant = tenants.authenticate(request.headers.get("authorization"))  # an unknown key is nobody's to bill
        seen: dict[str, str | None] = {"adapter": None}
        try:
            return await admitted(request, path, tenant, seen)
        except APIError as err:
            await meters.refuse(new_id("rtr"), err.status, source="router", tenant=tenant.name if tenant else None,
                                model=seen["adapter"] or "", adapter=seen["adapter"], endpoint=path)  # fmt: skip
            raise

    async def admitted(request: Request, path: str, tenant: TenantConfig | None, seen: dict[str, str | None]) -> Response:
        """Forward a request the edge admits; raises the APIError of one it refuses (``seen``
        gets the model it named, for the refusal's record)."""
        try:
            payload = json.loads(await request.body())
        except ValueError:
            raise APIError(400, "the body is not valid JSON", code="invalid_request") from None
        if not isinstance(payload, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_request")
        try:  # as strictly as the replicas: a body they would refuse never counts against a quota
            request_model = BODIES[path].model_validate(payload)
        except ValidationError as err:
            raise invalid_request(err.errors()) from None
        payload["stream"] = request_model.stream  # what the replica will do, e.g. for "stream": 1
        adapter = seen["adapter"] = request_model.model
        listed, owner = table.owner(adapter)
        if listed and not Tenants.may_use(tenant, owner):  # before any quota can reveal it
            raise APIError(404, f"The model `{adapter}` does not exist.", code="model_not_found", param="model")
        # The edge does not tokenise. It reserves the completion tokens the body allows and the
        # prompt at about four characters a token, as OpenAI estimates for its own limits; the
        # replica counts the prompt exactly and may refuse what the edge let through (it then
        # records the refusal itself, once).
        limit = getattr(request_model, "max_completion_tokens", None) or request_model.max_tokens or 0
        if isinstance(request_model, CompletionRequest):
            prompts = request_model.prompts()
        else:  # one prompt: the conversation
            prompts = [" ".join(m.text() for m in request_model.messages)]
        estimate = sum(len(p) if isinstance(p, list) else len(p) // 4 for p in prompts)
        most = estimate + limit * request_model.n * len(prompts)
        reservation = tenants.admit(tenant, adapter, most)
        forwarder: Forwarder = request.app.state.forwarder

        def done(usage: dict[str, Any] | None, tenant: TenantConfig | None = tenant) -> None:
            usage = usage or {}
            tenants.finish(tenant, {"adapter": adapter, "prompt_tokens": usage.get("prompt_tokens", 0),
                                    "completion_tokens": usage.get("completion_tokens", 0)}, reservation)  # fmt: skip

        try:
            return await forwarder.post(path, payload, forwarded_headers(request), done)
        except APIError:
            done(None)
            raise

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await relay(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await relay(request, "/v1/chat/completions")

    async def ask_any(request: Request, path: str) -> Response:
        """Every replica serves the same adapters (the operator sees to it); ask one that is up."""
        tenants.authenticate(request.headers.get("authorization"))
        forwarder: Forwarder = request.app.state.forwarder
        for replica in sorted(table.up(), key=lambda r: r.in_flight):
            try:
                r = await forwarder.client.get(f"{replica.url}{path}", headers=forwarded_headers(request))
            except httpx.TransportError as err:
                table.mark_down(replica, repr(err))
                continue
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        raise APIError(503, "no serving replica is up", type_="server_error", code="no_replica", retry_after=1)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await ask_any(request, "/v1/models")

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> Response:
        return await ask_any(request, f"/v1/models/{quote(model, safe='')}")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> dict[str, object]:
        if not table.up():
            raise APIError(503, "no serving replica is up", type_="server_error", code="no_replica", retry_after=1)
        return {"status": "ready", "replicas": len(table.up())}

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        """Admin token only where tenants are set (the series name them); see metrics_port."""
        if not tenants.open:
            require_admin(request.headers.get("authorization"), admin_token)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/replicas")
    async def replicas(request: Request) -> dict[str, object]:
        require_admin(request.headers.get("authorization"), admin_token)
        return {"policy": config.policy, "epsilon": config.epsilon,
                "replicas": [r.view() for r in sorted(table.replicas.values(), key=lambda r: r.name)]}  # fmt: skip

    return app


BODIES: dict[str, type[CompletionRequest] | type[ChatCompletionRequest]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    loop.call_soon_threadsafe(fn, *args)


def _kube_client() -> Any:
    from kubernetes import client
    from kubernetes import config as kube_config

    loader: Any = kube_config  # untyped
    try:
        loader.load_incluster_config()
    except loader.ConfigException:
        loader.load_kube_config()
    return client.ApiClient()
