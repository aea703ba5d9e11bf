"""``loraplane usage report``: exported usage records summed per tenant, adapter and day.

Records are read from a local folder (any ``*.jsonl`` below it, e.g. a synced copy of the bucket
or a replica's spool) or from ``s3://bucket/prefix``, de-duplicated by ``request_id`` (a segment
uploaded twice counts once), filtered to ``[since, until)`` by each record's finish time, and
grouped. Objects whose ``date=`` partition lies outside the range are not read at all.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from tqdm import tqdm

from loraplane.adapter_format.sources import S3Settings
from loraplane.usage.export import parse_destination
from loraplane.usage.record import UsageRecord
from loraplane.usage.totals import Totals

_PARTITION = re.compile(r"date=(\d{4}-\d{2}-\d{2})")


class Row(Totals):
    tenant: str
    adapter: str
    day: str

    def line(self) -> dict[str, Any]:
        """The row as the report prints it: keys first, then the sums and their total."""
        return {"tenant": self.tenant, "adapter": self.adapter, "day": self.day,
                **{k: getattr(self, k) for k in Totals.model_fields}, "total_tokens": self.total_tokens}  # fmt: skip


@dataclass
class Report:
    rows: list[Row]
    records: int = 0  # distinct records counted
    duplicates: int = 0  # records seen again (same request id) and not counted
    unreadable: int = 0  # lines that were not a usage record
    sources: list[str] = field(default_factory=list)


def _day(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d")


def _in_partition_range(name: str, since: float | None, until: float | None) -> bool:
    """False only for an object whose day partition is wholly outside the range."""
    m = _PARTITION.search(name)
    if m is None:
        return True
    start = datetime.strptime(m.group(1), "%Y-%m-%d").replace(tzinfo=UTC).timestamp()
    # A segment opened on that day may hold records up to its rotation age past midnight.
    return not ((until is not None and start >= until) or (since is not None and start + 2 * 86400 <= since))


def _lines(data: bytes) -> Iterator[bytes]:
    yield from (line for line in data.splitlines() if line.strip())


def iter_blobs(
    source: str, s3: S3Settings | None, since: float | None, until: float | None, progress: bool
) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of every record file the source holds within the range."""
    if source.startswith("s3://"):
        bucket, prefix = parse_destination(source)
        client = (s3 or S3Settings.from_env()).client()
        listed = [o.object_name for o in client.list_objects(bucket, prefix=f"{prefix}/" if prefix else None, recursive=True)]
        names = [n for n in listed if n.endswith(".jsonl") and _in_partition_range(n, since, until)]
        for name in tqdm(names, desc="usage objects", unit="obj", disable=not progress):
            response = client.get_object(bucket, name)
            try:
                yield f"s3://{bucket}/{name}", response.read()
            finally:
                response.close()
                response.release_conn()
        return
    folder = Path(source)
    if not folder.is_dir():
        raise FileNotFoundError(f"{source}: neither s3://bucket/prefix nor a folder")
    files = [p for p in sorted(folder.rglob("*.jsonl")) if _in_partition_range(str(p), since, until)]
    for path in tqdm(files, desc="usage files", unit="file", disable=not progress):
        yield str(path), path.read_bytes()


def build_report(blobs: Iterable[tuple[str, bytes]], since: float | None = None, until: float | None = None) -> Report:
    seen: set[str] = set()
    groups: dict[tuple[str, str, str], Row] = {}
    report = Report(rows=[])
    for name, data in blobs:
        report.sources.append(name)
        for line in _lines(data):
            try:
                record = UsageRecord.model_validate_json(line)
            except ValidationError:
                report.unreadable += 1
                continue
            if record.request_id in seen:
                report.duplicates += 1
                continue
            seen.add(record.request_id)
            if (since is not None and record.time < since) or (until is not None and record.time >= until):
                continue
            report.records += 1
            key = (record.tenant or "(none)", record.adapter or "(base)", _day(record.time))
            row = groups.get(key) or groups.setdefault(key, Row(tenant=key[0], adapter=key[1], day=key[2]))
            row.count(record)
    report.rows = [groups[k] for k in sorted(groups)]
    return report


def parse_time(value: str | None, end_of_day: bool = False) -> float | None:
    """A date (``2026-12-01``; for ``until``, the end of that day) or an ISO 8601 time, as unix
    seconds (UTC unless the time says otherwise)."""
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a date (YYYY-MM-DD) or an ISO 8601 time") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    if end_of_day and len(value) == 10:
        when += timedelta(days=1)
    return when.timestamp()


def render(report: Report, fmt: str) -> str:
    rows = [r.line() for r in report.rows]
    if fmt == "json":
        summary: dict[str, Any] = {"records": report.records, "duplicates": report.duplicates, "unreadable": report.unreadable}
        return json.dumps({**summary, "rows": rows}, indent=2)
    columns = list(rows[0]) if rows else list(Row(tenant="", adapter="", day="").line())
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()
    cells = [[str(r[c]) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    lines.append(f"{report.records} records, {report.duplicates} duplicates skipped, {report.unreadable} unreadable lines")
    return "\n".join(lines)
