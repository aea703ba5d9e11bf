"""A cap on request body bytes, answered with an OpenAI-shaped 413 before the body is parsed.

Pure ASGI rather than a FastAPI dependency: the dependency would run after Starlette had already
read the whole body into memory, which is what the cap is for. Both a declared
``Content-Length`` above the cap and a chunked body that grows past it are refused; the bytes
beyond the cap are never read.
"""

from __future__ import annotations

import json
from typing import Any

from loraplane.serving.http.errors import error_body

DEFAULT_MAX_BODY_BYTES = 8 << 20  # a 128k-token prompt as text is about 0.5 MB; token ids a few MB


class BodyLimit:
    def __init__(self, app: Any, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def _refuse(self, send: Any) -> None:
        body = json.dumps(error_body(f"the request body is larger than {self.max_bytes} bytes", "invalid_request_error",
                                     "request_too_large")).encode()  # fmt: skip
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
