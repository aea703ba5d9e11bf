"""What one router holds, shared by its routes: its settings, the replica table, tenants and
quotas, the usage meter for the requests it refuses itself, its metrics, and (once started) the
forwarder with its connection pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from loraplane.serving.http.tenants import Tenants
from loraplane.serving.router.config import RouterConfig
from loraplane.serving.router.forward import Forwarder
from loraplane.serving.router.metrics import RouterMetrics
from loraplane.serving.router.table import ReplicaTable
from loraplane.usage import Metering


@dataclass
class RouterState:
    config: RouterConfig
    table: ReplicaTable
    metrics: RouterMetrics
    tenants: Tenants
    meters: Metering
    admin_token: str | None
    forwarder: Forwarder | None = None  # set by the lifespan, with the connection pool

    def forward(self) -> Forwarder:
        assert self.forwarder is not None, "the router's lifespan has not started"
        return self.forwarder


def _state(request: Request) -> RouterState:
    state: RouterState = request.app.state.router
    return state


State = Annotated[RouterState, Depends(_state)]
