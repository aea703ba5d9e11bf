"""The router's routes: OpenAI's generation routes admitted at the edge and forwarded (see
``edge``), the model list and vLLM's tokenizer routes asked of any replica that is up, health,
metrics, and the table."""

from __future__ import annotations

from urllib.parse import quote

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from loraplane.serving import __version__
from loraplane.serving.http.disconnect import cancel_on_disconnect
from loraplane.serving.http.errors import APIError, require_admin
from loraplane.serving.router.edge import forwarded_headers, relay, tokenizer_call
from loraplane.serving.router.state import RouterState, State

router = APIRouter()


def _no_replica() -> APIError:
    return APIError(503, "no serving replica is up", type_="server_error", code="no_replica", retry_after=1)


@router.post("/v1/completions")
@cancel_on_disconnect
async def completions(request: Request, state: State) -> Response:
    return await relay(state, request, "/v1/completions")


@router.post("/v1/chat/completions")
@cancel_on_disconnect
async def chat(request: Request, state: State) -> Response:
    return await relay(state, request, "/v1/chat/completions")


@router.post("/v1/responses")
@cancel_on_disconnect
async def responses(request: Request, state: State) -> Response:
    return await relay(state, request, "/v1/responses")


@router.get("/v1/responses/{response_id}")
async def stored_response(response_id: str, request: Request, state: State) -> Response:
    return await _ask_keeper(state, request, "GET", response_id)


@router.get("/v1/responses/{response_id}/input_items")
async def stored_input_items(response_id: str, request: Request, state: State) -> Response:
    return await _ask_keeper(state, request, "GET", response_id, "/input_items")


@router.delete("/v1/responses/{response_id}")
async def delete_stored_response(response_id: str, request: Request, state: State) -> Response:
    return await _ask_keeper(state, request, "DELETE", response_id)


async def _ask_keeper(state: RouterState, request: Request, method: str, response_id: str, then: str = "") -> Response:
    """A stored response's call (``then``: a path under it), at the replica that keeps it (known,
    or found by asking each), with the caller's key and query: a replica answers only for the
    caller's own responses."""
    state.tenants.authenticate(request.headers.get("authorization"))
    forward = state.forward()
    path = f"/v1/responses/{quote(response_id, safe='')}{then}" + (f"?{request.url.query}" if request.url.query else "")
    found = await forward.ask_each(method, path, forwarded_headers(request), forward.homes.home(response_id))
    if found is None:
        raise _no_replica()
    replica, answer = found
    if answer.status_code == 200 and method == "GET":
        forward.homes.learn(response_id, replica.name)
    elif answer.status_code == 200:
        forward.homes.forget(response_id)
    return Response(answer.content, status_code=answer.status_code, media_type="application/json")


async def _ask_any(state: RouterState, request: Request, path: str, body: bytes | None = None) -> Response:
    state.tenants.authenticate(request.headers.get("authorization"))
    r = await state.forward().ask_any(path, forwarded_headers(request), body)
    if r is None:
        raise _no_replica()
    return Response(r.content, status_code=r.status_code, media_type="application/json")


@router.get("/v1/models")
async def models(request: Request, state: State) -> Response:
    return await _ask_any(state, request, "/v1/models")


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request, state: State) -> Response:
    return await _ask_any(state, request, f"/v1/models/{quote(model, safe='')}")


@router.post("/tokenize")
@cancel_on_disconnect
async def tokenize(request: Request, state: State) -> Response:
    """vLLM's tokenizer routes: any replica answers (one base, one tokenizer), which checks the
    caller's key and model again; the edge admits them first against the tenant's quotas, as a
    generation (``edge.tokenizer_call``)."""
    return await tokenizer_call(state, request, "/tokenize")


@router.post("/detokenize")
@cancel_on_disconnect
async def detokenize(request: Request, state: State) -> Response:
    return await tokenizer_call(state, request, "/detokenize")


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready")
async def ready(state: State) -> dict[str, object]:
    if not state.table.up():
        raise _no_replica()
    return {"status": "ready", "replicas": len(state.table.up())}


@router.get("/metrics")
async def prometheus(request: Request, state: State) -> Response:
    """Admin token only where tenants are set (the series name them); see metrics_port."""
    if not state.tenants.open:
        await require_admin(request, state.admin_token)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/router/replicas")
async def replicas(request: Request, state: State) -> dict[str, object]:
    await require_admin(request, state.admin_token)
    table = sorted(state.table.replicas.values(), key=lambda r: r.name)
    return {"policy": state.config.policy, "epsilon": state.config.epsilon, "replicas": [r.view() for r in table]}
