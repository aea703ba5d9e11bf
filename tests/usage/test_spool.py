"""The usage spool: what it acknowledges is on disk, segments rotate and close, a crash leaves
nothing half-read, and callers never wait on the disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from small_disk import fill, small_disk

from loraplane.usage import Outcome, UsageRecord, UsageSpool
from loraplane.usage.spool import OPEN_SUFFIX, closed_segments, recover


def record(i: int, tenant: str = "acme") -> UsageRecord:
    return UsageRecord(request_id=f"cmpl-{i}", tenant=tenant, prompt_tokens=i, completion_tokens=1, outcome=Outcome.COMPLETED)


def ids_in(folder: Path) -> list[str]:
    return [json.loads(line)["request_id"] for p in closed_segments(folder) for line in p.read_text().splitlines()]


def test_every_acknowledged_record_is_in_a_closed_segment_once(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path, "pod-a", max_segment_bytes=2_000)
    futures = [spool.append(record(i)) for i in range(200)]
    for f in futures:
        f.result(timeout=10)
    spool.close()
    segments = closed_segments(tmp_path)
    assert len(segments) > 1, "200 records of ~300 bytes must rotate at 2 kB"
    assert not list(tmp_path.glob(f"*{OPEN_SUFFIX}"))
    assert sorted(ids_in(tmp_path)) == sorted(f"cmpl-{i}" for i in range(200))
    assert all(p.name.startswith("pod-a.") for p in segments)


def test_a_segment_closes_by_age_without_more_traffic(tmp_path: Path) -> None:
    closed: list[Path] = []
    spool = UsageSpool(tmp_path, "pod-a", max_segment_age=0.2, on_close=closed.append)
    spool.append(record(1)).result(timeout=5)
    deadline = time.monotonic() + 5
    while not closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert closed and ids_in(tmp_path) == ["cmpl-1"]
    spool.close()
    assert len(closed_segments(tmp_path)) == 1, "an empty spool opens no new segment"


def test_the_open_segment_is_fsynced_within_the_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[float] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(time.monotonic()), real(fd))[1])
    spool = UsageSpool(tmp_path, "pod-a", fsync_interval=0.1)
    written = time.monotonic()
    spool.append(record(1)).result(timeout=5)
    deadline = time.monotonic() + 5
    while not synced and time.monotonic() < deadline:
        time.sleep(0.02)
    # Within the interval plus scheduling slack on a loaded machine, and long before rotation (60 s).
    assert synced and synced[0] - written < 1.5, "one write and then silence must still be fsynced"
    spool.close()


def test_append_does_not_wait_for_the_disk(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path, "pod-a")
    gate = threading.Event()
    real = spool._write  # the writer thread's disk step, held shut to stand for a stalled disk

    def slow(batch):  # type: ignore[no-untyped-def]
        gate.wait(10)
        real(batch)

    spool._write = slow  # type: ignore[method-assign]
    start = time.monotonic()
    futures = [spool.append(record(i)) for i in range(100)]
    assert time.monotonic() - start < 5  # the gate stays shut for 10 s: append did not wait for it
    assert not any(f.done() for f in futures)
    gate.set()
    for f in futures:
        f.result(timeout=10)
    spool.close()
    assert len(ids_in(tmp_path)) == 100


def test_a_crash_leaves_whole_records_only(tmp_path: Path) -> None:
    good = record(1).model_dump_json() + "\n"
    (tmp_path / f"pod-a.20261201T000000Z.000001.abcdef{OPEN_SUFFIX}").write_text(good + '{"request_id": "cmpl-2", "ti')
    (tmp_path / f"pod-a.20261201T000001Z.000002.abcdef{OPEN_SUFFIX}").write_text("")
    closed = recover(tmp_path)
    assert [p.read_text() for p in closed] == [good]
    assert not list(tmp_path.glob(f"*{OPEN_SUFFIX}"))


WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from loraplane.usage import Outcome, UsageRecord, UsageSpool
    spool = UsageSpool(Path(sys.argv[1]), "pod-a", fsync_interval=60, max_segment_age=3600)
    i = 0
    while True:
        spool.append(UsageRecord(request_id=f"cmpl-{i}", outcome=Outcome.COMPLETED)).result()
        print(i, flush=True)
        i += 1
    """
)


