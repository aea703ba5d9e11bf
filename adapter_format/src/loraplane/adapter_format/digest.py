"""Content digests in the ``sha256:<hex>`` form OCI and Kubernetes users already know.

An adapter's digest covers everything that changes what it computes: its PEFT config (for
example ``lora_alpha``, which sets the scaling), its weights, and its golden outputs (the
quality gate's reference), as the sha256 over one ``name=sha256:<hex>`` line per file in a fixed
order (``-`` for an absent golden file). Manifests written before it declared the digest of
the weights file alone; that form is refused unless a server is told to accept it during a
migration (``requireAdapterDigest: false``; "Digests" in ``docs/gitops.md``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path

from loraplane.adapter_format.errors import AdapterValidationError, ErrorCode

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
GOLDEN_FILE = "golden_outputs.json"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE, GOLDEN_FILE)  # the order the adapter digest lists them in
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


def file_digests(folder: Path, weights_digest: str | None = None) -> dict[str, str]:
    """Each adapter file's digest (``-`` for an absent one). ``weights_digest``, when the caller has
    just hashed this very weights file, spares hashing a large file twice."""
    digests = {name: file_digest(folder / name) if (folder / name).is_file() else "-" for name in (CONFIG_FILE, GOLDEN_FILE)}
    digests[WEIGHTS_FILE] = weights_digest or file_digest(folder / WEIGHTS_FILE)
    return digests


def adapter_digest(folder: Path, digests: Mapping[str, str] | None = None) -> str:
    """The adapter's digest: config, weights and golden outputs together (``digests`` from
    :func:`file_digests`, when the caller already has them)."""
    digests = digests or file_digests(folder)
    listing = "\n".join(f"{name}={digests[name]}" for name in ADAPTER_FILES)
    return f"sha256:{hashlib.sha256(listing.encode()).hexdigest()}"
