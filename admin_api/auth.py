"""Admin-token checks, shared by every server that takes an admin token (the replicas' admin API
and the node agent's).

Two forms are accepted. ``Bearer <token>`` is what a person or a script sends. The operator and
the router send a **signed request** instead (``SIGNED_SCHEME``): an HMAC-SHA256, keyed by the
token, over the method, the address the caller dialled, the path with its query, a timestamp and
the body's digest. The token itself never crosses the wire, so a pod that is not a replica (any
pod a namespace user labels like one, which the operator cannot tell apart) learns nothing it can
use: the signature is for its own address, one request, one minute. A replica that knows its own
address (``admin_hosts``: the operator passes the pod's IP) refuses a signature made for any
other, so a captured call cannot be replayed against the real replicas either.

Written here rather than taken from a library: HTTP Message Signatures (RFC 9421) would fit, but
no maintained Python implementation of it was in use here, and the scheme needs only the
standard library's ``hmac``; both ends live in this package.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

SIGNED_SCHEME = "Loraplane-HMAC-SHA256"
# A signed request older or newer than this is refused: the window a captured request could be
# replayed in against the same address (clocks within a cluster agree far better than this).
SIGNATURE_WINDOW_SECONDS = 60.0


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``token``, compared in constant time so the
    answer's timing tells nothing about how much of a guess was right."""
    return hmac.compare_digest((authorization or "").encode(), f"Bearer {token}".encode())


def _signature(token: str, method: str, host: str, target: str, body: bytes, at: int) -> str:
    message = "\n".join([method.upper(), host.lower(), target, str(at), hashlib.sha256(body).hexdigest()])
    return hmac.new(token.encode(), message.encode(), hashlib.sha256).hexdigest()


def sign_request(token: str, method: str, host: str, target: str, body: bytes, at: float | None = None) -> str:
    """The ``Authorization`` header for one request: ``host`` is the ``Host`` header the caller
    sends (host, and port unless the default), ``target`` the path with its query string."""
    stamp = int(time.time() if at is None else at)
    return f"{SIGNED_SCHEME} t={stamp},sig={_signature(token, method, host, target, body, stamp)}"


def signed_request_matches(
    authorization: str | None,
    token: str,
    *,
    method: str,
    host: str,
    target: str,
    body: bytes,
    admin_hosts: frozenset[str] = frozenset(),
    now: float | None = None,
) -> bool:
    """Whether ``authorization`` is a signature by ``token`` of this very request, made within
    SIGNATURE_WINDOW_SECONDS, for an address in ``admin_hosts`` (any address when empty; the
    port is not compared, since a Service or a port-forward may change it)."""
    scheme, _, params = (authorization or "").partition(" ")
    if scheme != SIGNED_SCHEME:
        return False
    fields = dict(part.partition("=")[::2] for part in params.split(","))
    stamp, signature = fields.get("t", ""), fields.get("sig", "")
    if not stamp.isdigit() or abs((time.time() if now is None else now) - int(stamp)) > SIGNATURE_WINDOW_SECONDS:
        return False
    if admin_hosts and _hostname(host) not in admin_hosts:
        return False
    return hmac.compare_digest(signature.encode(), _signature(token, method, host, target, body, int(stamp)).encode())


def _hostname(host: str) -> str:
    """``host[:port]`` without the port (an IPv6 literal keeps its brackets off)."""
    host = host.lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Request(Protocol):
    """What :func:`tokens_carried` reads of a request: Starlette's ``Request`` has it (this
    package stays free of the web framework; both servers pass theirs)."""

    @property
    def headers(self) -> Mapping[str, str]: ...
    @property
    def method(self) -> str: ...
    @property
    def scope(self) -> Mapping[str, Any]: ...
    async def body(self) -> bytes: ...


async def tokens_carried(request: Request, tokens: Iterable[str], admin_hosts: frozenset[str] = frozenset()) -> set[str]:
    """The ``tokens`` the request carries, as a bearer or as a signature of this very request.
    The body is read (to check its digest) only for a signed call."""
    authorization = request.headers.get("authorization")
    if not (authorization or "").startswith(SIGNED_SCHEME):
        return {t for t in tokens if bearer_matches(authorization, t)}
    scope = request.scope
    raw_path = scope.get("raw_path") or str(scope.get("path", "")).encode()
    query = scope.get("query_string", b"")
    target = raw_path.decode("latin-1") + (f"?{query.decode('latin-1')}" if query else "")
    method, host, body = request.method, request.headers.get("host", ""), await request.body()
    return {
        t
        for t in tokens
        if signed_request_matches(authorization, t, method=method, host=host, target=target, body=body, admin_hosts=admin_hosts)
    }
