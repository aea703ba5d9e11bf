"""Export of closed segments to S3 (moto on loopback): partitioned keys, local files deleted only
once stored, nothing lost or duplicated when the store goes away mid-upload or two replicas share
a bucket, and the report reads it all back."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from flaky_proxy import flaky_proxy
from s3_server import ACCESS, SECRET, client, moto_server

from loraplane.adapter_format.sources import S3Settings
from loraplane.usage import Outcome, SegmentExporter, UsageRecord, UsageSpool, export_key
from loraplane.usage.report import build_report, iter_blobs
from loraplane.usage.spool import closed_segments


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    with moto_server() as endpoint:
        client(endpoint).make_bucket("billing")
        yield endpoint


def settings(endpoint: str) -> S3Settings:
    return S3Settings(endpoint, ACCESS, SECRET, "us-east-1")


def rec(replica: str, i: int) -> UsageRecord:
    return UsageRecord(
        request_id=f"{replica}-{i}", replica=replica, tenant="acme", completion_tokens=2, outcome=Outcome.COMPLETED
    )


def report_of(endpoint: str, prefix: str):  # type: ignore[no-untyped-def]
    return build_report(iter_blobs(f"s3://billing/{prefix}", settings(endpoint), None, None, progress=False))


def test_segments_go_up_under_day_and_replica_and_leave_the_disk(s3: str, tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path, "pod-a", max_segment_bytes=1_000)
    for i in range(20):
        spool.append(rec("pod-a", i))
    spool.close()
    names = [p.name for p in closed_segments(tmp_path)]
    exporter = SegmentExporter(tmp_path, "s3://billing/t1", settings(s3))
    assert exporter.export_once() == len(names) > 1
    assert not closed_segments(tmp_path)
    keys = sorted(o.object_name for o in client(s3).list_objects("billing", prefix="t1/", recursive=True))
    assert keys == sorted(export_key("t1", n) for n in names)
    assert all("/date=20" in k and "/replica=pod-a/" in k for k in keys)
    # A crash between upload and delete uploads a segment again: same key, counted once.
    spool = UsageSpool(tmp_path, "pod-a")
    spool.append(rec("pod-a", 0))
    spool.close()
    (_again,) = closed_segments(tmp_path)
    exporter.export_once()
    report = report_of(s3, "t1")
    assert (report.records, report.duplicates) == (20, 1)


def test_a_store_that_goes_away_mid_upload_loses_and_duplicates_nothing(s3: str, tmp_path: Path) -> None:
    """Two replicas spool and export to one bucket through a proxy that is cut and restored while
    records keep coming; afterwards every record is in the bucket exactly once."""
    with flaky_proxy(s3) as proxy:
        replicas = {}
        for name in ("pod-a", "pod-b"):
            folder = tmp_path / name
            exporter = SegmentExporter(folder, "s3://billing/t2", settings(proxy.url), interval=0.1)
            spool = UsageSpool(folder, name, max_segment_bytes=600, on_close=exporter.notify)
            exporter.start()
            replicas[name] = (spool, exporter)
        stop = threading.Event()

        def flap() -> None:
            while not stop.is_set():
                time.sleep(0.15)
                proxy.down()
                time.sleep(0.3)
                proxy.up()

        flapper = threading.Thread(target=flap)
        flapper.start()
        for i in range(150):
            for name, (spool, _) in replicas.items():
                spool.append(rec(name, i))
            time.sleep(0.005)
        stop.set()
        flapper.join()
        assert proxy.cut, "the proxy must have cut connections in flight"
        for spool, exporter in replicas.values():
            spool.close()
            exporter.close(deadline=30)
            assert exporter.pending() == 0, exporter.last_error
    report = report_of(s3, "t2")
    assert report.records == 300
    assert report.duplicates == 0
    assert sum(r.completion_tokens for r in report.rows) == 600
