"""The serving replicas' admin API as the operator calls it (the contract `tests/operator` checks
against a real server). Plain httpx: the operator never imports the engine."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

import httpx

from loraplane.usage import UsageRollup


class ReplicaError(RuntimeError):
    """A replica answered with an error; ``status`` is its HTTP status (None when unreachable)."""

    def __init__(self, replica: str, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(f"{replica}: {message}")
        self.status, self.code = status, code


_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = weakref.WeakKeyDictionary()


def _pool() -> httpx.AsyncClient:
    """One connection pool per event loop for every admin call the operator makes. A client per
    reconcile would build a TLS context each time; with a fleet of 2,000 adapters reconciling at
    once that took gigabytes and most of a core before the first adapter was Ready."""
    loop = asyncio.get_running_loop()
    pool = _POOLS.get(loop)
    if pool is None or pool.is_closed:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
        pool = _POOLS[loop] = httpx.AsyncClient(limits=limits)
    return pool


class ServingClient:
    def __init__(self, url: str, admin_token: str | None = None, timeout: float = 30.0) -> None:
        self.url, self.timeout = url.rstrip("/"), timeout
        self.headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}

    async def close(self) -> None:
        """Nothing to release: the connections belong to the shared pool."""

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        # The timeout starts once a connection is ours: waiting for one of the pool's connections is
        # the operator's own queue, not the replica failing. With a pool timeout, a fleet of 2,000
        # adapters created at once against a real API server (fast enough to start every reconcile
        # together) timed out in the queue, retried, and turned into a retry storm of Events.
        timeout = httpx.Timeout(self.timeout, pool=None)
        try:
            r = await _pool().request(method, f"{self.url}{path}", json=body, headers=self.headers, timeout=timeout)
        except httpx.HTTPError as err:
            raise ReplicaError(self.url, f"unreachable: {type(err).__name__}: {err}") from None
        if r.status_code >= 400:
            try:
                error = r.json().get("error", {})
            except ValueError:
                error = {}
            raise ReplicaError(self.url, error.get("message", r.text), r.status_code, error.get("code"))
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text

    async def usage(self) -> UsageRollup:
        """This replica's per-tenant totals of the last day and its export backlog."""
        return UsageRollup.model_validate(await self._call("GET", "/admin/usage"))

    async def base(self) -> dict[str, Any]:
        """The base this replica serves: name, revision, fingerprint and shape."""
        result: dict[str, Any] = await self._call("GET", "/admin/base")
        return result

    async def register(
        self, name: str, uri: str, digest: str, tenant: str, *, truncate: bool = False, quotas: dict[str, int] | None = None
    ) -> dict[str, Any]:
        body = {"lora_name": name, "lora_path": uri, "digest": digest, "tenant": tenant, "allow_rank_truncation": truncate}
        body["quotas"] = quotas or None
        result: dict[str, Any] = await self._call("POST", "/admin/adapters", body)
        return result

    async def verify(
        self, uri: str, digest: str, *, truncate: bool, min_token_agreement: float, max_mean_kl: float
    ) -> dict[str, Any]:
        """Replay a candidate's golden outputs on this replica's base (the quality gate)."""
        body = {"lora_path": uri, "digest": digest, "allow_rank_truncation": truncate,
                "min_token_agreement": min_token_agreement, "max_mean_kl": max_mean_kl}  # fmt: skip
        result: dict[str, Any] = await self._call("POST", "/admin/verify", body)
        return result

    async def action(self, name: str, action: str) -> dict[str, Any]:
        """``prefetch``, ``pin`` or ``unpin``."""
        result: dict[str, Any] = await self._call("POST", f"/admin/adapters/{name}/{action}")
        return result

    async def unregister(self, name: str) -> None:
        try:
            await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        except ReplicaError as err:
            if err.status != 404:  # already gone is what we wanted
                raise

    async def state(self, name: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = await self._call("GET", f"/admin/adapters/{name}")
        except ReplicaError as err:
            if err.status == 404:
                return None
            raise
        return result

    async def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", "/admin/stats")
        return result
