"""What unified paging needs of the KV cache's block pool, as the adapter manager sees it.

A protocol rather than the engine's ``BlockManager`` itself, so the LoRA layer does not import the
engine above it: the engine hands its block manager in, and the manager gives it ``reclaim`` so KV
pressure can take pages back from idle adapters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class SharedPages(Protocol):
    reclaim: Callable[[int], None] | None  # set by the adapter manager: free up to n pages

    @property
    def num_free(self) -> int: ...

    def take_pages(self, n: int) -> list[int] | None:
        """``n`` pages for an adapter's weights, or None (and nothing taken) if they are not free."""

    def return_pages(self, pages: list[int]) -> None: ...
