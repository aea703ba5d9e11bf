"""Where a device-resident adapter's weights live: one ``SlotStore`` chosen once when the manager
is built, so the manager never asks which memory layout it has.

- ``StaticSlots``: each slot reserves ``max_lora_rank`` rows for every projection (vLLM's layout).
- ``UnifiedPages``: S-LoRA's unified paging. A slot's rows live in pages of the KV cache's own
  block pool, an adapter takes the pages its rank needs, and KV pressure takes pages back from
  idle adapters (``on_kv_short``).

Both keep a free list of slot indices and hand out the lowest free one, so which slot an adapter
gets does not depend on the order earlier ones left.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplane.serving.lora.peft_loader import LoadedAdapter
from loraplane.serving.lora.shared_pages import SharedPages
from loraplane.serving.lora.slot_table import PagedSlotTable, SlotTable


@dataclass
class Placement:
    slot: int
    pages: list[int] = field(default_factory=list)  # unified paging: the pool pages holding its rows


class StaticSlots:
    def __init__(self, table: SlotTable) -> None:
        self.table = table
        self._free = list(range(table.num_slots))  # a heap: the lowest free slot first

    @property
    def num_slots(self) -> int:
        return self.table.num_slots

    def make_room(self, loaded: LoadedAdapter, evict_one: Callable[[], bool]) -> bool:
        """Whether ``loaded`` fits once a slot is free, calling ``evict_one`` (an idle adapter
        off the device; False when none is left) until it does. A static slot always fits."""
        return True

    def on_kv_short(self, evict_one: Callable[[], bool]) -> None:
        """Static slots share nothing with the KV cache."""

    def place(self, loaded: LoadedAdapter) -> Placement:
        """Take a free slot (the device tier has admitted the adapter, so one is free) and write
        the weights into it."""
        slot = heapq.heappop(self._free)
        self.table.write(slot, loaded.weights, loaded.manifest.scaling)
        return Placement(slot)

    def clear(self, placement: Placement) -> None:
        self.table.clear(placement.slot)
        heapq.heappush(self._free, placement.slot)


class UnifiedPages(StaticSlots):
    table: PagedSlotTable

    def __init__(self, table: PagedSlotTable, pages: SharedPages) -> None:
        super().__init__(table)
        self.pages = pages

    def make_room(self, loaded: LoadedAdapter, evict_one: Callable[[], bool]) -> bool:
        need = self.table.pages_needed(loaded.weights)
        while self.pages.num_free < need and evict_one():
            pass
        return self.pages.num_free >= need  # else KV and busy adapters hold the pool: retry later

    def on_kv_short(self, evict_one: Callable[[], bool]) -> None:
        def reclaim(needed: int) -> None:
            """KV is short of ``needed`` pages: idle adapters give theirs back, in eviction order."""
            target = self.pages.num_free + needed
            while self.pages.num_free < target and evict_one():
                pass

        self.pages.reclaim = reclaim

    def place(self, loaded: LoadedAdapter) -> Placement:
        pages = self.pages.take_pages(self.table.pages_needed(loaded.weights))
        assert pages is not None, "make_room said it fits"
        slot = heapq.heappop(self._free)
        self.table.write_paged(slot, loaded.weights, loaded.manifest.scaling, pages)
        return Placement(slot, pages)

    def clear(self, placement: Placement) -> None:
        super().clear(placement)
        if placement.pages:
            self.table.zero_pages(placement.pages)
            self.pages.return_pages(placement.pages)


def slot_store(table: SlotTable, pages: SharedPages | None) -> StaticSlots:
    """The store for this table: unified pages when the engine shares its block pool."""
    if pages is None:
        return StaticSlots(table)
    if not isinstance(table, PagedSlotTable):
        raise TypeError("unified paging needs a PagedSlotTable")
    return UnifiedPages(table, pages)
