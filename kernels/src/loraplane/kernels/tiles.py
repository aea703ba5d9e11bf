"""Work lists: a grid that does not depend on the step's sequences, for CUDA graphs with prompts.

The segment kernels (SGMV, paged attention) size their grid from the step on the host: a program
per (segment, block of rows), as many row blocks as the longest segment has. A CUDA graph bakes
the grid in, so a graph replayed for steps of other shapes needs programs that find their work in
device memory instead. A work list is that: one ``(group, block)`` pair per program, the group
being a segment (or a sequence, for attention) and the block its ``block``-row slice, built on the
host from the groups' starts and sent with the step's other metadata. Its length is bounded by the
step's tokens and groups, not by how they are split (:func:`tile_capacity`), so one graph per
token bucket serves any mix of prompts; entries past the step's own are ``(-1, 0)``, programs that
exit at once. vLLM's V1 LoRA kernels and its full-graph attention backends do the same with their
own metadata (tokens sorted by adapter; a scheduler's work tiles).

Semantics::

    tiles(starts, block)[t] = (g, b)  for every group g = 0..len(starts)-2, b < ceil(len_g / block), in order

:func:`program_work` is the kernels' side: a program's ``(group, block)`` from the list, or from
the grid's first two axes when the launch has no list (eager steps), so one kernel serves both.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import triton
import triton.language as tl


@triton.jit
def program_work(tiles_ptr, TILED: tl.constexpr):
    """(group, block, live) of this program: from the work list with ``TILED`` (a dead entry is
    group 0, not live), else the grid's first two axes (always live)."""
    if TILED:
        group = tl.load(tiles_ptr + 2 * tl.program_id(0))
        block = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)
    else:
        group = tl.program_id(0)
        block = tl.program_id(1)
    return tl.maximum(group, 0), block, group >= 0


def tile_capacity(tokens: int, groups: int, block: int) -> int:
    """The most work-list entries ``groups`` groups over ``tokens`` rows can need: each group's
    last block may be partial, so at most one entry per group more than the rows alone need."""
    return -(-tokens // block) + groups


def tiles(starts: Sequence[int] | np.ndarray, block: int, capacity: int | None = None) -> np.ndarray:
    """The work list [capacity, 2] int32 of groups whose rows start at ``starts`` (one more entry
    than groups), padded with (-1, 0) to ``capacity`` (default: exactly the entries needed)."""
    bounds = np.asarray(starts, dtype=np.int64)
    counts = -(-np.diff(bounds) // block)
    total = int(counts.sum())
    size = total if capacity is None else capacity
    if total > size:
        raise ValueError(f"{total} tiles of {block} rows do not fit a work list of {size}")
    out = np.zeros((size, 2), dtype=np.int32)
    out[total:, 0] = -1
    out[:total, 0] = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    first = np.cumsum(counts) - counts  # each group's first entry
    out[:total, 1] = np.arange(total, dtype=np.int32) - np.repeat(first, counts)
    return out
