"""A TCP proxy on loopback that a test can take down and bring back, cutting every connection
through it: an object store that goes away mid-upload and returns with its data intact (moto
itself keeps its data only while its process lives, so it stays up behind the proxy). It counts
the connections and bytes through it, so a test can say a process read nothing from the store,
and it can trickle the store's bytes, as a store on a congested link does."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from loraplane.serving.http.loopback import free_port


class FlakyProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port, self.port = target_port, free_port()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.cut = 0  # connections cut while open (requests in flight among them)
        self.connections = 0  # connections made through the proxy to the target
        self.bytes_from_target = 0  # bytes the target sent back (what its clients read)
        self.trickle: int | None = None  # when set, the target's bytes reach clients this many every 0.1 s
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        """Stop listening and cut every connection in flight."""
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
            self.cut += len(conns) // 2
        if listener is not None:
            # shutdown first: close alone leaves a thread blocked in accept() holding the socket,
            # still listening on the port, and the next up() cannot bind it.
            with suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for conn in conns:
            with suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, server]
                self.connections += 1
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b, b is client), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        try:
            while data := src.recv(65536):
                while counted and self.trickle is not None and len(data) > self.trickle:
                    dst.sendall(data[: self.trickle])
                    data = data[self.trickle :]
                    time.sleep(0.1)
                dst.sendall(data)
                if counted:
                    with self._lock:
                        self.bytes_from_target += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


@contextmanager
def flaky_proxy(target_url: str) -> Iterator[FlakyProxy]:
    proxy = FlakyProxy(int(target_url.rsplit(":", 1)[1]))
    try:
        yield proxy
    finally:
        proxy.down()
