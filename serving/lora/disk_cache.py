"""Node-local disk cache of adapter folders, content-addressed.

Each fetched folder is stored under the sha256 of its contents (the config, the weights and the
golden outputs together: two adapters with the same weights but different ``lora_alpha`` or
target modules are different adapters). A small alias per source URI records which content that
source last gave and the weights' digest, so a restart with the same registration (source and
declared weights digest) is a local read. A fetch lands in a private temporary folder and is
renamed into place, so replicas on one node can share the directory and a crash mid-download
leaves nothing half-written under a content name.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from loraplane.adapter_format import file_digest, parse_digest
from loraplane.adapter_format.golden import GOLDEN_FILE
from loraplane.adapter_format.validation import CONFIG_FILE, WEIGHTS_FILE

CONTENT_FILES = (CONFIG_FILE, WEIGHTS_FILE, GOLDEN_FILE)


def _alias_name(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:40] + ".json"


class DiskCache:
    def __init__(self, root: Path) -> None:
        self.root = root / "adapters"
        self.aliases = self.root / "by-source"
        self.aliases.mkdir(parents=True, exist_ok=True)

    def get(self, source: str, weights_digest: str) -> Path | None:
        """The cached folder for this source if it holds weights with this digest."""
        try:
            alias = json.loads((self.aliases / _alias_name(source)).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if alias.get("weights") != parse_digest(weights_digest):
            return None
        folder = self.root / str(alias.get("content", ""))
        return folder if (folder / WEIGHTS_FILE).is_file() else None

    def staging(self) -> Path:
        return Path(tempfile.mkdtemp(prefix=".fetch-", dir=self.root))

    def commit(self, staged: Path, source: str) -> tuple[str, Path]:
        """Move a fetched folder into place under its content digest; returns (weights digest, folder)."""
        weights = file_digest(staged / WEIGHTS_FILE)
        parts = [f"{name}={file_digest(staged / name) if (staged / name).is_file() else '-'}" for name in CONTENT_FILES]
        content = hashlib.sha256("\n".join(parts).encode()).hexdigest()
        target = self.root / content
        try:
            os.rename(staged, target)
        except OSError:  # the same content is already there (another adapter or replica)
            shutil.rmtree(staged, ignore_errors=True)
        alias = self.aliases / _alias_name(source)
        tmp = alias.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"source": source, "weights": weights, "content": content}))
        os.replace(tmp, alias)
        return weights, target

    def discard(self, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)
