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

The answer is signed back (``RESPONSE_HEADER``): the server keys an HMAC by the token the call
was signed with, over the call's own signature, the status and the body's digest. A caller that
checks it (``client.SignedAuth``) learns that it is talking to a holder of the token, which no
label can fake: the operator proves a pod this way before it sends the pod anything (the adapter
sources it registers), and the router before it routes a tenant's prompt there.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from typing import Any, Protocol

SIGNED_SCHEME = "Loraplane-HMAC-SHA256"
# A signed request older or newer than this is refused: the window a captured request could be
# replayed in against the same address (clocks within a cluster agree far better than this).
SIGNATURE_WINDOW_SECONDS = 60.0
RESPONSE_HEADER = "Loraplane-Response-Signature"
# Where a checked signed call leaves (token, its Authorization header) in the ASGI scope, for
# SignedResponses to sign the answer with.
_SIGNER_KEY = "loraplane.signer"


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


def sign_response(token: str, authorization: str, status: int, body: bytes) -> str:
    """The ``RESPONSE_HEADER`` value for the answer to the call signed by ``authorization``: bound
    to that call, so an answer cannot be replayed to another."""
    message = "\n".join(["response", authorization, str(status), hashlib.sha256(body).hexdigest()])
    return "sig=" + hmac.new(token.encode(), message.encode(), hashlib.sha256).hexdigest()


def response_signed(header: str | None, token: str, authorization: str, status: int, body: bytes) -> bool:
    """Whether ``header`` is the holder of ``token``'s signature of this answer to this call."""
    return hmac.compare_digest((header or "").encode(), sign_response(token, authorization, status, body).encode())


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
    def scope(self) -> MutableMapping[str, Any]: ...
    async def body(self) -> bytes: ...


async def tokens_carried(request: Request, tokens: Iterable[str], admin_hosts: frozenset[str] = frozenset()) -> set[str]:
    """The ``tokens`` the request carries, as a bearer or as a signature of this very request.
    The body is read (to check its digest) only for a signed call, and the token that signed it
    is left in the scope for :class:`SignedResponses` to sign the answer with."""
    authorization = request.headers.get("authorization")
    if not (authorization or "").startswith(SIGNED_SCHEME):
        return {t for t in tokens if bearer_matches(authorization, t)}
    scope = request.scope
    raw_path = scope.get("raw_path") or str(scope.get("path", "")).encode()
    query = scope.get("query_string", b"")
    target = raw_path.decode("latin-1") + (f"?{query.decode('latin-1')}" if query else "")
    method, host, body = request.method, request.headers.get("host", ""), await request.body()
    found = {
        t
        for t in tokens
        if signed_request_matches(authorization, t, method=method, host=host, target=target, body=body, admin_hosts=admin_hosts)
    }
    if found:
        scope[_SIGNER_KEY] = (next(iter(found)), authorization)
    return found


_Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
_Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
_App = Callable[[MutableMapping[str, Any], _Receive, _Send], Awaitable[None]]


class SignedResponses:
    """ASGI middleware that signs the answer to every call whose signature was checked (see
    :func:`tokens_carried`). Only those answers are held until their last byte, to be hashed:
    admin answers are small JSON, and every other answer passes through untouched.

    Plain ASGI rather than a framework's middleware class, so this package stays free of the web
    framework and the replicas and the node agent share one implementation."""

    def __init__(self, app: _App) -> None:
        self.app = app

    async def __call__(self, scope: MutableMapping[str, Any], receive: _Receive, send: _Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start: MutableMapping[str, Any] | None = None
        chunks: list[bytes] = []

        async def signing_send(message: MutableMapping[str, Any]) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and _SIGNER_KEY in scope:
                start = message  # held: the header needs the whole body
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body, (token, authorization) = b"".join(chunks), scope[_SIGNER_KEY]
            signature = sign_response(token, authorization, start["status"], body)
            headers = [*start.get("headers", []), (RESPONSE_HEADER.lower().encode(), signature.encode())]
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, signing_send)
