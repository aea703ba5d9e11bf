"""The local spool: usage records appended to segment files on the replica's disk, off the request
path, durable within a stated bound.

- ``append`` hands a record to the writer thread and returns at once with a future that resolves
  when the record has been written to the segment (``write(2)`` returned, so it survives the
  process being killed). The server awaits that future before it sends a response's last bytes,
  so every request a client saw complete has its record in the kernel's page cache; the event
  loop and the engine thread never wait on the disk themselves.
- The writer ``fsync``s the open segment at most ``fsync_interval`` seconds after a write, and at
  rotation and shutdown: a crash of the whole machine loses at most the records of the last
  ``fsync_interval`` seconds.
- Segments rotate at ``max_segment_bytes`` or ``max_segment_age`` seconds, whichever comes first.
  An open segment is ``NAME.jsonl.open``; closing renames it to ``NAME.jsonl`` (after its fsync
  and the folder's), and only closed segments are exported. A segment left open by a crash is
  closed at the next start, cut back to its last whole line.
- A rotation that fails (the rename or the folder's fsync raises: a full or flaky disk) never
  stops the spool: the next record opens a new segment, the old one's close is retried at every
  upkeep (about each second) until it succeeds, and each failure is counted
  (``rotation_failures``, exported as ``loraplane_usage_spool_rotation_failures``). Its records
  were written before; a restart would close it too.
- A write that fails (a full disk) fails its records' futures and leaves the segment as it was:
  what a short write put in the file is cut back off, so a record its caller heard failed is
  never billed later. The records are counted (``records_lost``, exported as
  ``loraplane_usage_spool_records_lost``); the spool writes again as soon as the disk has room.

Hand-written rather than a logging handler: the rotation, fsync bound and per-record
acknowledgement are the point, and ``logging.handlers`` offers none of them.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import UTC, datetime
from pathlib import Path

from loraplane.usage.record import UsageRecord

log = logging.getLogger(__name__)

OPEN_SUFFIX = ".jsonl.open"
CLOSED_SUFFIX = ".jsonl"
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def safe_name(replica: str) -> str:
    """A replica name fit for file names and object keys (pod names already are)."""
    return _UNSAFE.sub("-", replica).strip("-") or "replica"


def segment_name(replica: str, opened: float, counter: int) -> str:
    """``REPLICA.YYYYmmddTHHMMSSZ.COUNTER.RANDOM``: unique across restarts and replicas, and the
    date partition of its export key comes from it."""
    stamp = datetime.fromtimestamp(opened, UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"{safe_name(replica)}.{stamp}.{counter:06d}.{secrets.token_hex(3)}"


def _closed_name(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(OPEN_SUFFIX) + CLOSED_SUFFIX)


def fsync_path(path: Path) -> None:
    """fsync a file or a folder by path (a folder's fsync makes the renames inside it durable);
    the node disk cache uses it too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recover(folder: Path) -> list[Path]:
    """Close the segments a crashed writer left open: cut each back to its last whole line, fsync,
    rename. Returns the segments closed."""
    closed = []
    for path in sorted(folder.glob(f"*{OPEN_SUFFIX}")):
        data = path.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]
        target = _closed_name(path)
        if not whole:
            path.unlink()
            continue
        if len(whole) != len(data):
            log.warning("usage segment %s ended in a partial record (%d bytes cut)", path.name, len(data) - len(whole))
            with path.open("r+b") as f:
                f.truncate(len(whole))
                os.fsync(f.fileno())
        path.rename(target)
        closed.append(target)
    if closed:
        fsync_path(folder)
    return closed


def closed_segments(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"*{CLOSED_SUFFIX}"))


class _Segment:
    def __init__(self, path: Path) -> None:
        self.path = path
        # Unbuffered: a record is in the file when ``append`` says so, and a failed write leaves
        # nothing in a buffer to land later (a record its caller was told failed, billed anyway).
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.opened = time.monotonic()
        self.size = 0
        self.unsynced_since: float | None = None

    def append(self, data: bytes) -> None:
        """All of ``data`` or none of it: a write a full disk cut short is cut back off the file
        before the error reaches the callers, so the segment holds whole records only."""
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError:
            os.ftruncate(self.fd, self.size)  # freeing space; if even this fails, the caller drops the segment
            raise
        self.size += len(data)


