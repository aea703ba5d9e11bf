"""A step's LoRA batch: which adapter slot each row uses, in the forms the kernels take, planned once
per step and read by every LoRA layer (the role of vLLM's punica wrapper).

The engine's runner plans it on the host from each row's slot (:func:`plan`): the runs of equal
slots (SGMV's segments), the longest run, and whether this step's adapter products go by
segments at all, which depends on the backend. It sends the plan's index arrays to the device
with the rest of the step's metadata in one copy and hands the resulting :class:`LoraBatch` to
the model through the step context. A layer then calls :meth:`LoraBatch.add` once per projection
with its slices: the batch knows the backend, the row form and the precision the products run
in; the layer knows only which of its slices an adapter may target. Nothing here reads a device
tensor back, so a step's launches never wait for the GPU.

Semantics (per projection, for each of its slices ``(offset, slots)``)::

    y[i, offset:offset+N] += scalings[s] * (x[i] @ A[s, :r].T) @ B[s, :r]     s = row_slots[i], r = ranks[s]
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from loraplane.kernels import cpu, dispatch  # ops registers torch.ops.loraplane.*
from loraplane.kernels.layout import LoraSlots, StackedLoraSlots
from loraplane.kernels.paged_layout import PagedLoraSlots
from loraplane.kernels.tiles import tile_capacity, tiles

Slices = Sequence[tuple[int, LoraSlots | PagedLoraSlots]]  # (output offset, slots) per slice of a projection


@dataclass(frozen=True)
class LoraPlan:
    """A step's rows on the host, before they cross to the device: the runs of rows with the same
    slot (-1: none; ``seg_starts`` has one more entry than ``seg_slots``), the longest run, and
    whether the kernels take the rows by segments."""

    seg_starts: list[int]
    seg_slots: list[int]
    max_seg_len: int
    by_segments: bool
    used: frozenset[int]  # the slots some row uses


def plan(runs: Sequence[tuple[int, int]], backend: str, activation_dtype: torch.dtype) -> LoraPlan | None:
    """The plan of a step whose rows come in ``runs`` of (slot, rows), in row order (the runner's
    sequences: each sequence's rows share its slot), or None when no row uses an adapter (the
    layers then skip LoRA entirely). Its cost is per run, not per row.

    Segments go to the kernels where they pay: the Triton segment kernel whenever some run is
    longer than one row; the CPU path only when a run is long enough for BLAS
    (``cpu.segments_pay``), the row kernel for every row otherwise. Decided here, once a step:
    the layers take what they are given (the dispatcher's own check is for its direct callers)."""
    used = frozenset(slot for slot, n in runs if n) - {-1}
    if not used:
        return None
    starts, slots = [0], list[int]()
    for slot, n in runs:
        if not n:
            continue
        if slots and slot == slots[-1]:
            starts[-1] += n
            continue
        slots.append(slot)
        starts.append(starts[-1] + n)
    longest = max(b - a for a, b in itertools.pairwise(starts))
    by_segments = len(slots) < starts[-1]
    if backend == "cpu":
        by_segments = by_segments and cpu.segments_pay(longest, activation_dtype)
    return LoraPlan(starts, slots, longest, by_segments, used)


def cpu_row_slices(slices: Slices) -> cpu.RowSlices | None:
    """``slices`` prepared for the CPU's one-call row kernel (:meth:`LoraBatch.add`'s
    ``prepared``), or None where a slice cannot be viewed in place: a paged table, slots off the
    CPU or not float32. Made once per projection and set of active modules, not per step."""
    views = []
    for offset, slots in slices:
        host = slots.host if isinstance(slots, LoraSlots) else None
        if host is None:
            return None
        views.append((offset, host))
    return cpu.RowSlices(views) if views else None


def segment_tile_capacity(tokens: int, segments: int) -> int:
    """Entries of both SGMV work lists for up to ``segments`` segments over ``tokens`` rows (the
    expand's row blocks are the shorter, so its list is the longer)."""
    from loraplane.kernels import sgmv

    return tile_capacity(tokens, segments, min(sgmv.SHRINK_BLOCK_M, sgmv.EXPAND_BLOCK_M))


def segment_tiles(seg_starts: Sequence[int] | np.ndarray, capacity: int) -> np.ndarray:
    """The SGMV shrink's and expand's work lists of these segments, [2, capacity, 2] int32
    (``LoraBatch.seg_tiles``), each in its kernel's row blocks."""
    from loraplane.kernels import sgmv

    return np.stack([tiles(seg_starts, sgmv.SHRINK_BLOCK_M, capacity), tiles(seg_starts, sgmv.EXPAND_BLOCK_M, capacity)])


@dataclass(frozen=True)
class LoraBatch:
    """The step's rows on the device, in both forms the kernels take: ``row_slots`` [T] (BGMV) is
    always set; ``seg_starts``/``seg_slots`` (SGMV) when the plan takes segments. ``active_modules``
    lists the target modules that at least one row's adapter touches; the others skip the adapter
    kernels entirely. ``max_seg_len`` is known on the host, so the SGMV grid never reads the
    device. ``backend`` is the kernels' (``dispatch.Backend``)."""

    row_slots: torch.Tensor
    seg_starts: torch.Tensor | None
    seg_slots: torch.Tensor | None
    active_modules: frozenset[str]
    max_seg_len: int = 1
    backend: str = "auto"
    # The segments' work lists [2, capacity, 2] (shrink, expand; kernels.tiles): a CUDA graph's
    # fixed grid, for the Triton backend's steps with prompts replayed from a graph.
    seg_tiles: torch.Tensor | None = None

    def add(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        slices: Slices,
        stacked: StackedLoraSlots | None = None,
        prepared: cpu.RowSlices | None = None,
    ) -> None:
        """Add every slice's adapter products of one projection into its output ``y`` [T, out]
        (in place), for input ``x`` [T, in]. With the projection's ``stacked`` table (a fused
        projection on the Triton backend), all its slices go in one launch each way; a slice no
        row's adapter targets has rank 0 there, and its programs exit at once.

        A CPU step given segments (the plan gives them only when one is long enough for BLAS)
        hands x and y to the segment path as they are: it computes in x's precision and adds each
        long segment's block straight into y (activation-sized float32 copies of x and y per call
        cost a bfloat16 prefill more than its adapter products). Other steps, short prompts among
        decodes included, run in the slots' precision (float32 on the CPU), with x converted and y
        widened once for all slices, so each element of a low-precision y is rounded once; with
        the projection's ``prepared`` slices (:func:`cpu_row_slices` of the same ``slices``), all
        of them go in one call of the CPU row kernel."""
        if not slices:
            return
        if stacked is not None and self.backend != "cpu":
            xs = x if x.dtype == stacked.dtype else x.to(stacked.dtype)
            acc = y if y.dtype == stacked.dtype else y.to(stacked.dtype)
            torch.ops.loraplane.add_lora_stacked(
                acc, xs, stacked.lora_a, stacked.lora_b, stacked.ranks, stacked.scalings, self.row_slots, self.seg_starts,
                self.seg_slots, self.seg_tiles, list(stacked.offsets), list(stacked.sizes), self.max_seg_len, self.backend,
            )  # fmt: skip
            if acc is not y:
                y.copy_(acc)
            return
        slot_dtype = slices[0][1].dtype
        cpu_prefill = self.backend == "cpu" and self.seg_starts is not None
        xs = x if x.dtype == slot_dtype or cpu_prefill else x.to(slot_dtype)
        acc = y if y.dtype == slot_dtype or cpu_prefill else y.to(slot_dtype)
        if prepared is not None and self.backend == "cpu" and self.seg_starts is None and acc.is_contiguous():
            cpu.add_lora_slices(acc, xs, prepared, self._host_row_slots)
        else:
            for offset, slots in slices:
                self._add_slice(acc, xs, slots, offset)
        if acc is not y:
            y.copy_(acc)

    @functools.cached_property
    def _host_row_slots(self) -> np.ndarray:
        """``row_slots`` as numpy int32, made once a step for its some 120 projections."""
        return cpu._i32(self.row_slots)

    def _add_slice(self, y: torch.Tensor, x: torch.Tensor, slots: LoraSlots | PagedLoraSlots, y_offset: int) -> None:
        """One slice through the op for its slot layout (the paged one always runs by rows: it has
        no segment kernel).

        The CPU backend calls the dispatcher directly: its path is never traced or captured, and a
        custom op's dispatch costs about 45 us a call on a CPU, some 200 calls a step for a
        30-layer model (measured on the embedded base, against 20 us for the whole call without
        it). Segments given go to the dispatcher's segment path; without them the call goes by the
        rows the runner already built, which the dispatcher would otherwise rebuild from segments
        in every call, some 14 us each. Other backends go through the custom ops
        (``kernels.ops``), so a traced or captured model sees one opaque node per launch."""
        paged = isinstance(slots, PagedLoraSlots)
        if self.backend == "cpu":
            if self.seg_starts is not None and self.seg_slots is not None and not paged:
                dispatch.add_lora(
                    y, x, slots, seg_starts=self.seg_starts, seg_slots=self.seg_slots, y_offset=y_offset, backend="cpu",
                    check=False, max_seg_len=self.max_seg_len,
                )  # fmt: skip
            else:
                dispatch.add_lora(y, x, slots, row_slots=self.row_slots, y_offset=y_offset, backend="cpu", check=False)
            return
        if isinstance(slots, PagedLoraSlots):
            torch.ops.loraplane.add_lora_paged(
                y, x, slots.pool, slots.a_offsets, slots.b_offsets, slots.ranks, slots.scalings, self.row_slots, y_offset,
                slots.in_features, slots.out_features, self.backend,
            )  # fmt: skip
            return
        torch.ops.loraplane.add_lora(
            y, x, slots.lora_a, slots.lora_b, slots.ranks, slots.scalings, self.row_slots, self.seg_starts, self.seg_slots,
            self.seg_tiles, y_offset, self.max_seg_len, self.backend,
        )  # fmt: skip
