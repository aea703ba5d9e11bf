"""Keeping the table true: every replica's ``/admin/stats`` on an interval (residency and queue
depth), and ``/ready`` for the replicas marked down, which brings them back once they answer."""

from __future__ import annotations

import asyncio
import logging

import httpx

from loraplane.serving.api.tenants import Limits, Tenants
from loraplane.serving.router.table import Replica, ReplicaTable

log = logging.getLogger(__name__)


class Upkeep:
    def __init__(
        self, table: ReplicaTable, client: httpx.AsyncClient, admin_token: str | None, tenants: Tenants, *,
        interval: float = 1.0,
    ) -> None:  # fmt: skip
        self.table, self.client, self.tenants, self.interval = table, client, tenants, interval
        self.headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.admin = admin_token is not None

    async def check(self, replica: Replica) -> None:
        try:
            if not replica.up:
                r = await self.client.get(f"{replica.url}/ready", timeout=self.interval + 1)
                if r.status_code == 200:
                    log.info("replica %s is back", replica.name)
                    self.table.mark_up(replica)
                return
            if self.admin:
                r = await self.client.get(f"{replica.url}/admin/stats", headers=self.headers, timeout=self.interval + 4)
                if r.status_code == 200:
                    stats = r.json()
                    self.table.apply_stats(replica, stats)
                    self.learn_quotas(stats)
                elif r.status_code == 503:  # still loading its base
                    self.table.mark_down(replica, "not ready")
            else:
                r = await self.client.get(f"{replica.url}/ready", timeout=self.interval + 1)
                if r.status_code != 200:
                    self.table.mark_down(replica, f"/ready answered {r.status_code}")
        except httpx.TransportError as err:
            if replica.up:
                log.warning("replica %s is down: %r", replica.name, err)
            self.table.mark_down(replica, repr(err))
        except Exception as err:  # it answered, but not stats we can read: down, and the others go on
            log.warning("replica %s answered unreadable stats: %r", replica.name, err)
            self.table.mark_down(replica, f"unreadable stats: {type(err).__name__}")

    def learn_quotas(self, stats: dict[str, object]) -> None:
        """Adapters' own quotas, as registered on the replicas, hold at the edge as well: with
        several replicas each would otherwise allow the adapter its full quota."""
        adapters = stats.get("adapters")
        for name, entry in (adapters if isinstance(adapters, dict) else {}).items():
            quotas = entry.get("quotas") if isinstance(entry, dict) else None
            self.tenants.set_adapter_limits(name, Limits.model_validate(quotas) if quotas else None)

    async def once(self) -> None:
        await asyncio.gather(*(self.check(r) for r in list(self.table.replicas.values())))

    async def run(self) -> None:
        while True:
            await self.once()
            await asyncio.sleep(self.interval)
