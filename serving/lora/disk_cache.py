"""Node-local disk cache of adapter folders, content-addressed by the weights' sha256.

One folder per digest under ``<cache_dir>/adapters``. A fetch lands in a private temporary
folder and is renamed into place, so replicas on the same node can share the directory and a
crash mid-download leaves nothing half-written behind a digest name. Entries survive restarts;
a second fetch of a known digest is a local read.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from loraplane.adapter_format import file_digest, parse_digest
from loraplane.adapter_format.validation import WEIGHTS_FILE


class DiskCache:
    def __init__(self, root: Path) -> None:
        self.root = root / "adapters"
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, digest: str) -> Path:
        return self.root / parse_digest(digest).removeprefix("sha256:")

    def get(self, digest: str) -> Path | None:
        folder = self.path(digest)
        return folder if (folder / WEIGHTS_FILE).is_file() else None

    def staging(self) -> Path:
        return Path(tempfile.mkdtemp(prefix=".fetch-", dir=self.root))

    def commit(self, staged: Path) -> tuple[str, Path]:
        """Move a fetched folder into place under its digest; returns (digest, folder)."""
        digest = file_digest(staged / WEIGHTS_FILE)
        target = self.path(digest)
        try:
            os.rename(staged, target)
        except OSError:  # another replica put the same content there first
            shutil.rmtree(staged, ignore_errors=True)
        return digest, target

    def discard(self, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)
