"""The CPU path: numba-compiled loops over rows, used when the tensors are not on a GPU.

Why numba rather than torch ops: the adapter part is ~2r/d of the base FLOPs, but gathering
``A[ids]`` copies a full [rows, rank, in] tensor (about 90% of the base matmul's time at batch 64,
width 2048) and a Python loop over segments pays per-op overhead per adapter (about 35%). A
compiled loop reads each row's A and B rows in place, vectorises the dot products and spreads
rows over cores, with no per-adapter dispatch; it is compiled once and cached on disk. Every loop
releases the GIL (``nogil``), as torch's ops do, so the server's threads run beside a step.

The row kernels compute in float32 (the engine keeps CPU slots in float32) and convert other
inputs per call; a low-precision output is widened only in the columns a call owns and receives
its adapter sum with one rounding. Long prefill segments go through BLAS in the activations' own
precision instead (``add_lora_segments``).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from numba import njit, prange


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _shrink_rows(x: np.ndarray, a: np.ndarray, row_slots: np.ndarray, ranks: np.ndarray, out: np.ndarray) -> None:
    num_rows, k_dim = x.shape
    for t in prange(num_rows):
        slot = row_slots[t]
        if slot < 0:
            continue
        for r in range(ranks[slot]):
            acc = np.float32(0.0)
            for k in range(k_dim):
                acc += x[t, k] * a[slot, r, k]
            out[t, r] = acc


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _expand_rows(
    buf: np.ndarray, b: np.ndarray, row_slots: np.ndarray, ranks: np.ndarray, scalings: np.ndarray, y: np.ndarray, y_offset: int
) -> None:
    num_rows = y.shape[0]
    n_dim = b.shape[2]
    for t in prange(num_rows):
        slot = row_slots[t]
        if slot < 0:
            continue
        scale = scalings[slot]
        out = y[t, y_offset : y_offset + n_dim]  # a view: indexing it directly lets LLVM vectorise
        for r in range(ranks[slot]):
            c = buf[t, r] * scale
            row = b[slot, r]
            for n in range(n_dim):
                out[n] += c * row[n]


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _add_lora_slices_rows(
    x: np.ndarray,
    a: tuple[np.ndarray, ...],
    b: tuple[np.ndarray, ...],
    ranks: tuple[np.ndarray, ...],
    scalings: tuple[np.ndarray, ...],
    offsets: np.ndarray,
    row_slots: np.ndarray,
    y: np.ndarray,
) -> None:
    """Shrink and expand in one pass per row, for every slice of a projection in one call (q/k/v,
    gate/up: one tuple entry a slice, ``offsets[j]`` slice j's first column of y; a single slice
    is a one-entry tuple): one dispatch a projection instead of two a slice, and the rank-sized
    intermediate stays in a scalar instead of a shared buffer."""
    num_rows, k_dim = x.shape
    for t in prange(num_rows):
        slot = row_slots[t]
        if slot < 0:
            continue
        xrow = x[t]
        for j in range(len(a)):
            a_j, b_j = a[j], b[j]
            n_dim = b_j.shape[2]
            scale = scalings[j][slot]
            out = y[t, offsets[j] : offsets[j] + n_dim]
            for r in range(ranks[j][slot]):
                arow = a_j[slot, r]
                acc = np.float32(0.0)
                for k in range(k_dim):
                    acc += xrow[k] * arow[k]
                c = acc * scale
                brow = b_j[slot, r]
                for n in range(n_dim):
                    out[n] += c * brow[n]


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _add_lora_rows_paged(
    x: np.ndarray,
    pool: np.ndarray,
    a_off: np.ndarray,
    b_off: np.ndarray,
    row_slots: np.ndarray,
    ranks: np.ndarray,
    scalings: np.ndarray,
    y: np.ndarray,
    y_offset: int,
    n_dim: int,
) -> None:
    """``_add_lora_slices_rows`` for one slice, reading each A row and B^T row at its offset in
    the shared page pool."""
    num_rows, k_dim = x.shape
    for t in prange(num_rows):
        slot = row_slots[t]
        if slot < 0:
            continue
        scale = scalings[slot]
        xrow = x[t]
        out = y[t, y_offset : y_offset + n_dim]
        for r in range(ranks[slot]):
            arow = pool[a_off[slot, r] : a_off[slot, r] + k_dim]
            acc = np.float32(0.0)
            for k in range(k_dim):
                acc += xrow[k] * arow[k]
            c = acc * scale
            brow = pool[b_off[slot, r] : b_off[slot, r] + n_dim]
            for n in range(n_dim):
                out[n] += c * brow[n]


# A segment at least this long goes through BLAS (one [len, in] x [in, r] and one [len, r] x
# [r, out] matmul); shorter ones, the decode rows beside a prefill included, through the row
# kernel in one call. Inside an engine step BLAS pays tens of microseconds a segment before any
# work (the slot rows converted, two calls, the add), and its expand has an inner size of a rank,
# which the row kernel's fused loop matches; so rows win up to a few dozen tokens in bfloat16 and
# about a hundred in float32. Measured on engine steps (``benchmarks/cpu_segment_threshold.py``,
# docs/benchmarks.md) on a 2-core AMD EPYC with AVX-512 BF16: two 20-token prompts beside five
# decodes took 87 ms with BLAS from 48 tokens against 129 ms from 16 in bfloat16, 173 ms from
# 128 against 231 ms from 8 in float32; a 400-token prompt was as fast either way. Before, a mean
# segment length of 8 sent every segment of such a step through BLAS, decodes included.
SEGMENT_BLAS_MIN_LEN = {torch.float32: 128}
SEGMENT_BLAS_MIN_LEN_HALF = 48  # bfloat16 and float16


def blas_min_len(dtype: torch.dtype) -> int:
    """The shortest segment that goes through BLAS with activations in ``dtype``."""
    return SEGMENT_BLAS_MIN_LEN.get(dtype, SEGMENT_BLAS_MIN_LEN_HALF)


def segments_pay(max_seg_len: int, dtype: torch.dtype) -> bool:
    """Whether a step whose longest segment is ``max_seg_len`` tokens, with activations in
    ``dtype``, takes the segment path (``add_lora_segments``: BLAS for its long segments) rather
    than the row kernel for every row."""
    return max_seg_len >= blas_min_len(dtype)


def add_lora_segments(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    seg_starts: list[int],
    seg_slots: list[int],
    y_offset: int,
) -> None:
    """Per long segment: ``y[rows, off:off+N] += scale * (x[rows] @ A[:r].T) @ B[:r]`` through
    BLAS; the rows of the short segments (``segments_pay``'s length) through the row kernel, in
    one call on those rows alone.

    The products run in x's precision, the slot rows converted to it: BLAS accumulates in float32
    either way, and the rank-sized intermediate and the product are each rounded to x's precision,
    as PEFT's own half-precision path rounds them. In bfloat16 no activation-sized float32 copy of
    x is made, and the expand (inner size a rank) ran about three times faster than in float32 on
    a 2-core AVX-512 BF16 CPU (a one-off timing of the matmul alone, [128, 16] @ [16, 1536]: 34
    against 97 us). ``add_`` then sums in float32 and rounds each element of a half-precision y
    once. The short segments' rows are widened to float32, computed as a decode step's are, and
    written back rounded once.
    """
    n_dim = lora_b.shape[2]
    ranks_host = ranks.tolist()
    scales_host = scalings.tolist()
    min_len = blas_min_len(x.dtype)
    short_rows: list[int] = []
    short_slots: list[int] = []
    for g, slot in enumerate(seg_slots):
        if slot < 0 or not ranks_host[slot]:
            continue
        lo, hi, r = seg_starts[g], seg_starts[g + 1], ranks_host[slot]
        if hi - lo < min_len:
            short_rows.extend(range(lo, hi))
            short_slots.extend([slot] * (hi - lo))
            continue
        update = (x[lo:hi] @ lora_a[slot, :r].to(x.dtype).T) @ lora_b[slot, :r].to(x.dtype)
        y[lo:hi, y_offset : y_offset + n_dim].add_(update, alpha=scales_host[slot])
    if short_rows:  # gathered (a contiguous float32 copy), added to by the row path, scattered back
        rows, cols = torch.tensor(short_rows), slice(y_offset, y_offset + n_dim)
        acc = y[rows, cols].to(torch.float32)
        add_lora(acc, x[rows], lora_a, lora_b, ranks, scalings, torch.tensor(short_slots, dtype=torch.int32), 0)
        y[rows, cols] = acc.to(y.dtype)


# Below this many rows (a decode batch) the kernels run single-threaded: a parallel region costs
# tens of microseconds to open, more than a decode batch's work, and its worker threads compete
# with torch's OpenMP threads for the same cores between the base matmuls.
PARALLEL_MIN_ROWS = 64


def serial(kernel: Any) -> Any:
    """``kernel``'s loop compiled single-threaded, cached on disk under its own name.

    numba's cache files a function under its module, qualified name and first line, and within
    them by signature, not by ``parallel``: a plain ``njit(cache=True)(kernel.py_func)`` shares the
    parallel kernel's cache entry, and loaded whichever of the two had compiled first, so decode
    batches could run the parallel loop (and its thread pool) this module keeps them out of.
    """
    fn = kernel.py_func
    copy = types.FunctionType(fn.__code__, fn.__globals__, f"{fn.__name__}_serial", fn.__defaults__, fn.__closure__)
    copy.__qualname__ = f"{fn.__qualname__}_serial"
    return njit(fastmath=True, cache=True, nogil=True)(copy)


_shrink_rows_serial = serial(_shrink_rows)
_expand_rows_serial = serial(_expand_rows)
_add_lora_rows_paged_serial = serial(_add_lora_rows_paged)
_add_lora_slices_rows_serial = serial(_add_lora_slices_rows)


def _as_numpy(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """A numpy view of ``t`` in ``dtype``, converting only when it is not one already.

    A decode step makes some 200 kernel calls of a few microseconds each, so the generic
    ``to`` + ``ascontiguousarray`` round (about 2 us a tensor, six tensors a call) cost more
    than the products of a small adapter; the slot tables and the engine's index tensors are
    already contiguous in the kernels' dtypes and are viewed as they are.
    """
    if t.dtype != dtype or not t.is_contiguous():
        t = t.to(dtype).contiguous()
    return t.detach().numpy()


def _f32(t: torch.Tensor) -> np.ndarray:
    return _as_numpy(t, torch.float32)


def _i32(t: torch.Tensor) -> np.ndarray:
    return _as_numpy(t, torch.int32)


def _add_into(y: torch.Tensor, kernel: Callable[..., None], args: tuple[np.ndarray, ...], y_offset: int, n_dim: int) -> None:
    """Run an accumulating kernel on ``y[:, y_offset : y_offset + n_dim]``: in place when ``y`` is
    contiguous float32, else through a float32 copy of those columns alone, written back once.

    The copy is what lets a bfloat16 model add its adapters straight into its projection output:
    each element is widened, receives its adapter sum in float32 and is rounded once, and only
    the columns this slice owns are copied (a fused projection's other slices are not touched).
    """
    if y.dtype == torch.float32 and y.is_contiguous():
        kernel(*args, y.numpy(), y_offset)
        return
    cols = y[:, y_offset : y_offset + n_dim]
    acc = cols.detach().to(torch.float32).contiguous()
    kernel(*args, acc.numpy(), 0)
    cols.copy_(acc)


def shrink(x: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, row_slots: torch.Tensor, out: torch.Tensor) -> None:
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("the shrink buffer must be a contiguous float32 tensor")
    kernel = _shrink_rows if x.shape[0] >= PARALLEL_MIN_ROWS else _shrink_rows_serial
    kernel(_f32(x), _f32(lora_a), _i32(row_slots), _i32(ranks), out.numpy())


def expand(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    row_slots: torch.Tensor,
    y_offset: int,
) -> None:
    kernel = _expand_rows if y.shape[0] >= PARALLEL_MIN_ROWS else _expand_rows_serial
    _add_into(y, kernel, (_f32(buf), _f32(lora_b), _i32(row_slots), _i32(ranks), _f32(scalings)), y_offset, lora_b.shape[2])


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    row_slots: torch.Tensor,
    y_offset: int,
) -> None:
    xs, rows = _f32(x), _i32(row_slots)
    table = ((_f32(lora_a),), (_f32(lora_b),), (_i32(ranks),), (_f32(scalings),))
    kernel = _add_lora_slices_rows if y.shape[0] >= PARALLEL_MIN_ROWS else _add_lora_slices_rows_serial

    def one_slice(y_np: np.ndarray, offset: int) -> None:
        kernel(xs, *table, np.array([offset], dtype=np.int64), rows, y_np)

    _add_into(y, one_slice, (), y_offset, lora_b.shape[2])


def add_lora_paged(
    y: torch.Tensor,
    x: torch.Tensor,
    pool: torch.Tensor,
    a_offsets: torch.Tensor,
    b_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    row_slots: torch.Tensor,
    y_offset: int,
    n_dim: int,
) -> None:
    kernel: Any = _add_lora_rows_paged if y.shape[0] >= PARALLEL_MIN_ROWS else _add_lora_rows_paged_serial
    args = (_f32(x), pool.numpy(), a_offsets.numpy(), b_offsets.numpy(), _i32(row_slots), _i32(ranks), _f32(scalings))
    _add_into(y, lambda *a: kernel(*a, n_dim), args, y_offset, n_dim)  # _add_into appends (y, y_offset); n_dim goes last


class RowSlices:
    """A projection's slices prepared once for the CPU's one-call row kernel: each slice's output
    offset and its slot table's numpy views (``LoraSlots.host``), their shapes checked against
    each other here (numba checks no bounds), so a call checks only x, y and the rows.

    Why a separate entry: a decode step adds its adapters in some 200 slices, and the per-slice
    route (six tensors viewed as numpy, two layers of checks, one dispatch each) cost about 50 us
    a slice around 25 us of products on the embedded base at batch 16 (a one-off timing)."""

    __slots__ = ("a", "b", "end", "in_features", "offsets", "ranks", "scalings")

    def __init__(self, views: Sequence[tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]]) -> None:
        if not views:
            raise ValueError("RowSlices: no slices")
        self.in_features = int(views[0][1][0].shape[2])
        slots = views[0][1][0].shape[0]  # one row's slot indexes every slice's table
        for offset, (a, b, ranks, scalings) in views:
            if a.shape[2] != self.in_features or a.shape[0] != slots or a.shape[:2] != b.shape[:2] or offset < 0:
                raise ValueError(f"RowSlices: A {list(a.shape)} and B {list(b.shape)} at {offset} do not agree")
            if ranks.shape != (slots,) or scalings.shape != (slots,):
                raise ValueError(f"RowSlices: {slots} slots but {list(ranks.shape)} ranks, {list(scalings.shape)} scalings")
        self.a = tuple(h[0] for _, h in views)
        self.b = tuple(h[1] for _, h in views)
        self.ranks = tuple(h[2] for _, h in views)
        self.scalings = tuple(h[3] for _, h in views)
        self.offsets = np.array([offset for offset, _ in views], dtype=np.int64)
        self.end = max(offset + h[1].shape[2] for offset, h in views)


def add_lora_slices(y: torch.Tensor, x: torch.Tensor, slices: RowSlices, row_slots: np.ndarray) -> None:
    """``add_lora`` by rows for every slice of one projection in one kernel call; ``row_slots``
    each row's slot (int32). y must be contiguous float32 (the caller widens a low-precision
    output once for all slices). The slot indices are the engine's to keep in range, as for
    every row kernel."""
    rows = x.shape[0]
    if y.dtype != torch.float32 or not y.is_contiguous() or y.dim() != 2 or y.shape[0] != rows or y.shape[1] < slices.end:
        raise ValueError(
            f"add_lora_slices: y must be contiguous float32 [{rows}, >= {slices.end}], got {y.dtype} {list(y.shape)}"
        )
    if x.dim() != 2 or x.shape[1] != slices.in_features:
        raise ValueError(f"add_lora_slices: x {list(x.shape)} against slots of {slices.in_features} input features")
    if row_slots.shape != (rows,):
        raise ValueError(f"add_lora_slices: {rows} rows but {list(row_slots.shape)} row slots")
    kernel = _add_lora_slices_rows if rows >= PARALLEL_MIN_ROWS else _add_lora_slices_rows_serial
    kernel(_f32(x), slices.a, slices.b, slices.ranks, slices.scalings, slices.offsets, row_slots, y.numpy())
