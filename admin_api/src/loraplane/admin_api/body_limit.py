"""A cap on request body bytes, answered with a 413 before the body is parsed: for every HTTP
server of ours (the replica's and the router's OpenAI API, with OpenAI's error body; the node
agent's API, which otherwise read a body before checking who sent it).

Pure ASGI rather than a FastAPI dependency: the dependency would run after Starlette had already
read the whole body into memory, which is what the cap is for. Both a declared
``Content-Length`` above the cap and a chunked body that grows past it are refused; the bytes
beyond the cap are never read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

DEFAULT_MAX_BODY_BYTES = 8 << 20  # a 128k-token prompt as text is about 0.5 MB; token ids a few MB


def detail(message: str) -> dict[str, Any]:
    """FastAPI's own error shape, for APIs that are not OpenAI's."""
    return {"detail": message}


class BodyLimit:
    """``refusal``: the 413's JSON body for a message (FastAPI's ``detail`` shape by default)."""

    def __init__(self, app: Any, max_bytes: int = DEFAULT_MAX_BODY_BYTES, refusal: Callable[[str], Any] = detail) -> None:
        self.app, self.max_bytes, self.refusal = app, max_bytes, refusal

    async def _refuse(self, send: Any) -> None:
        body = json.dumps(self.refusal(f"the request body is larger than {self.max_bytes} bytes")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        if declared is not None:
            await self.app(scope, receive, send)  # the server reads no more than it declared
            return
        # Chunked: read it here, at most the cap, and hand the app the whole body at once. Refusing
        # from inside the app would be too late: the framework turns a failed body read into a 400.
        parts: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            parts.append(message.get("body", b""))
            seen += len(parts[-1])
            if seen > self.max_bytes:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(parts), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)


def _replay(messages: list[Any], receive: Any) -> Any:
    async def replayed() -> Any:
        return messages.pop(0) if messages else await receive()

    return replayed
