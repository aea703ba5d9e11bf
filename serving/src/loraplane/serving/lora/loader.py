"""Bringing one adapter version into host memory: its files from the adapter files provider (the
process's own disk cache, or the node agent's cache on this node), then validated against the
base and read into tensors. Runs on the loader pool's threads (or a caller's own), touching no
engine state."""

from __future__ import annotations

import dataclasses
import time

from loraplane.adapter_format import BaseShape, ValidationLimits
from loraplane.serving.lora.adapter_files import AdapterFiles
from loraplane.serving.lora.entries import AdapterSpec, Fetched
from loraplane.serving.lora.peft_loader import load_peft_adapter


class AdapterLoader:
    def __init__(self, base: BaseShape, limits: ValidationLimits, files: AdapterFiles) -> None:
        self.base, self.limits, self.files = base, limits, files

    def load(self, spec: AdapterSpec) -> Fetched:
        start = time.perf_counter()
        got = self.files.acquire(spec.source, spec.digest)
        limits = dataclasses.replace(self.limits, allow_rank_truncation=spec.allow_rank_truncation)
        try:
            # The cache hashed the weights as it wrote or verified the folder: not hashed twice.
            loaded = load_peft_adapter(
                got.folder, self.base, limits, expected_digest=spec.digest, weights_digest=got.weights_digest
            )
        finally:
            self.files.release(got)
        return loaded, got.tier, time.perf_counter() - start
