"""Keeping the table true: every replica's ``/admin/stats`` on an interval (residency and queue
depth), which also brings a replica up once it answers. With the stats token the answer must be
signed by its holder (``admin_api.auth``), so a pod that joins the Service by wearing the serving
labels is never up and never sent a tenant's prompt. Without a token, ``/ready`` decides."""

from __future__ import annotations

import asyncio
import logging

import httpx

from loraplane.admin_api import AdminClient, ReplicaError, ReplicaStats
from loraplane.serving.http.tenants import Tenants
from loraplane.serving.router.table import Replica, ReplicaTable

log = logging.getLogger(__name__)


class Upkeep:
    def __init__(
        self, table: ReplicaTable, client: httpx.AsyncClient, admin_token: str | None, tenants: Tenants, *,
        interval: float = 1.0,
    ) -> None:  # fmt: skip
        self.table, self.client, self.tenants, self.interval = table, client, tenants, interval
        self.admin_token = admin_token
        self._soon: set[asyncio.Task[None]] = set()

    def _admin(self, replica: Replica, timeout: float) -> AdminClient:
        return AdminClient(replica.url, self.admin_token, timeout, http=self.client)

    async def check(self, replica: Replica) -> None:
        try:
            if self.admin_token is not None:  # stats need the token; without it only /ready
                try:
                    stats = await self._admin(replica, self.interval + 4).stats()
                except ReplicaError as err:
                    if err.status is None:
                        raise
                    # 503: still loading its base; 401: it refuses this token (another base's
                    # replica, or an --admin-host that does not name the address dialled).
                    self.table.mark_down(replica, "not ready" if err.status == 503 else f"stats: HTTP {err.status}: {err}")
                    return
                if not replica.up:  # its answer is signed: a replica of this base, ready
                    log.info("replica %s is up", replica.name)
                    self.table.mark_up(replica)
                self.table.apply_stats(replica, stats)
                self.learn_quotas(stats)
            elif not replica.up:
                if await self._admin(replica, self.interval + 1).ready():
                    log.info("replica %s is back", replica.name)
                    self.table.mark_up(replica)
            elif not await self._admin(replica, self.interval + 1).ready():
                self.table.mark_down(replica, "/ready refused")
        except ReplicaError as err:  # unreachable
            if replica.up:
                log.warning("replica %s is down: %s", replica.name, err)
            self.table.mark_down(replica, str(err))
        except Exception as err:  # it answered, but not stats we can read: down, and the others go on
            log.warning("replica %s answered unreadable stats: %r", replica.name, err)
            self.table.mark_down(replica, f"unreadable stats: {type(err).__name__}")

    def learn_quotas(self, stats: ReplicaStats) -> None:
        """Adapters' own quotas, as registered on the replicas, hold at the edge as well: with
        several replicas each would otherwise allow the adapter its full quota."""
        for name, entry in stats.adapters.items():
            self.tenants.set_adapter_limits(name, entry.quotas)

    def soon(self) -> None:
        """A check now rather than at the next tick, of the replicas that are down (one that just
        joined starts so), without waiting on the others."""
        down = [r for r in self.table.replicas.values() if not r.up]
        task = asyncio.create_task(self._check_all(down))
        self._soon.add(task)  # held: the loop keeps only a weak reference to a task
        task.add_done_callback(self._soon.discard)

    async def once(self) -> None:
        await self._check_all(list(self.table.replicas.values()))

    async def _check_all(self, replicas: list[Replica]) -> None:
        await asyncio.gather(*(self.check(r) for r in replicas))

    async def run(self) -> None:
        while True:
            await self.once()
            await asyncio.sleep(self.interval)
