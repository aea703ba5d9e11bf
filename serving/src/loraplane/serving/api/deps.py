"""The server's state and the FastAPI dependencies every router takes: the server itself, the
engine once it has loaded, the engine for an admin call (the admin token checked), and the
calling tenant.

Module level, not inside ``create_app``: FastAPI resolves these annotations in the module's
namespace, and the routers of each part of the API import them from here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from loraplane.serving.api.load_shedding import PendingRequests
from loraplane.serving.engine.async_engine import AsyncEngine
from loraplane.serving.engine.llm_engine import LLMEngine
from loraplane.serving.http.errors import APIError, require_admin
from loraplane.serving.http.tenants import TenantConfig, Tenants
from loraplane.usage import Metering

if TYPE_CHECKING:  # the routers below read these through the state; they are made by create_app
    from loraplane.serving.api.admin.quality_gate import SharedVerifies
    from loraplane.serving.api.openai.responses.store import ResponseStore
    from loraplane.serving.api.openai.tools.parsers import ToolParser

ENGINE_FAILED = "engine_failed"  # /ready's error code once the engine has failed to start: it never will


class ServerState:
    """What one server holds: the engine (once loaded), tenants and their quotas, the usage
    meter and the count of pending requests."""

    def __init__(
        self, make_engine: Callable[[], LLMEngine], admin_token: str | None, max_pending_requests: int, tenants: Tenants,
        metering: Metering, stats_token: str | None = None, admin_hosts: frozenset[str] = frozenset(),
        *, responses: ResponseStore, verifies: SharedVerifies, tool_parser: ToolParser | None = None,
    ) -> None:  # fmt: skip
        """``admin_hosts``: this replica's own addresses; a signed admin call must name one of them
        (the operator passes the pod's IP), so one captured elsewhere cannot be replayed here."""
        self.make_engine, self.admin_token, self.stats_token = make_engine, admin_token, stats_token
        self.admin_hosts = admin_hosts
        self.tenants, self.metering = tenants, metering
        self.engine: AsyncEngine | None = None
        self.load_error: str | None = None
        self.pending = PendingRequests(max_pending_requests)  # accepted requests not yet finished
        self.tool_parser = tool_parser  # reads "auto" tool calls back (vLLM's --tool-call-parser)
        self.responses = responses  # the Responses API's stored ones
        self.verifies = verifies  # /admin/verify's replays in flight, one per version

    def start(self) -> None:
        def load() -> None:
            try:
                engine = self.make_engine()
                if engine.base.merged:  # a dedicated replica: its adapter's quotas, as a registration would set them
                    self.tenants.set_adapter_limits(engine.base.shape.name, engine.config.merged_lora_quotas)
                self.engine = AsyncEngine(engine)
            except Exception as err:  # reported by /ready and every API call
                self.load_error = f"{type(err).__name__}: {err}"

        threading.Thread(target=load, name="engine-load", daemon=True).start()

    def ready(self) -> AsyncEngine:
        if self.engine is None and self.load_error is not None:
            # Its own code: a caller waiting for readiness (a bench, a script) stops waiting on this.
            raise APIError(503, f"the engine failed to start: {self.load_error}", type_="server_error", code=ENGINE_FAILED)
        if self.engine is None:
            raise APIError(503, "the base model is still loading", type_="server_error", code="not_ready")
        return self.engine


def _server(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


def _engine(request: Request) -> AsyncEngine:
    return _server(request).ready()


async def _admin(request: Request) -> AsyncEngine:
    state = _server(request)
    await require_admin(request, state.admin_token, admin_hosts=state.admin_hosts)
    return state.ready()


async def _stats_reader(request: Request) -> AsyncEngine:
    """The admin token, or the stats token: what the router holds, which reads the replica's
    figures and can change nothing (least privilege for the pod every tenant's traffic crosses)."""
    state = _server(request)
    await require_admin(request, state.admin_token, reader_token=state.stats_token, admin_hosts=state.admin_hosts)
    return state.ready()


def _caller(request: Request) -> TenantConfig | None:
    return _server(request).tenants.authenticate(request.headers.get("authorization"))


Server = Annotated[ServerState, Depends(_server)]
Engine = Annotated[AsyncEngine, Depends(_engine)]
Admin = Annotated[AsyncEngine, Depends(_admin)]
StatsReader = Annotated[AsyncEngine, Depends(_stats_reader)]
Caller = Annotated[TenantConfig | None, Depends(_caller)]
