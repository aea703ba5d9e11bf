"""``cancel_on_disconnect`` at the ASGI level, for the races the servers' tests cannot time: a
handler that returns although its cancel landed (its response carries its cleanup, so it must
be kept), and a connection that cannot be watched (the handler then runs to its end)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from loraplane.serving.http.disconnect import CLIENT_CLOSED_REQUEST, cancel_on_disconnect


def request_with(receive: Any) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


def body_then(after: Callable[[], Awaitable[dict[str, Any]]]) -> Any:
    """An ASGI receive: the whole body, then whatever ``after`` gives (or raises) at each call."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        return await after()

    return receive


def leaves_after(seconds: float) -> Any:
    """The client leaves ``seconds`` after sending its body."""

    async def leave() -> dict[str, Any]:
        await asyncio.sleep(seconds)
        return {"type": "http.disconnect"}

    return body_then(leave)


def test_a_handler_whose_client_leaves_is_cancelled_and_its_cleanup_has_run() -> None:
    cleaned: list[str] = []

    @cancel_on_disconnect
    async def handler(request: Request) -> str:
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.01)  # cleanup that awaits still completes before the route returns
            cleaned.append("done")
        return "answer"

    result = asyncio.run(asyncio.wait_for(handler(request_with(leaves_after(0.05))), 5))
    assert isinstance(result, Response) and result.status_code == CLIENT_CLOSED_REQUEST
    assert cleaned == ["done"]


def test_a_handler_that_returns_despite_its_cancel_keeps_its_response() -> None:
    """A cancel can land as the work ends (``asyncio.wait_for`` then returns the result): the
    response is what closes a stream's request once sent, so dropping it would leak the request."""
    response = Response("streamed answer")

    @cancel_on_disconnect
    async def handler(request: Request) -> Response:
        with contextlib.suppress(asyncio.CancelledError):  # as a finished inner await would
            await asyncio.sleep(60)
        return response

    assert asyncio.run(handler(request_with(leaves_after(0.05)))) is response


def test_a_connection_that_cannot_be_watched_lets_the_handler_finish() -> None:
    async def unavailable() -> dict[str, Any]:
        raise RuntimeError("receive is not available here")

    @cancel_on_disconnect
    async def handler(request: Request) -> str:
        await asyncio.sleep(0.1)
        return "answer"

    assert asyncio.run(handler(request_with(body_then(unavailable)))) == "answer"
