"""Read a safetensors file's header (names, dtypes, shapes) without torch or numpy.

Written by hand rather than with ``safetensors.safe_open``: that needs a framework (numpy at
least) and the operator must stay free of both. The format is an 8-byte little-endian header
length, a JSON header, then the raw buffer; checking offsets against the file size catches
truncated and corrupt files before anything is mapped.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from loraplane.adapter_format.errors import AdapterValidationError, ErrorCode

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
# An adapter's header names its tensors: a 128-layer model's adapter on all seven projections has
# 1,792 of them, about 300 KB of header. The reference implementation allows 100 MiB, which parses
# to about 1 GiB of Python objects: more than an operator pod holds. Refused before it is read.
MAX_HEADER_BYTES = 4 * 2**20


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]  # absolute byte range in the file, header included


def _corrupt(path: Path, why: str) -> AdapterValidationError:
    return AdapterValidationError(ErrorCode.CORRUPT_SAFETENSORS, f"{path.name}: {why}")


def read_safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise _corrupt(path, "shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise _corrupt(path, f"header length {n} does not fit a {size}-byte file")
        if n > MAX_HEADER_BYTES:
            raise AdapterValidationError(
                ErrorCode.TOO_LARGE, f"{path.name}: a {n}-byte header is above the limit of {MAX_HEADER_BYTES} bytes"
            )
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise _corrupt(path, "header is not valid JSON") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    data_bytes = size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise _corrupt(path, f"tensor {name!r} lacks dtype, shape or data_offsets") from None
        if dtype not in DTYPE_BYTES:
            raise _corrupt(path, f"tensor {name!r} has unknown dtype {dtype!r}")
        if not (0 <= start <= end <= data_bytes) or end - start != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise _corrupt(path, f"tensor {name!r} data offsets {start}..{end} do not match its shape or the file size")
        tensors[name] = TensorInfo(dtype, shape, (8 + n + int(start), 8 + n + int(end)))
    return tensors
