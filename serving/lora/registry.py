"""Which adapter sits in which slot, under which weights digest.

The digest is part of every prefix-cache key (see the block manager): the same name reloaded
with new weights must not reuse KV computed under the old ones. Which adapters are resident and
how they get there is the tier manager's job; this registry is the fixed set an engine starts
with plus explicit load and unload calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from loraplane.adapter_format import BaseShape, ValidationLimits, check_adapter_name
from loraplane.serving.lora.peft_loader import load_peft_adapter
from loraplane.serving.lora.slot_table import SlotTable


class AdapterNotFound(KeyError):
    def __str__(self) -> str:
        return f"adapter {self.args[0]!r} is not loaded"


class AdapterBusy(RuntimeError):
    pass


@dataclass(frozen=True)
class ResidentAdapter:
    name: str
    slot: int
    digest: str
    rank: int
    target_modules: tuple[str, ...]
    path: str

    @property
    def cache_key(self) -> str:
        return f"{self.name}@{self.digest}"


class LoraRegistry:
    def __init__(self, table: SlotTable, base: BaseShape, limits: ValidationLimits, dtype: torch.dtype) -> None:
        self.table, self.base, self.limits, self.dtype = table, base, limits, dtype
        self.adapters: dict[str, ResidentAdapter] = {}
        self.in_use: dict[str, int] = {}

    def get(self, name: str) -> ResidentAdapter:
        try:
            return self.adapters[name]
        except KeyError:
            raise AdapterNotFound(name) from None

    def load(self, name: str, folder: str | Path, *, expected_digest: str | None = None) -> ResidentAdapter:
        """Validate and load; replaces an idle adapter of the same name (a new version)."""
        check_adapter_name(name)
        if self.in_use.get(name):
            raise AdapterBusy(f"adapter {name!r} has {self.in_use[name]} running requests; it cannot be replaced now")
        loaded = load_peft_adapter(folder, self.base, self.limits, expected_digest=expected_digest, dtype=self.dtype)
        old = self.adapters.get(name)
        used = {a.slot for a in self.adapters.values()}
        slot = old.slot if old else next((s for s in range(self.table.num_slots) if s not in used), None)
        if slot is None:
            raise AdapterBusy(f"all {self.table.num_slots} adapter slots (max_loras) are taken; unload one first")
        self.table.write(slot, loaded.weights, loaded.manifest.scaling)
        m = loaded.manifest
        adapter = ResidentAdapter(name, slot, m.digest, m.rank, m.target_modules, str(folder))
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        adapter = self.get(name)
        if self.in_use.get(name):
            raise AdapterBusy(f"adapter {name!r} has {self.in_use[name]} running requests")
        self.table.clear(adapter.slot)
        del self.adapters[name]

    def acquire(self, name: str) -> ResidentAdapter:
        adapter = self.get(name)
        self.in_use[name] = self.in_use.get(name, 0) + 1
        return adapter

    def release(self, name: str) -> None:
        self.in_use[name] -= 1
        if not self.in_use[name]:
            del self.in_use[name]
