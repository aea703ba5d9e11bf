"""A pod posing as a replica or a node agent: it wears the labels, so it is called, and it answers
one path with a copy of a real answer, the real server's signature header included. What the
callers must still refuse (``admin_api.auth``: that signature was for another call)."""

from __future__ import annotations

import httpx
from fastapi import FastAPI, Response  # at module level: FastAPI resolves the routes' annotations here


def copying_app(ready_path: str, path: str, answer: httpx.Response) -> FastAPI:
    """Ready at ``ready_path``; ``GET path`` gives ``answer`` again, headers and all."""
    copied = {k: v for k, v in answer.headers.items() if k.lower() not in ("content-length", "date", "server")}
    app = FastAPI()

    async def ready() -> dict[str, str]:
        return {"status": "ok"}

    async def replay() -> Response:
        return Response(answer.content, headers=copied)

    app.add_api_route(ready_path, ready, methods=["GET"])
    app.add_api_route(path, replay, methods=["GET"])
    return app