def test_sigkill_loses_no_acknowledged_record(tmp_path: Path) -> None:
    """What the writer acknowledged before a SIGKILL is read back after the next start's recovery,
    fsync or not: the server sends a response only after its record is acknowledged."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    acked = -1
    while acked < 300:
        acked = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    UsageSpool(tmp_path, "pod-a").close()  # the restarted replica's spool recovers the open segment
    ids = ids_in(tmp_path)
    assert len(ids) == len(set(ids))
    assert {f"cmpl-{i}" for i in range(acked + 1)} <= set(ids)


def test_a_failed_rotation_leaves_the_spool_writable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rename (or the folder's fsync) that closes a segment raises a few times: the next
    records still land, in a new segment; the failed close is retried until it succeeds, counted;
    nothing acknowledged is lost."""
    from loraplane.usage import spool as spool_module

    failures = {"rename": 2, "fsync": 1}
    real_rename, real_fsync = Path.rename, spool_module.fsync_path

    def flaky_rename(self: Path, target: Path) -> Path:  # type: ignore[override]
        if self.name.endswith(OPEN_SUFFIX) and failures["rename"]:
            failures["rename"] -= 1
            raise OSError(28, "No space left on device")
        return real_rename(self, target)

    def flaky_fsync(path: Path) -> None:
        if path.is_dir() and failures["fsync"] and not failures["rename"]:
            failures["fsync"] -= 1
            raise OSError(5, "Input/output error")
        real_fsync(path)

    monkeypatch.setattr(Path, "rename", flaky_rename)
    monkeypatch.setattr(spool_module, "fsync_path", flaky_fsync)
    closed: list[Path] = []
    spool = UsageSpool(tmp_path, "pod-a", max_segment_bytes=1_000, on_close=closed.append)
    for i in range(40):
        spool.append(record(i)).result(timeout=10)  # each lands whatever the rotations did
    deadline = time.monotonic() + 10
    while spool.rotation_failures < 3 or (any(tmp_path.glob(f"*{OPEN_SUFFIX}")) and len(closed) < 3):
        assert time.monotonic() < deadline, f"{spool.rotation_failures} failures, {len(closed)} closed"
        time.sleep(0.05)
    spool.close()
    assert spool.rotation_failures == 3 and not failures["rename"] and not failures["fsync"]
    assert not list(tmp_path.glob(f"*{OPEN_SUFFIX}"))
    assert sorted(ids_in(tmp_path)) == sorted(f"cmpl-{i}" for i in range(40))
    assert sorted(closed) == closed_segments(tmp_path)


def test_a_full_disk_fails_its_records_alone_and_the_spool_writes_again_once_there_is_room(tmp_path: Path) -> None:
    """On a real full volume (a small tmpfs): the records that do not fit fail their futures and
    are counted, nothing half-written or failed lands in a segment later, and once space is freed
    the next records are written; every acknowledged record is there exactly once."""
    with small_disk(tmp_path / "disk", 256) as disk:
        folder = disk / "usage"
        folder.mkdir()
        spool = UsageSpool(folder, "replica-1", fsync_interval=0.05)
        acknowledged, failed = [], []
        for i in range(60):
            if i == 20:
                filler = fill(disk)
            try:
                spool.append(record(i)).result(timeout=5)
                acknowledged.append(f"cmpl-{i}")
            except OSError:
                failed.append(f"cmpl-{i}")
        assert len(failed) >= 30 and spool.records_lost == len(failed)
        filler.unlink()
        for i in range(60, 80):
            spool.append(record(i)).result(timeout=5)
            acknowledged.append(f"cmpl-{i}")
        spool.close()
        assert sorted(ids_in(folder)) == sorted(acknowledged)  # each once, none of the failed ones
