"""Servers on loopback: a free port, and an ASGI app served by uvicorn in a thread.

The tests, `loraplane bench` and `loraplane demo` all run the real server this way, over real sockets.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_app(app: object, ready_path: str = "/ready", timeout: float = 60.0) -> Iterator[str]:
    """Yields the base URL once ``ready_path`` answers 200; stops the server afterwards."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}{ready_path}").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}{ready_path} did not answer 200 within {timeout:.0f} s")
        time.sleep(0.1)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
