"""Bringing one adapter version into host memory: from the node's disk cache when a verified copy
is there, else fetched from its source (a folder, file:// or s3://) into the cache, then validated
against the base and read into tensors. Runs on the loader pool's threads (or a caller's own),
touching no engine state."""

from __future__ import annotations

import dataclasses
import time

from loraplane.adapter_format import BaseShape, ValidationLimits
from loraplane.adapter_format.sources import S3Settings, open_source
from loraplane.serving.lora.disk_cache import DiskCache
from loraplane.serving.lora.entries import AdapterSpec, Fetched
from loraplane.serving.lora.peft_loader import load_peft_adapter


class AdapterLoader:
    def __init__(self, base: BaseShape, limits: ValidationLimits, disk: DiskCache, s3: S3Settings | None) -> None:
        self.base, self.limits, self.disk, self.s3 = base, limits, disk, s3

    def load(self, spec: AdapterSpec) -> Fetched:
        start = time.perf_counter()
        hit = self.disk.get(spec.source, spec.digest) if spec.digest else None
        if hit is not None:
            tier, (weights, folder) = "disk", hit  # verified against its content address
        else:
            tier = "cold"
            staged = self.disk.staging()
            try:
                open_source(spec.source, self.s3).fetch(staged)
                weights, folder = self.disk.commit(staged, spec.source)
            except BaseException:
                self.disk.discard(staged)
                raise
        limits = dataclasses.replace(self.limits, allow_rank_truncation=spec.allow_rank_truncation)
        try:
            # The cache hashed the weights as it wrote or verified the folder: not hashed twice.
            loaded = load_peft_adapter(folder, self.base, limits, expected_digest=spec.digest, weights_digest=weights)
        finally:
            self.disk.release(folder)
        return loaded, tier, time.perf_counter() - start
