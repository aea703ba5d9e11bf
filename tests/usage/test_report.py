"""`loraplane usage report`: records counted once per request id, grouped per tenant, adapter and
day, filtered by time, in the three formats."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from click.testing import CliRunner

from loraplane.cli import main
from loraplane.usage import Outcome, UsageRecord
from loraplane.usage.report import build_report, parse_time

DAY1 = parse_time("2026-11-30") or 0.0
DAY2 = parse_time("2026-12-01") or 0.0


def line(**kw: object) -> bytes:
    return UsageRecord.model_validate(kw).model_dump_json().encode() + b"\n"


def write_bucket(root: Path) -> None:
    a = root / "date=2026-11-30" / "replica=pod-a"
    b = root / "date=2026-12-01" / "replica=pod-b"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    seg = line(request_id="r1", time=DAY1 + 10, tenant="acme", adapter="bot", prompt_tokens=5, completion_tokens=7,
               outcome=Outcome.COMPLETED)  # fmt: skip
    seg += line(request_id="r2", time=DAY1 + 20, tenant="acme", adapter="bot", prompt_tokens=3, completion_tokens=1,
                outcome=Outcome.ABORTED)  # fmt: skip
    (a / "pod-a.20261130T000000Z.000001.aaaaaa.jsonl").write_bytes(seg)
    (a / "pod-a.copy.jsonl").write_bytes(seg)  # the same records uploaded twice
    (b / "pod-b.20261201T000000Z.000001.bbbbbb.jsonl").write_bytes(
        line(request_id="r3", time=DAY2 + 5, tenant="globex", prompt_tokens=2, completion_tokens=2, outcome=Outcome.COMPLETED)
        + line(request_id="rtr-1", time=DAY2 + 6, source="router", tenant="globex", outcome=Outcome.REFUSED, status_code=429)
        + b"not json\n"
    )


def test_records_count_once_and_group_per_tenant_adapter_day(tmp_path: Path) -> None:
    write_bucket(tmp_path)
    blobs = [(str(p), p.read_bytes()) for p in sorted(tmp_path.rglob("*.jsonl"))]
    report = build_report(blobs)
    assert (report.records, report.duplicates, report.unreadable) == (4, 2, 1)
    rows = {(r.tenant, r.adapter, r.day): r for r in report.rows}
    acme = rows["acme", "bot", "2026-11-30"]
    assert (acme.requests, acme.aborted, acme.prompt_tokens, acme.completion_tokens, acme.total_tokens) == (2, 1, 8, 8, 16)
    globex = rows["globex", "(base)", "2026-12-01"]
    assert (globex.requests, globex.refused, globex.total_tokens) == (1, 1, 4)


def test_the_cli_filters_by_day_and_prints_csv_and_json(tmp_path: Path) -> None:
    write_bucket(tmp_path)
    runner = CliRunner()
    result = runner.invoke(main, ["usage", "report", str(tmp_path), "--since", "2026-12-01", "--format", "csv"])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.output)))
    assert [(r["tenant"], r["day"], r["requests"], r["refused"]) for r in rows] == [("globex", "2026-12-01", "1", "1")]
    result = runner.invoke(main, ["usage", "report", str(tmp_path), "--until", "2026-11-30", "--format", "json"])
    body = json.loads(result.output)
    assert [(r["tenant"], r["total_tokens"]) for r in body["rows"]] == [("acme", 16)]
    table = runner.invoke(main, ["usage", "report", str(tmp_path)])
    assert "globex" in table.output and "4 records, 2 duplicates skipped" in table.output
    bad = runner.invoke(main, ["usage", "report", str(tmp_path / "missing")])
    assert bad.exit_code != 0 and "neither s3://" in bad.output
