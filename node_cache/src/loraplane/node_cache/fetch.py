"""One adapter version's files in a store: a verified hit, or a fetch from its source committed
under its content address. The caller holds the folder for reading until ``store.release``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraplane.adapter_format.download import FetchBounds
from loraplane.adapter_format.sources import S3Settings, open_source
from loraplane.adapter_format.validation import MAX_WEIGHTS_BYTES
from loraplane.node_cache.store import DiskCache


@dataclass(frozen=True)
class Acquired:
    weights_digest: str  # "sha256:<hex>" of the weights file, hashed as the folder was written or verified
    folder: Path
    tier: str  # "disk": already in the store; "cold": fetched from the source just now


def acquire(
    store: DiskCache, source: str, digest: str | None, s3: S3Settings | None, max_weights_bytes: int = MAX_WEIGHTS_BYTES
) -> Acquired:
    """Without a declared digest nothing cached can be trusted to be this source's current files,
    so it is fetched (and cached for the next registration that declares one). A fetch stops at
    each file's cap and its deadline as it streams, and its bytes count against the store's bound
    as they land."""
    hit = store.get(source, digest) if digest else None
    if hit is not None:
        return Acquired(hit[0], hit[1], "disk")
    staged = store.staging()
    try:
        bounds = FetchBounds.within(max_weights_bytes=max_weights_bytes, on_bytes=lambda n: store.land(staged, n))
        open_source(source, s3).fetch(staged, bounds)
        weights, folder = store.commit(staged, source)
    except BaseException:
        store.discard(staged)
        raise
    return Acquired(weights, folder, "cold")
