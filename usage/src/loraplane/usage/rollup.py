"""A replica's per-tenant totals over the last day, for the operator to write into status.

Hourly buckets, so the window slides by the hour and memory stays at 24 buckets per tenant. The
figures are this replica's since it started (at most the last 24 hours): a dashboard's view. The
billing truth is the exported records and ``loraplane usage report``.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

from loraplane.usage.record import UsageRecord
from loraplane.usage.totals import Totals

WINDOW_HOURS = 24
NO_TENANT = "(none)"  # requests on an open server carry no tenant


class TenantTotals(Totals):
    tenant: str


class UsageRollup(BaseModel):
    """``GET /admin/usage``: the body the operator reads from every replica."""

    model_config = ConfigDict(extra="ignore")

    replica: str
    window_hours: int = WINDOW_HOURS
    since: float = Field(description="unix seconds of the oldest bucket counted")
    tenants: list[TenantTotals]
    pending_segments: int = Field(default=0, description="closed spool segments not yet exported")
    export_error: str | None = None


class Rollup:
    def __init__(self) -> None:
        self._buckets: dict[int, dict[str, TenantTotals]] = defaultdict(dict)
        self._lock = threading.Lock()
        self.started = time.time()

    def add(self, record: UsageRecord) -> None:
        hour = int(record.time // 3600)
        tenant = record.tenant or NO_TENANT
        with self._lock:
            bucket = self._buckets[hour]
            (bucket.get(tenant) or bucket.setdefault(tenant, TenantTotals(tenant=tenant))).count(record)
            oldest = hour - WINDOW_HOURS + 1
            for old in [h for h in self._buckets if h < oldest]:
                del self._buckets[old]

    def totals(self, now: float | None = None) -> tuple[float, list[TenantTotals]]:
        """The window's start and each tenant's totals, largest token users first."""
        oldest = int((now or time.time()) // 3600) - WINDOW_HOURS + 1
        with self._lock:
            rows = [t for hour, bucket in self._buckets.items() if hour >= oldest for t in bucket.values()]
            summed = per_tenant(rows)
        return max(self.started, oldest * 3600.0), summed


def per_tenant(rows: Iterable[TenantTotals]) -> list[TenantTotals]:
    """Rows summed per tenant, largest token users first."""
    merged: dict[str, TenantTotals] = {}
    for t in rows:
        merged.setdefault(t.tenant, TenantTotals(tenant=t.tenant)).add(t)
    return sorted(merged.values(), key=lambda t: (-t.total_tokens, t.tenant))


def merge(rollups: list[UsageRollup], limit: int) -> list[TenantTotals]:
    """Sum the replicas' rollups per tenant; the ``limit`` largest, the rest summed as ``(other)``
    so a status stays bounded whatever the number of tenants."""
    ordered = per_tenant(t for rollup in rollups for t in rollup.tenants)
    if len(ordered) <= limit:
        return ordered
    other = TenantTotals(tenant="(other)")
    for t in ordered[limit - 1 :]:
        other.add(t)
    return [*ordered[: limit - 1], other]
