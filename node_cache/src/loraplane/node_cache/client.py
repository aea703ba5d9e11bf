"""Clients of the node agent's API: a blocking one for a serving pod's loader threads and an async
one for the operator. Plain httpx, as the admin client, for the same reasons (a handful of calls
whose bodies are ``models``; timeouts the callers choose)."""

from __future__ import annotations

from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from loraplane.adapter_format import AdapterValidationError, ErrorCode
from loraplane.admin_api.client import SignedAuth, UnsignedAnswer, shared_pool
from loraplane.node_cache.models import Acquired, AcquireRequest, NodeCacheState, PinsRequest, ReleaseRequest, StagingRequest

_Model = TypeVar("_Model", bound=BaseModel)


class AgentUnavailable(RuntimeError):
    """The agent did not answer, or answered that the fetch failed for a reason that may pass;
    ``status`` is the HTTP status it answered with (None when it did not answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class NotTheAgent(AgentUnavailable):
    """What answered at the agent's address did not sign its answer with the token: a pod posing
    as the agent (``admin_api.auth``). Nothing it said is believed."""


def _raise_for(response: httpx.Response, url: str) -> None:
    if response.is_success:
        return
    try:
        detail: Any = response.json().get("detail")
    except ValueError:
        detail = response.text[:512]
    if response.status_code == 422 and isinstance(detail, dict) and detail.get("code") in ErrorCode._value2member_map_:
        raise AdapterValidationError(ErrorCode(detail["code"]), str(detail.get("message", "")))
    message = detail.get("message", detail) if isinstance(detail, dict) else detail
    raise AgentUnavailable(f"node agent {url}: {response.status_code} {message}", response.status_code)


def _read(model: type[_Model], response: httpx.Response, url: str) -> _Model:
    """A reply as its model; one that is not (a proxy's page, another version's garbage) is the
    agent being unavailable, not a crash of the caller."""
    try:
        return model.model_validate(response.json())
    except ValueError as err:  # JSONDecodeError and pydantic's ValidationError both are
        raise AgentUnavailable(f"node agent {url}: an answer that is not a {model.__name__}: {str(err)[:256]}") from None


class AgentClient:
    """A serving pod's calls: each one a short request but ``acquire``, which waits for a fetch."""

    def __init__(self, url: str, token: str | None, *, fetch_timeout: float = 900.0) -> None:
        self.url = url.rstrip("/")
        # Signed, not sent (admin_api.auth): a pod posing as the agent learns no token.
        self.http = httpx.Client(auth=SignedAuth(token) if token else None, timeout=httpx.Timeout(10.0))
        self.fetch_timeout = fetch_timeout

    def _call(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> httpx.Response:
        payload = body.model_dump(mode="json", exclude_none=True) if body is not None else None
        try:
            response = self.http.request(method, self.url + path, json=payload, timeout=timeout or httpx.USE_CLIENT_DEFAULT)
        except UnsignedAnswer as err:
            raise NotTheAgent(f"node agent {self.url}: {err}") from None
        except httpx.HTTPError as err:
            raise AgentUnavailable(f"node agent {self.url}: {type(err).__name__}: {err}") from None
        _raise_for(response, self.url)
        return response

    def acquire(self, source: str, digest: str | None) -> Acquired:
        request = AcquireRequest(source=source, digest=digest)
        return _read(Acquired, self._call("POST", "/v1/acquire", request, self.fetch_timeout), self.url)

    def release(self, lease: str) -> None:
        self._call("POST", "/v1/release", ReleaseRequest(lease=lease))

    def set_pins(self, client: str, sources: list[str]) -> None:
        self._call("PUT", "/v1/pins", PinsRequest(client=client, sources=sources))

    def state(self) -> NodeCacheState:
        return _read(NodeCacheState, self._call("GET", "/v1/state"), self.url)

    def close(self) -> None:
        self.http.close()


class AsyncAgentClient:
    """The operator's calls to one node's agent, on the process's shared connection pool (the one
    its admin calls use)."""

    def __init__(self, url: str, token: str | None, timeout: float = 10.0) -> None:
        self.url, self.timeout = url.rstrip("/"), timeout
        self.auth = SignedAuth(token) if token else None

    async def _call(self, method: str, path: str, body: Any = None) -> httpx.Response:
        payload = body.model_dump(mode="json", exclude_none=True) if body is not None else None
        try:
            response = await shared_pool().request(
                method, self.url + path, json=payload, auth=self.auth or httpx.USE_CLIENT_DEFAULT, timeout=self.timeout
            )
        except UnsignedAnswer as err:
            raise NotTheAgent(f"node agent {self.url}: {err}") from None
        except httpx.HTTPError as err:
            raise AgentUnavailable(f"node agent {self.url}: {type(err).__name__}: {err}") from None
        _raise_for(response, self.url)
        return response

    async def proven(self) -> bool | None:
        """As ``AdminClient.proven``: whether the pod at this address holds the operator's token."""
        try:
            await self._call("GET", "/v1/state")
        except NotTheAgent:
            return False
        except AgentUnavailable as err:
            return False if err.status in (401, 403) else None
        return True

    async def stage(self, request: StagingRequest) -> None:
        await self._call("PUT", "/v1/staging", request)

    async def state(self) -> NodeCacheState:
        return _read(NodeCacheState, await self._call("GET", "/v1/state"), self.url)
