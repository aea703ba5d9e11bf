"""Copies from a source that stop as they stream: at a file's byte cap, before the bytes past it
land on disk, and at the fetch's deadline, between chunks. An object's size as listed is checked
first (nothing is fetched of an object already too large), but an object may be replaced between
the listing and the read, and a local file may grow: the cap that counts is the one on the stream.

A namespace user chooses the source; the operator, the node agent and every serving replica fetch
from it. Without these caps a 100 GB object fills the disk of whoever fetches it, and a store that
trickles one byte a minute holds a fetch thread for good.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplane.adapter_format.digest import CONFIG_FILE, GOLDEN_FILE, WEIGHTS_FILE
from loraplane.adapter_format.errors import AdapterValidationError, ErrorCode
from loraplane.adapter_format.golden import MAX_GOLDEN_BYTES
from loraplane.adapter_format.peft_config import MAX_CONFIG_BYTES
from loraplane.adapter_format.validation import MAX_WEIGHTS_BYTES

CHUNK_BYTES = 1 << 20
FETCH_DEADLINE_SECONDS = 600.0  # a multi-GB adapter over a slow link, not forever


@dataclass(frozen=True)
class FetchBounds:
    """What one fetch of an adapter's files may take: bytes per file and a deadline for all."""

    deadline: float  # time.monotonic() past which the fetch stops (TimeoutError, a transient failure)
    max_weights_bytes: int = MAX_WEIGHTS_BYTES
    # Told of each chunk before it is written; raises to refuse it (the node cache counts a fetch's
    # bytes against its bound while they land, evicting to make room or refusing when it cannot).
    on_bytes: Callable[[int], None] | None = None

    @classmethod
    def within(
        cls, seconds: float = FETCH_DEADLINE_SECONDS, *, max_weights_bytes: int = MAX_WEIGHTS_BYTES,
        on_bytes: Callable[[int], None] | None = None,
    ) -> FetchBounds:  # fmt: skip
        return cls(time.monotonic() + seconds, max_weights_bytes, on_bytes)

    def cap(self, name: str) -> int:
        """A file's byte cap: the weights' is the engine's ``max_adapter_bytes``; the files
        validation reads whole have their own."""
        return {WEIGHTS_FILE: self.max_weights_bytes, CONFIG_FILE: MAX_CONFIG_BYTES, GOLDEN_FILE: MAX_GOLDEN_BYTES}[name]

    def check_size(self, name: str, size: int, where: str) -> None:
        """An object's listed size against its cap, before any of it is read."""
        if size > self.cap(name):
            raise _too_large(name, self.cap(name), where)

    def check_time(self, where: str) -> None:
        if time.monotonic() > self.deadline:
            raise TimeoutError(f"{where}: the fetch ran past its deadline")


def _too_large(name: str, cap: int, where: str) -> AdapterValidationError:
    return AdapterValidationError(ErrorCode.TOO_LARGE, f"{name} in {where} is larger than its limit of {cap} bytes")


def write_capped(chunks: Iterable[bytes], target: Path, cap: int, bounds: FetchBounds, where: str) -> int:
    """Write ``chunks`` to a new file ``target``, stopping at ``cap`` bytes (``TooLarge``) and at the
    deadline (``TimeoutError``); a stopped file is removed. Returns the bytes written."""
    written = 0
    try:
        with target.open("xb") as fh:
            for chunk in chunks:
                bounds.check_time(where)
                written += len(chunk)
                if written > cap:
                    raise _too_large(target.name, cap, where)
                if bounds.on_bytes is not None:
                    bounds.on_bytes(len(chunk))
                fh.write(chunk)
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    return written


def response_chunks(response: Any) -> Iterator[bytes]:
    """An HTTP response's body as it arrives (urllib3's ``read1``: whatever the socket has, up to a
    chunk), so a store that trickles is checked against the deadline at each piece rather than
    after a whole chunk has crawled in. A store that sends nothing at all is the client's read
    timeout's to end (``S3Settings.client``)."""
    while chunk := response.read1(CHUNK_BYTES):
        yield chunk


def file_chunks(path: Path, cap: int) -> Iterable[bytes]:
    """A local file's bytes in chunks, at most one byte past ``cap`` read."""
    with path.open("rb") as fh:
        left = cap + 1
        while left > 0 and (chunk := fh.read(min(CHUNK_BYTES, left))):
            left -= len(chunk)
            yield chunk
