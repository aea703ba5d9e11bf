"""Where a process's usage records go: the spool (when a folder is given), its exporter (when a
destination is given) and the in-memory rollup. Shared by the server and the router.

``record`` is awaited by a handler before a response's last bytes go out, so a client never sees
a request complete whose record is not yet written; ``record_nowait`` is for the paths that cannot
wait (a client that hung up mid-stream, a refusal).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from loraplane.adapter_format.sources import S3Settings
from loraplane.usage.export import SegmentExporter
from loraplane.usage.record import Outcome, UsageRecord
from loraplane.usage.rollup import Rollup, UsageRollup
from loraplane.usage.spool import UsageSpool

log = logging.getLogger(__name__)


class Metering:
    def __init__(self, replica: str, spool: UsageSpool | None = None, exporter: SegmentExporter | None = None) -> None:
        self.replica, self.spool, self.exporter = replica, spool, exporter
        self.rollup = Rollup()

    @classmethod
    def create(
        cls, replica: str, folder: Path | None, export_to: str | None = None, s3: S3Settings | None = None,
        **spool_options: float,
    ) -> Metering:  # fmt: skip
        """A spool in ``folder`` (none: records are only counted), exported to ``export_to``
        (``s3://bucket/prefix``) when given."""
        if folder is None:
            if export_to:
                raise ValueError("usage export needs a usage folder to spool in")
            return cls(replica)
        exporter = SegmentExporter(folder, export_to, s3) if export_to else None
        spool = UsageSpool(folder, replica, on_close=exporter.notify if exporter else None, **spool_options)  # type: ignore[arg-type]
        if exporter is not None:
            exporter.start()
        return cls(replica, spool, exporter)

    def record_nowait(self, record: UsageRecord) -> Future[None] | None:
        """Count the record and hand it to the spool; the spool's acknowledgement, if any."""
        self.rollup.add(record)
        return self.spool.append(record) if self.spool is not None else None

    async def record(self, record: UsageRecord) -> None:
        future = self.record_nowait(record)
        if future is not None:
            try:
                await asyncio.wrap_future(future)
            except Exception:  # the disk failed: the response still goes out; the failure is logged
                log.exception("usage record %s not written", record.request_id)

    async def refuse(self, request_id: str, status: int, *, source: str = "replica", **fields: Any) -> None:
        """Record a request refused before any engine ran it: no tokens, its HTTP status."""
        await self.record(UsageRecord(
            request_id=request_id, source=source, replica=self.replica, outcome=Outcome.REFUSED, status_code=status,
            **fields,
        ))  # fmt: skip

    def view(self) -> UsageRollup:
        since, tenants = self.rollup.totals()
        exporter = self.exporter
        return UsageRollup(
            replica=self.replica,
            since=since,
            tenants=tenants,
            pending_segments=exporter.pending() if exporter else 0,
            export_error=exporter.last_error if exporter else None,
        )

    def close(self) -> None:
        """At shutdown: close the last segment, then export what is left (bounded)."""
        if self.spool is not None:
            self.spool.close()
        if self.exporter is not None:
            self.exporter.close()
