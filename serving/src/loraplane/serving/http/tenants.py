"""API keys, tenants and quotas (usage records live in ``loraplane.usage``).

Keys map to tenants through a file (YAML or JSON, e.g. a mounted Secret). With no file the server
is open: one anonymous tenant sees everything. With one, every API call needs a key; a tenant
sees and calls only its own adapters, adapters registered without a tenant (shared ones), and the
base if ``allow_base``. Another tenant's adapter answers exactly as a missing one does, so its
existence does not leak.

Quotas answer 429 with ``Retry-After``: concurrent requests, and tokens per minute (prompt plus
completion tokens of the requests finished in the last 60 seconds), per tenant from the file and
per adapter from its registration (a LoraAdapter's ``spec.quotas``), so one hot fine-tune cannot
use its whole tenant's share.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field

from loraplane.adapter_format.names import INTERNAL_OWNER
from loraplane.admin_api import Quotas
from loraplane.serving.http.errors import APIError


class TenantConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    # A key of nothing (or of spaces) would match a request without an Authorization header.
    api_keys: list[Annotated[str, Field(pattern=r"\S")]] = Field(min_length=1)
    allow_base: bool = True
    max_concurrent: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: list[TenantConfig]


def load_tenants(path: Path) -> list[TenantConfig]:
    raw = yaml.safe_load(path.read_text())  # JSON is YAML too
    return TenantsFile.model_validate(raw).tenants


# ``may_use`` hides adapters of this owner from every caller, open server included.
INTERNAL_TENANT = INTERNAL_OWNER


def _key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class _Usage:
    def __init__(self) -> None:
        self.in_flight = 0
        self.reserved = 0  # tokens the requests in flight may still use (see Tenants.admit)
        self.window: deque[tuple[float, int]] = deque()

    def tokens(self, now: float) -> int:
        while self.window and now - self.window[0][0] > 60:
            self.window.popleft()
        return sum(n for _, n in self.window)


class Tenants:
    def __init__(self, tenants: list[TenantConfig] | None) -> None:
        self.open = not tenants
        # Keyed by the keys' sha256, so a lookup's timing depends on a digest of what the caller
        # sent, not on how many leading characters of a real key it guessed.
        self.by_key = {_key_digest(key): t for t in tenants or [] for key in t.api_keys}
        self.adapter_limits: dict[str, Quotas] = {}
        self.usage: dict[str, _Usage] = {}  # "tenant:<name>" or "adapter:<name>"
        self.lock = threading.Lock()

    def authenticate(self, authorization: str | None) -> TenantConfig | None:
        """The caller's tenant (None on an open server); 401 for a missing or unknown key."""
        if self.open:
            return None
        key = (authorization or "").removeprefix("Bearer ").strip()
        tenant = self.by_key.get(_key_digest(key))
        if tenant is None:
            raise APIError(401, "Incorrect API key provided.", type_="invalid_request_error", code="invalid_api_key")
        return tenant

    @staticmethod
    def may_use(tenant: TenantConfig | None, owner: str | None) -> bool:
        if owner == INTERNAL_TENANT:
            return False
        return tenant is None or owner is None or owner == tenant.name

    def set_adapter_limits(self, adapter: str, limits: Quotas | None) -> None:
        with self.lock:
            if limits is None or (limits.max_concurrent is None and limits.tokens_per_minute is None):
                self.adapter_limits.pop(adapter, None)
            else:
                self.adapter_limits[adapter] = limits

    def _keys(self, tenant: TenantConfig | None, adapter: str | None) -> list[str]:
        return ([f"tenant:{tenant.name}"] if tenant is not None else []) + ([f"adapter:{adapter}"] if adapter else [])

    def admit(self, tenant: TenantConfig | None, adapter: str | None = None, tokens: int = 0) -> dict[str, int]:
        """Count a request against its tenant's and its adapter's quotas, or answer 429.

        ``tokens`` is the most the request can use (its prompt and ``max_tokens`` for every
        choice). Under a tokens-per-minute quota they are reserved until :meth:`finish`, so
        concurrent requests cannot together overshoot it: without the reservation every request
        admitted before the first one finished would pass the check, each up to the context
        length. A request larger than the whole quota reserves all of it, so it runs only when
        nothing else is counted in the minute. Returns the reservation to hand to ``finish``."""
        now = time.monotonic()
        with self.lock:
            checks: list[tuple[str, int | None, int | None, str]] = []
            if tenant is not None:
                limit = (tenant.max_concurrent, tenant.tokens_per_minute)
                checks.append((f"tenant {tenant.name!r}", *limit, f"tenant:{tenant.name}"))
            limits = self.adapter_limits.get(adapter) if adapter else None
            if limits is not None:
                checks.append((f"adapter {adapter!r}", limits.max_concurrent, limits.tokens_per_minute, f"adapter:{adapter}"))
            reservation: dict[str, int] = {}
            for who, max_concurrent, tokens_per_minute, key in checks:
                u = self.usage.setdefault(key, _Usage())
                if max_concurrent is not None and u.in_flight >= max_concurrent:
                    raise APIError(
                        429, f"{who} already has {u.in_flight} requests in flight",
                        type_="rate_limit_error", code="concurrency_limit", retry_after=1,
                    )  # fmt: skip
                if tokens_per_minute is None:
                    continue
                used, need = u.tokens(now), min(tokens, tokens_per_minute)
                if used >= tokens_per_minute:
                    wait = 60 - (now - u.window[0][0]) if u.window else 1
                    raise APIError(
                        429, f"{who} used its {tokens_per_minute} tokens per minute",
                        type_="rate_limit_error", code="rate_limit_exceeded", retry_after=max(1, int(wait) + 1),
                    )  # fmt: skip
                if used + u.reserved + need > tokens_per_minute:
                    raise APIError(
                        429, f"{who} has {used} of its {tokens_per_minute} tokens per minute used and {u.reserved} "
                        f"reserved by requests in flight; this one may use up to {tokens} (lower max_tokens to fit)",
                        type_="rate_limit_error", code="rate_limit_exceeded", retry_after=1,
                    )  # fmt: skip
                reservation[key] = need
            for key in self._keys(tenant, adapter):
                u = self.usage.setdefault(key, _Usage())
                u.in_flight += 1
                u.reserved += reservation.get(key, 0)
            return reservation

    def finish(
        self, tenant: TenantConfig | None, record: dict[str, object], reservation: Mapping[str, int] | None = None
    ) -> None:
        """Release the request's concurrency slots and its token reservation, and count the tokens
        it used in the quota windows. ``record["adapter"]`` must be the adapter it was admitted
        with, ``reservation`` what ``admit`` returned."""
        tokens = int(record.get("prompt_tokens", 0) or 0) + int(record.get("completion_tokens", 0) or 0)  # type: ignore[call-overload]
        adapter = record.get("adapter")
        with self.lock:
            for key in self._keys(tenant, adapter if isinstance(adapter, str) else None):
                u = self.usage.setdefault(key, _Usage())
                u.in_flight -= 1
                u.reserved -= (reservation or {}).get(key, 0)
                now = time.monotonic()
                u.tokens(now)  # prune: a tenant without a token quota is never checked, and its window would only grow
                u.window.append((now, tokens))
                if key.startswith("adapter:") and not u.in_flight and key[8:] not in self.adapter_limits:
                    del self.usage[key]  # an adapter without quotas needs no history
