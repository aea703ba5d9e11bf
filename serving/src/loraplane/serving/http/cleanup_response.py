"""A streamed response that runs its cleanup however the connection ends.

Starlette may never iterate the body of a response whose client left before it started (the
disconnect can cancel the response before its first iteration), an async generator that never
started never runs its ``finally``, and a body Starlette stopped sending (a failed send) is left
suspended at its ``yield``, not closed. Cleanup written only in the body would then leak what the
request holds: a replica's quota slot, pending count and engine sequences, a router's reservation
and in-flight count. The cleanup here runs after the response in every case; it must be
idempotent, since the body's own ``finally`` usually runs it first, and synchronous, since a
disconnect may cancel any await in its place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class CleanupResponse(StreamingResponse):
    def __init__(self, content: Any, cleanup: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.cleanup()
