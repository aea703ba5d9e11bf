"""One buffer of equal pages that the KV cache and adapter weights share (S-LoRA's unified paging).

A page is exactly one KV block: the keys and values of ``block_size`` tokens for every layer. The
block manager hands pages out to sequences (as KV blocks) and to adapters (as rows of their A and
B matrices, packed by :class:`~loraplane.serving.lora.slot_table.PagedSlotTable`), so memory moves
between the two as load shifts instead of being split up front. The buffer is raw bytes: KV views
it in the model dtype, adapter rows view it as float32, the precision the CPU kernels read.
"""

from __future__ import annotations

import torch


class PagePool:
    def __init__(self, num_pages: int, page_bytes: int, device: torch.device | str = "cpu") -> None:
        if page_bytes % 4:
            raise ValueError(f"page size {page_bytes} bytes is not a whole number of float32 values")
        self.data = torch.zeros(num_pages, page_bytes, dtype=torch.uint8, device=device)
        self.num_pages, self.page_bytes = num_pages, page_bytes

    @property
    def page_floats(self) -> int:
        return self.page_bytes // 4

    def flat_f32(self) -> torch.Tensor:
        return self.data.view(torch.float32).view(-1)

    def kv_views(
        self, layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as ``[layers, num_pages, block_size, kv_heads, head_dim]`` views of the pages."""
        pages = self.data.view(dtype).view(self.num_pages, 2, layers, block_size, kv_heads, head_dim)
        return pages[:, 0].transpose(0, 1), pages[:, 1].transpose(0, 1)
