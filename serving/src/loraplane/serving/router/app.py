"""The router's application: the replica table kept true by discovery and upkeep, and the routes
(``routes``) wired to one router state. Tenant keys and quotas are checked at the edge with the
servers' own tenants file and rules (``edge``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplane.serving.http.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from loraplane.serving.http.errors import APIError, api_error_handler, http_error_handler, validation_error_handler
from loraplane.serving.http.tenants import Tenants
from loraplane.serving.http.usage_metrics import UsageCollector
from loraplane.serving.router.config import RouterConfig
from loraplane.serving.router.discovery import EndpointSliceWatch, static_members
from loraplane.serving.router.forward import Forwarder
from loraplane.serving.router.metrics import RouterMetrics
from loraplane.serving.router.policy import Router
from loraplane.serving.router.routes import router as routes
from loraplane.serving.router.state import RouterState
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
    table = ReplicaTable(proof_first=admin_token is not None)
    meters = metering or Metering("router")
    state = RouterState(config, table, RouterMetrics(table), tenants or Tenants(None), meters, admin_token)
    state.metrics.registry.register(UsageCollector(meters))
    if config.replicas:
        table.set_members(static_members(config.replicas))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(connect=config.connect_timeout, read=None, write=60, pool=None)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            state.forwarder = Forwarder(table, Router(config.policy, config.epsilon), state.metrics, client)
            upkeep = Upkeep(table, client, admin_token, state.tenants, interval=config.stats_interval)
            watch = None
            if config.service:
                loop = asyncio.get_running_loop()
                watch = EndpointSliceWatch(
                    kube_api_client or _kube_client(), config.namespace, config.service,
                    lambda members: _call_soon(loop, _joined, table, upkeep, members),
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
    app.state.router = state
    app.state.metrics = state.metrics.registry  # what `loraplane router --metrics-port` serves
    app.add_middleware(BodyLimit, max_bytes=DEFAULT_MAX_BODY_BYTES)  # the replicas' own cap: refused here first
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.include_router(routes)
    return app


def _joined(table: ReplicaTable, upkeep: Upkeep, members: dict[str, str]) -> None:
    """Discovery's news: the new membership, and a check now, so a pod that joined is up (or
    refused) within one answer rather than at the next tick."""
    table.set_members(members)
    upkeep.soon()


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
