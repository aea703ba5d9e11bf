"""Cancel a generation handler whose client has gone before its response started.

Starlette cancels nothing when a client disconnects while a handler is still awaiting: a replica
computing a whole non-streamed answer, or the first token of a queued stream, and a router
awaiting a replica's answer, would run on for nobody, holding the tenant's concurrency slot and
token reservation, the engine's sequences and KV blocks, and on the router the connection that
keeps the replica's request alive. vLLM's API server has the same rule (its ``with_cancellation``):
the handler races the connection's ``http.disconnect`` and is cancelled when that comes first. Its
own cleanup then runs as for any cancellation (``Choices.close`` on a replica, the edge's
reservation on the router). Once a response has started, Starlette's ``StreamingResponse``
watches the connection itself and closes the body.

Written here rather than taken from a library: Starlette and FastAPI offer only a polling
``Request.is_disconnected``, and the race needs the ASGI message itself.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

P = ParamSpec("P")
T = TypeVar("T")

# What a handler whose client left returns: nobody reads it (nginx's "client closed request").
CLIENT_CLOSED_REQUEST = 499


async def _disconnected(request: Request) -> bool:
    """Returns True once the client has disconnected (the body has been read already); False if
    the connection cannot be watched, and then the handler runs to its end as without the watch."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:
        return False
    return True


def cancel_on_disconnect(handler: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T | Response]]:
    """Run ``handler`` (a route with a ``starlette.requests.Request`` among its parameters) until
    it returns or its client disconnects, whichever comes first; in the second case it is
    cancelled, and its cleanup has run when the route returns."""

    @functools.wraps(handler)
    async def watched(*args: P.args, **kwargs: P.kwargs) -> T | Response:
        request = next((a for a in (*args, *kwargs.values()) if isinstance(a, Request)), None)
        if request is None:
            raise TypeError(f"{handler.__qualname__} needs a starlette Request parameter to watch its client")
        try:
            await request.body()  # read (and kept) before the watch, which reads what comes after it
        except ClientDisconnect:  # gone in the middle of its body: nothing was started
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        work = asyncio.ensure_future(handler(*args, **kwargs))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
            if work not in done and not gone.result():  # unwatchable: as if there were no watch
                await asyncio.wait((work,))
                done = {work}
        except BaseException:  # cancelled itself (the server stops): so is the work
            work.cancel()
            raise
        finally:
            gone.cancel()
        if work in done:
            return work.result()
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)  # its cleanup, whatever it raises
        if not work.cancelled() and work.exception() is None:
            # It returned all the same (a cancel can land as it ends): its response carries the
            # cleanup (a streamed body closes its request when the send fails), so it must run.
            return work.result()
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    return watched
