"""The FastAPI application: it wires the routers (OpenAI's routes, adapter management and the
admin API, health and metrics) to one server state.

The engine loads in the background at startup; ``/health`` answers at once (liveness) and
``/ready`` only once the base model is in memory (readiness), so Kubernetes neither kills a pod
that is still converting its base nor routes requests to it early.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplane.admin_api.auth import SignedResponses
from loraplane.serving.api import ops_routes
from loraplane.serving.api.admin import routes as admin_routes
from loraplane.serving.api.admin.quality_gate import SharedVerifies
from loraplane.serving.api.deps import ServerState
from loraplane.serving.api.openai import models_routes, tokenize_routes
from loraplane.serving.api.openai.completions import routes as completions_routes
from loraplane.serving.api.openai.responses import routes as responses_routes
from loraplane.serving.api.openai.responses.store import ResponseStore
from loraplane.serving.api.openai.tools.parsers import TOOL_PARSERS
from loraplane.serving.engine.llm_engine import LLMEngine
from loraplane.serving.http.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from loraplane.serving.http.errors import APIError, api_error_handler, http_error_handler, validation_error_handler
from loraplane.serving.http.metrics_port import view as metrics_view
from loraplane.serving.http.tenants import Tenants
from loraplane.serving.http.usage_metrics import UsageCollector
from loraplane.usage import Metering


def create_app(
    make_engine: Callable[[], LLMEngine],
    *,
    admin_token: str | None = None,
    stats_token: str | None = None,
    tenants: Tenants | None = None,
    max_pending_requests: int = 256,
    metering: Metering | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    admin_hosts: frozenset[str] = frozenset(),
    tool_call_parser: str | None = None,
    responses: ResponseStore | None = None,
) -> FastAPI:
    """``max_pending_requests`` bounds the requests queued or running in the engine; beyond it the
    server sheds load with 503 and ``Retry-After`` instead of queueing without bound, from the
    tenants over their share of it first (see ``load_shedding``). ``metering``
    receives one usage record per request (by default they are only counted, not spooled).
    ``stats_token`` may read ``/admin/stats`` and nothing else (the router's token).
    ``admin_hosts``: this replica's own addresses, which a signed admin call must name.
    ``tool_call_parser``: the model's tool-call format (``tool_calls.TOOL_PARSERS``), which lets
    requests leave the choice between text and calls to the model (``tool_choice: "auto"``).
    ``responses``: where the Responses API keeps stored responses (by default its bounds'
    defaults)."""
    meters = metering or Metering("local")
    parser = TOOL_PARSERS[tool_call_parser]() if tool_call_parser is not None else None
    state = ServerState(
        make_engine,
        admin_token,
        max_pending_requests,
        tenants or Tenants(None),
        meters,
        stats_token,
        admin_hosts,
        responses=responses if responses is not None else ResponseStore(),
        verifies=SharedVerifies(),
        tool_parser=parser,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        state.start()
        yield
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)
        await asyncio.to_thread(meters.close)  # after the last request's record

    app = FastAPI(title="loraplane", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(SignedResponses)  # answers to signed admin calls are signed back (admin_api.auth)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.state.server = state  # what every router's dependencies read (see deps)
    usage_registry = CollectorRegistry()
    usage_registry.register(UsageCollector(meters))
    # What `/metrics` and `loraplane serve --metrics-port` serve (see metrics_port).
    app.state.metrics = metrics_view(
        lambda: [usage_registry] if state.engine is None else [state.engine.engine.metrics.registry, usage_registry]
    )
    for part in (ops_routes, models_routes, completions_routes, responses_routes, tokenize_routes, admin_routes):
        app.include_router(part.router)
    return app
