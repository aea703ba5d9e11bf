"""Content digests in the ``sha256:<hex>`` form OCI and Kubernetes users already know."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from loraplane.adapter_format.errors import AdapterValidationError, ErrorCode

_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def parse_digest(value: str) -> str:
    if not _DIGEST.match(value):
        raise AdapterValidationError(
            ErrorCode.BAD_CONFIG, f"digest {value!r} is not of the form sha256:<64 lowercase hex digits>"
        )
    return value


def file_digest(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while chunk := fh.read(chunk_bytes):
            h.update(chunk)
    return f"sha256:{h.hexdigest()}"