class UsageSpool:
    def __init__(
        self,
        folder: Path,
        replica: str,
        *,
        fsync_interval: float = 1.0,
        max_segment_bytes: int = 8 << 20,
        max_segment_age: float = 60.0,
        on_close: Callable[[Path], None] | None = None,
    ) -> None:
        self.folder, self.replica = folder, replica
        self.fsync_interval, self.max_segment_bytes, self.max_segment_age = fsync_interval, max_segment_bytes, max_segment_age
        self.on_close = on_close
        folder.mkdir(parents=True, exist_ok=True)
        recover(folder)
        self.written = 0  # records written, for tests and stats
        self.rotation_failures = 0  # closes that raised and were retried (a metric)
        self.records_lost = 0  # records whose write failed (a metric): their callers heard it
        self._closing: list[Path] = []  # rotated segments whose rename or folder fsync is still to succeed
        self._counter = 0
        self._segment: _Segment | None = None
        self._queue: queue.SimpleQueue[tuple[UsageRecord, Future[None]] | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="usage-spool", daemon=True)
        self._thread.start()

    # callers --------------------------------------------------------------------------------
    def append(self, record: UsageRecord) -> Future[None]:
        """Queue the record; the future resolves once it is written (not yet fsynced)."""
        future: Future[None] = Future()
        if self._closed:
            future.set_exception(RuntimeError("the usage spool is closed"))
            return future
        self._queue.put((record, future))
        return future

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, fsync and close the open segment."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)

    # writer thread --------------------------------------------------------------------------
    def _timeout(self) -> float | None:
        seg = self._segment
        if seg is None:
            return 1.0 if self._closing else None
        deadlines = [seg.opened + self.max_segment_age]
        if seg.unsynced_since is not None:
            deadlines.append(seg.unsynced_since + self.fsync_interval)
        return max(0.0, min(deadlines) - time.monotonic())

    def _run(self) -> None:
        stop = False
        while not stop:
            batch: list[tuple[UsageRecord, Future[None]]] = []
            try:
                item = self._queue.get(timeout=self._timeout())
                while True:
                    if item is None:
                        stop = True
                    else:
                        batch.append(item)
                    item = self._queue.get_nowait()
            except queue.Empty:
                pass  # everything queued is in the batch, or a deadline passed with nothing to write
            try:
                if batch:
                    self._write(batch)
                self._upkeep(force_close=stop)
            except Exception as err:  # a full or broken disk: the callers hear it, the thread goes on
                log.exception("usage spool write failed")
                for _, future in batch:
                    if not future.done():
                        self.records_lost += 1
                        future.set_exception(err)

    def _write(self, batch: list[tuple[UsageRecord, Future[None]]]) -> None:
        """Write the batch, one ``write`` per segment it fills; a segment that reaches
        ``max_segment_bytes`` closes before the rest goes on into the next."""
        lines = [record.model_dump_json().encode() + b"\n" for record, _ in batch]
        start = 0
        while start < len(lines):
            seg = self._segment
            if seg is None:
                self._counter += 1
                name = segment_name(self.replica, time.time(), self._counter) + OPEN_SUFFIX
                seg = self._segment = _Segment(self.folder / name)
            end, size = start, seg.size
            while end < len(lines) and (end == start or size < self.max_segment_bytes):
                size += len(lines[end])
                end += 1
            data = b"".join(lines[start:end])
            try:
                seg.append(data)
            except OSError:
                if seg.size != os.fstat(seg.fd).st_size:  # not even cut back: never written to again
                    log.error("usage segment %s could not be cut back after a failed write; left for recovery", seg.path.name)
                    self._segment = None
                    os.close(seg.fd)
                raise
            if seg.unsynced_since is None:
                seg.unsynced_since = time.monotonic()
            for _, future in batch[start:end]:
                future.set_result(None)
            self.written += end - start
            start = end
            if seg.size >= self.max_segment_bytes:
                self._rotate(seg)

    def _upkeep(self, force_close: bool) -> None:
        if self._closing:
            self._close_rotated()
        seg = self._segment
        if seg is None:
            return
        now = time.monotonic()
        if force_close or now - seg.opened >= self.max_segment_age:  # size rotation happens as it is written
            self._rotate(seg)
        elif seg.unsynced_since is not None and now - seg.unsynced_since >= self.fsync_interval:
            os.fsync(seg.fd)
            seg.unsynced_since = None

    def _rotate(self, seg: _Segment) -> None:
        # Whatever fails below, the next record goes into a new segment: the writer never keeps a
        # segment it may have closed (every later write would fail until a restart).
        self._segment = None
        try:
            os.fsync(seg.fd)
        finally:
            os.close(seg.fd)
            self._closing.append(seg.path)
        self._close_rotated()

    def _close_rotated(self) -> None:
        """Rename the rotated segments to closed and fsync the folder; one that fails stays for the
        next upkeep, counted."""
        while self._closing:
            path = self._closing[0]
            target = _closed_name(path)
            try:
                if path.exists():  # a retry whose rename went through before the folder's fsync failed
                    path.rename(target)
                fsync_path(self.folder)
            except OSError:
                self.rotation_failures += 1
                log.exception("closing usage segment %s failed; retried at the next upkeep", path.name)
                return
            self._closing.pop(0)
            if self.on_close is not None:
                self.on_close(target)
