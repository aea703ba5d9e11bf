"""A small async client of the replicas' admin API, used by the operator and the router.

Plain httpx rather than a generated client: the contract is a handful of calls whose bodies are
the models in ``models``, and the callers need control of pooling and timeouts (see ``shared_pool``).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Generator
from typing import Any

import httpx
from pydantic import BaseModel

from loraplane.adapter_format import BaseShape
from loraplane.adapter_format.golden import DriftReport
from loraplane.admin_api.auth import RESPONSE_HEADER, response_signed, sign_request
from loraplane.admin_api.models import (
    VERIFY_DEADLINE_SECONDS,
    LoadLoraRequest,
    NamedAdapterState,
    ReplicaStats,
    UnloadLoraRequest,
    VerifyRequest,
)
from loraplane.usage import UsageRollup

UNPROVEN = "unproven_replica"  # ReplicaError.code when an answer was not signed by the token's holder


class ReplicaError(RuntimeError):
    """A replica answered with an error; ``status`` is its HTTP status (None when unreachable)."""

    def __init__(self, replica: str, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(f"{replica}: {message}")
        self.status, self.code = status, code


_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = weakref.WeakKeyDictionary()


def shared_pool() -> httpx.AsyncClient:
    """One connection pool per event loop for every admin call a process makes. A client per
    reconcile would build a TLS context each time; with a fleet of 2,000 adapters reconciling at
    once that took gigabytes and most of a core before the first adapter was Ready."""
    loop = asyncio.get_running_loop()
    pool = _POOLS.get(loop)
    if pool is None or pool.is_closed:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
        pool = _POOLS[loop] = httpx.AsyncClient(limits=limits)
    return pool


class UnsignedAnswer(httpx.HTTPError):
    """An answer below 400 without the token holder's signature of it: whatever answered at that
    address is not a replica (or an agent) of this base, so nothing it says is believed."""


class SignedAuth(httpx.Auth):
    """Signs each request with the admin token instead of sending it (see ``auth``): the replica
    verifies the signature, and whatever answers at the address learns nothing reusable. Every
    answer below 400 must be signed back by the token's holder (``UnsignedAnswer`` otherwise; a
    redirect too, since these clients do not follow one and the callers read its body); error
    answers are not checked, since the server cannot sign the ones it gives before it knows the
    caller (a 401, a body over its size cap), and an error grants nothing."""

    requires_request_body = True
    requires_response_body = True

    def __init__(self, token: str) -> None:
        self.token = token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        host = request.headers.get("host") or request.url.netloc.decode("ascii")
        target = request.url.raw_path.decode("ascii")
        authorization = request.headers["Authorization"] = sign_request(self.token, request.method, host, target, request.content)
        response = yield request
        if response.status_code < 400 and not response_signed(
            response.headers.get(RESPONSE_HEADER), self.token, authorization, response.status_code, response.content
        ):
            raise UnsignedAnswer(f"{request.url.netloc.decode('ascii')} answered without the token holder's signature")


class AdminClient:
    """One replica's admin API. ``http`` is the connection pool to use (by default one shared per
    event loop); ``timeout`` counts from when a connection is ours."""

    def __init__(
        self, url: str, admin_token: str | None = None, timeout: float = 30.0, *, http: httpx.AsyncClient | None = None
    ) -> None:
        self.url, self.timeout, self.http = url.rstrip("/"), timeout, http
        self.auth = SignedAuth(admin_token) if admin_token else None

    async def _call(
        self, method: str, path: str, body: BaseModel | None = None, *, signed: bool = True, seconds: float | None = None
    ) -> Any:
        """``seconds``: this call's own read timeout, for a call the replica works on for longer."""
        # Waiting for one of the pool's connections is the caller's own queue, not the replica
        # failing. With a pool timeout, a fleet of 2,000 adapters created at once against a real API
        # server timed out in the queue, retried, and turned into a retry storm of Events.
        timeout = httpx.Timeout(self.timeout if seconds is None else seconds, pool=None)
        payload = body.model_dump(mode="json", exclude_none=True) if body is not None else None
        try:
            r = await (self.http or shared_pool()).request(
                method,
                f"{self.url}{path}",
                json=payload,
                auth=(self.auth if signed else None) or httpx.USE_CLIENT_DEFAULT,
                timeout=timeout,
            )
        except UnsignedAnswer as err:
            raise ReplicaError(self.url, f"not a replica of this base: {err}", code=UNPROVEN) from None
        except httpx.HTTPError as err:
            raise ReplicaError(self.url, f"unreachable: {type(err).__name__}: {err}") from None
        if not r.is_success:  # a redirect included: not followed, and not an answer
            try:
                body = r.json()
            except ValueError:
                body = None
            found = body.get("error") if isinstance(body, dict) else None
            error: dict[str, Any] = found if isinstance(found, dict) else {}
            raise ReplicaError(self.url, str(error.get("message", r.text)), r.status_code, error.get("code"))
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text

    async def ready(self) -> bool:
        """Whether the replica has its base loaded (``/ready``: open to anyone, so unsigned, and
        no proof of who answered; see ``proven``)."""
        try:
            await self._call("GET", "/ready", signed=False)
        except ReplicaError as err:
            if err.status is None:
                raise
            return False
        return True

    async def proven(self) -> bool | None:
        """Whether the pod at this address holds the admin token: True when it signed its answer
        to a signed call, False when it answered without that signature or refused the token, None
        when it could not say (unreachable, still loading its base, an error; a pod posing as a
        replica can answer with errors too, so None proves nothing). Asked before anything is sent
        that such a pod should not read."""
        try:
            await self._call("GET", "/admin/base")
        except ReplicaError as err:
            if err.code == UNPROVEN or err.status in (401, 403):
                return False
            return None
        return True

    async def usage(self) -> UsageRollup:
        """This replica's per-tenant totals of the last day and its export backlog."""
        return UsageRollup.model_validate(await self._call("GET", "/admin/usage"))

    async def base(self) -> BaseShape:
        """The base this replica serves: name, revision, fingerprint and shape."""
        return BaseShape.model_validate(await self._call("GET", "/admin/base"))

    async def register(self, req: LoadLoraRequest) -> NamedAdapterState:
        """Declare an adapter (or a new version of one) without loading it."""
        return NamedAdapterState.model_validate(await self._call("POST", "/admin/adapters", req))

    async def verify(self, req: VerifyRequest) -> DriftReport:
        """Replay a candidate's golden outputs on this replica's base (the quality gate). Waits
        as long as the replica may work on it: giving up sooner would leave the replay running
        there and start another on the retry."""
        report = await self._call("POST", "/admin/verify", req, seconds=VERIFY_DEADLINE_SECONDS + 30)
        return DriftReport.model_validate(report)

    async def action(self, name: str, action: str) -> NamedAdapterState:
        """``prefetch``, ``pin`` or ``unpin``."""
        return NamedAdapterState.model_validate(await self._call("POST", f"/admin/adapters/{name}/{action}"))

    async def unregister(self, name: str) -> None:
        try:
            await self._call("POST", "/v1/unload_lora_adapter", UnloadLoraRequest(lora_name=name))
        except ReplicaError as err:
            if err.status != 404:  # already gone is what we wanted
                raise

    async def state(self, name: str) -> NamedAdapterState | None:
        try:
            result = await self._call("GET", f"/admin/adapters/{name}")
        except ReplicaError as err:
            if err.status == 404:
                return None
            raise
        return NamedAdapterState.model_validate(result)

    async def stats(self) -> ReplicaStats:
        return ReplicaStats.model_validate(await self._call("GET", "/admin/stats"))
