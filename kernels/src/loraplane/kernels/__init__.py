"""Gathered low-rank kernels for mixed-adapter batches (Punica's SGMV and BGMV).

For a row ``i`` whose adapter sits in slot ``s(i)``::

    y_i += scale[s] * (x_i @ A[s, :rank[s]].T) @ B[s, :rank[s]]

where the base product ``x @ W.T`` was computed once for the whole batch. ``shrink`` does the
first product into a float32 buffer, ``expand`` the second, adding in place into ``y``. SGMV takes
contiguous segments of rows sharing a slot (prefill); BGMV takes one slot per row (decode).
Slot ``-1`` means "no adapter": the row keeps its base output.

The slot layout is described in :mod:`loraplane.kernels.layout`. Each op has one signature; it
runs Triton on CUDA tensors and the CPU path (:mod:`loraplane.kernels.cpu`) otherwise, or what
``backend=`` asks for ("triton" runs under ``TRITON_INTERPRET=1`` on CPU in the tests).
"""

from loraplane.kernels.dispatch import add_lora, bgmv_expand, bgmv_shrink, sgmv_expand, sgmv_shrink
from loraplane.kernels.layout import LoraSlots, SlotLayoutError, StackedLoraSlots
from loraplane.kernels.paged_layout import PagedLoraSlots
from loraplane.kernels.reference import reference_add_lora, segments_to_rows

__all__ = [
    "LoraSlots",
    "PagedLoraSlots",
    "SlotLayoutError",
    "StackedLoraSlots",
    "add_lora",
    "bgmv_expand",
    "bgmv_shrink",
    "reference_add_lora",
    "segments_to_rows",
    "sgmv_expand",
    "sgmv_shrink",
]
