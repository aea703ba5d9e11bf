"""Closed spool segments uploaded to object storage, then deleted locally.

Each segment goes to ``PREFIX/date=YYYY-MM-DD/replica=REPLICA/SEGMENT.jsonl`` (the date is the
segment's opening day, UTC), a key that depends only on the segment's name. An upload that is
retried, or repeated after a crash between upload and delete, rewrites the same object with the
same bytes, so nothing is duplicated; the local file is removed only after the stored object's
size and sha256 (kept in its metadata) match it. A failing store is retried with capped
exponential backoff while the segments wait on disk.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from loraplane.adapter_format.sources import S3Settings
from loraplane.usage.spool import closed_segments

log = logging.getLogger(__name__)

SHA_META = "sha256"
MAX_BACKOFF = 60.0


def parse_destination(uri: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` as (bucket, prefix without slashes)."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"{uri!r}: usage export needs s3://bucket/prefix")
    return parsed.netloc, parsed.path.strip("/")


def export_key(prefix: str, segment: str) -> str:
    """The object key of a closed segment, partitioned by day and replica."""
    replica, stamp = segment.split(".")[:2]
    day = f"{stamp[:4]}-{stamp[4:6]}-{stamp[6:8]}"
    return "/".join(p for p in (prefix, f"date={day}", f"replica={replica}", segment) if p)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class SegmentExporter:
    def __init__(
        self, folder: Path, destination: str, settings: S3Settings | None = None, *, interval: float = 10.0, client: Any = None
    ) -> None:
        self.folder, self.interval = folder, interval
        self.bucket, self.prefix = parse_destination(destination)
        self.client = client or (settings or S3Settings.from_env()).client()
        self.uploaded = 0
        self.failures = 0
        self.last_error: str | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def pending(self) -> int:
        return len(closed_segments(self.folder))

    def export_once(self) -> int:
        """Upload every closed segment; returns how many went up. Raises on the first failure
        (the segments left stay for the next try)."""
        done = 0
        for path in closed_segments(self.folder):
            self._upload(path)
            done += 1
        return done

    def _upload(self, path: Path) -> None:
        key = export_key(self.prefix, path.name)
        digest, size = _sha256(path), path.stat().st_size
        self.client.fput_object(self.bucket, key, str(path), content_type="application/x-ndjson", metadata={SHA_META: digest})
        stat = self.client.stat_object(self.bucket, key)
        meta = {k.lower(): v for k, v in (stat.metadata or {}).items()}
        stored = meta.get(f"x-amz-meta-{SHA_META}") or meta.get(SHA_META)
        if stat.size != size or stored != digest:
            raise OSError(f"{key}: the stored object does not match {path.name} (size {stat.size} of {size})")
        path.unlink()
        self.uploaded += 1
        log.info("exported usage segment %s", key)

    # background -----------------------------------------------------------------------------
    def notify(self, _segment: Path | None = None) -> None:
        """A segment closed: export it now rather than at the next interval."""
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="usage-export", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        backoff = 0.0
        while not self._stop.is_set():
            self._wake.wait(backoff or self.interval)
            self._wake.clear()
            backoff = 0.0 if self._try() else min(MAX_BACKOFF, max(1.0, backoff * 2)) * random.uniform(0.8, 1.2)

    def _try(self) -> bool:
        try:
            self.export_once()
        except Exception as err:  # the store is down or refuses: keep the segments, retry later
            self.failures += 1
            self.last_error = f"{type(err).__name__}: {err}"
            log.warning("usage export to s3://%s/%s failed: %s", self.bucket, self.prefix, self.last_error)
            return False
        self.last_error = None
        return True

    def close(self, deadline: float = 20.0) -> None:
        """Stop the thread, then try to upload what is left until ``deadline`` seconds pass (at
        shutdown, after the spool closed its last segment). What cannot go up stays on disk for
        the next start."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=deadline)
        end = time.monotonic() + deadline
        while self.pending() and time.monotonic() < end:
            if self._try():
                return
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))
