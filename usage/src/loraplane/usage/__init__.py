"""Per-request usage records for billing: written by the replica that served a request, spooled
durably on its disk, exported to object storage and read back by ``loraplane usage report``.

Torch-free and FastAPI-free by contract (import-linter): the server and the router write records,
the CLI reports them, and the operator reads the replicas' rollups, so all of them share these
models instead of agreeing on dict keys.
"""

from loraplane.usage.export import SegmentExporter, export_key
from loraplane.usage.record import Outcome, UsageRecord
from loraplane.usage.recorder import Metering
from loraplane.usage.rollup import Rollup, TenantTotals, UsageRollup
from loraplane.usage.spool import UsageSpool

__all__ = [
    "Metering",
    "Outcome",
    "Rollup",
    "SegmentExporter",
    "TenantTotals",
    "UsageRecord",
    "UsageRollup",
    "UsageSpool",
    "export_key",
]
