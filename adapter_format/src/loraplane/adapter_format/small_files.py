"""The small files an adapter folder holds beside its weights (its config, its golden outputs), read
with a cap on their bytes before anything parses them: a namespace user writes these files, and
the operator that validates them runs in a few hundred MiB."""

from __future__ import annotations

from pathlib import Path

from loraplane.adapter_format.errors import AdapterValidationError, ErrorCode


def read_capped(path: Path, max_bytes: int) -> bytes:
    """A small file's bytes, refused with ``TooLarge`` when it has more than ``max_bytes``: read
    at most one byte past the cap, whatever its size says (it may grow while it is read)."""
    with path.open("rb") as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise AdapterValidationError(ErrorCode.TOO_LARGE, f"{path.name} is larger than its limit of {max_bytes} bytes")
    return data
