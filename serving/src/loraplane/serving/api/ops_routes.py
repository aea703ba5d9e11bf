"""What Kubernetes and Prometheus call: ``/health`` (liveness, at once), ``/ready`` (readiness,
once the base is in memory) and ``/metrics``; and vLLM's ``/version``."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from loraplane.serving import __version__
from loraplane.serving.api.deps import Server
from loraplane.serving.http.errors import require_admin

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/version")
async def version() -> dict[str, str]:
    """vLLM's: the server's version, for clients and dashboards that check what they talk to."""
    return {"version": __version__}


@router.get("/ready")
async def ready(server: Server) -> dict[str, str]:
    server.ready()
    return {"status": "ready"}


@router.get("/metrics")
async def metrics(request: Request, server: Server) -> Response:
    """Open on an open server, as vLLM's; with tenants the series would show every tenant's
    adapters to any of them, so only the admin token reads them here (Prometheus scrapes the
    metrics port)."""
    if not server.tenants.open:
        await require_admin(request, server.admin_token, admin_hosts=server.admin_hosts)
    return Response(generate_latest(request.app.state.metrics), media_type=CONTENT_TYPE_LATEST)
