"""The engine's kernels as torch custom ops, so the model traces under ``FakeTensorMode`` and
``torch.compile`` and a CUDA graph sees one opaque node per launch.

Semantics (each op is the function of the same name in :mod:`loraplane.kernels.dispatch`, or
:mod:`loraplane.kernels.paged_attention` for attention)::

    add_lora(y, x, A, B, ranks, scalings, row_slots, seg_starts, seg_slots, seg_tiles, y_offset, max_seg_len, backend)
        y[i, off:off+N] += scalings[s] * (x[i] @ A[s, :r].T) @ B[s, :r]     s = the row's slot
    add_lora_stacked(y, x, A, B, ranks, scalings, row_slots, seg_starts, seg_slots, seg_tiles, offsets, sizes, max_seg_len,
                     backend)
        the same for every slice of a fused projection (layout.StackedLoraSlots), one launch each way
    add_lora_paged(y, x, pool, a_offsets, b_offsets, ranks, scalings, row_slots, y_offset, out_features, backend)
        the same with each adapter row read at its offset in the page pool
    paged_attention(out, q, k_cache, v_cache, block_tables, query_starts, seq_lens, scale, max_query_len, tiles)
        out = causal attention of each sequence's new queries over its paged context
    rms_norm(x, weight, eps, out, residual)       out = norm(x), after residual <- x + residual when given
    rotary(q, k, positions, cos, sin)             q, k rotated in place by each row's position
    silu_and_mul(gate_up, out)                    out = silu(gate) * up
    kv_write(k, v, k_cache, v_cache, slot_blocks, slot_offsets)   the step's keys and values into their slots
    seeded_noise(noise, rows, seed_lo, seed_hi, position, backend)   the seeded rows' sampling noise
        (kernels.seeded_noise: Exp(1) per token from a hash of the row's seed, position and token id)
    top_k_top_p_threshold(logits, temperature, top_k, top_p, out, backend)   each row's top-k/top-p
        cut-off on its scaled logits (kernels.top_k_top_p: the tokens at or above it are kept)
    race(logits, temperature, cut, min_p, noise, token, backend)   each row's token: greedy, or the
        exponential race over what the cut-off and min-p keep (kernels.race)

Why custom ops rather than plain Python calls: a Triton launch on a fake tensor has no data to
read, so a traced model would fail at the first kernel; the fake implementations below say
only what each op does to shapes and devices. They also check that every tensor sits on the
output's device, which is the mistake a fake CUDA trace is meant to catch and which a custom
op would otherwise hide (a real kernel handed a host pointer faults on the GPU instead).

Every op mutates its output in place and returns nothing, as the launchers do. ``backend`` is
``"auto"`` (Triton on CUDA tensors, the CPU path otherwise), ``"triton"`` or ``"cpu"``.
Segments are passed with their longest length, known on the host, so no launch reads a
device tensor back (see ``dispatch.add_lora``'s ``max_seg_len``), or with work lists
(``seg_tiles``, attention's ``tiles``: ``kernels.tiles``) whose grid depends on the step's tokens
only, which a CUDA graph for steps with prompts replays whatever the step's segments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from loraplane.kernels import dispatch
from loraplane.kernels.layout import LoraSlots, SlotLayoutError, StackedLoraSlots
from loraplane.kernels.paged_layout import PagedLoraSlots

# Defined with torch.library's lower-level Library rather than torch.library.custom_op: a custom_op
# call runs Python wrappers (autograd, in-place version bumps, argument defaults) that cost 15-23 us
# a call here against under 3 us for an op the dispatcher takes straight to its kernel, some 300
# calls in a step with prompts on the Triton backend (what the host-overhead benchmark counts).
_LIB = torch.library.Library("loraplane", "DEF")  # type: ignore[no-untyped-call]


def _op(*mutates: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Define ``loraplane::<name>`` from the function's annotations (``mutates`` written in place)
    and make the function its kernel on every backend; callers go through ``torch.ops.loraplane``."""

    def define(fn: Callable[..., None]) -> Callable[..., None]:
        _LIB.define(fn.__name__ + torch.library.infer_schema(fn, mutates_args=mutates))  # type: ignore[no-untyped-call]
        _LIB.impl(fn.__name__, fn, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
        return fn

    return define


def _fake(name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The op's implementation on fake and meta tensors: shapes and devices checked, nothing run."""
    register: Callable[[Callable[..., None]], Callable[..., None]] = torch.library.register_fake(f"loraplane::{name}")
    return register


# Kernel launches each op makes on the Triton backend: what the host-overhead benchmark counts
# for one call (add_lora: a shrink and an expand, whatever the slices of add_lora_stacked; a
# shrink that splits its reduction over K, as BGMV's does at small batches, clears its buffer
# first, one memset more; the paged variant fuses both).
LAUNCHES = {
    "loraplane::add_lora": 2, "loraplane::add_lora_stacked": 2, "loraplane::add_lora_paged": 1, "loraplane::paged_attention": 1,
    "loraplane::rms_norm": 1,
    "loraplane::rotary": 1, "loraplane::silu_and_mul": 1, "loraplane::kv_write": 1, "loraplane::seeded_noise": 1,
    "loraplane::top_k_top_p_threshold": 1, "loraplane::race": 1,
}  # fmt: skip


def _same_device(out: torch.Tensor, *tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None and t.device != out.device:
            raise SlotLayoutError(f"a {list(t.shape)} tensor is on {t.device}, the output on {out.device}")


@_op("y")
def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    row_slots: torch.Tensor,
    seg_starts: torch.Tensor | None,
    seg_slots: torch.Tensor | None,
    seg_tiles: torch.Tensor | None,
    y_offset: int,
    max_seg_len: int,
    backend: str,
) -> None:
    _same_device(y, x, lora_a, lora_b, ranks, scalings, row_slots, seg_starts, seg_slots, seg_tiles)
    slots = LoraSlots(lora_a, lora_b, ranks, scalings)
    mode = cast(dispatch.Backend, backend)
    if seg_starts is not None:
        dispatch.add_lora(
            y, x, slots, seg_starts=seg_starts, seg_slots=seg_slots, y_offset=y_offset, backend=mode, check=False,
            max_seg_len=max_seg_len, seg_tiles=seg_tiles,
        )  # fmt: skip
    else:
        dispatch.add_lora(y, x, slots, row_slots=row_slots, y_offset=y_offset, backend=mode, check=False)


@_fake("add_lora")
def _(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    row_slots: torch.Tensor,
    seg_starts: torch.Tensor | None,
    seg_slots: torch.Tensor | None,
    seg_tiles: torch.Tensor | None,
    y_offset: int,
    max_seg_len: int,
    backend: str,
) -> None:
    _same_device(y, x, lora_a, lora_b, ranks, scalings, row_slots, seg_starts, seg_slots, seg_tiles)
    if x.shape[1] != lora_a.shape[2] or y.shape[1] < y_offset + lora_b.shape[2] or x.shape[0] != y.shape[0]:
        raise SlotLayoutError(f"x {list(x.shape)}, y {list(y.shape)} do not fit A {list(lora_a.shape)}, B {list(lora_b.shape)}")


@_op("y")
def add_lora_stacked(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    row_slots: torch.Tensor,
    seg_starts: torch.Tensor | None,
    seg_slots: torch.Tensor | None,
    seg_tiles: torch.Tensor | None,
    offsets: list[int],
    sizes: list[int],
    max_seg_len: int,
    backend: str,
) -> None:
    _same_device(y, x, lora_a, lora_b, ranks, scalings, row_slots, seg_starts, seg_slots, seg_tiles)
    stacked = StackedLoraSlots(lora_a, lora_b, ranks, scalings, tuple(offsets), tuple(sizes))
    rows = (
        {"seg_starts": seg_starts, "seg_slots": seg_slots, "seg_tiles": seg_tiles}
        if seg_starts is not None
        else {"row_slots": row_slots}
    )
    dispatch.add_lora_stacked(y, x, stacked, max_seg_len=max_seg_len, backend=cast(dispatch.Backend, backend), **rows)


@_fake("add_lora_stacked")
def _(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    row_slots: torch.Tensor,
    seg_starts: torch.Tensor | None,
    seg_slots: torch.Tensor | None,
    seg_tiles: torch.Tensor | None,
    offsets: list[int],
    sizes: list[int],
    max_seg_len: int,
    backend: str,
) -> None:
    _same_device(y, x, lora_a, lora_b, ranks, scalings, row_slots, seg_starts, seg_slots, seg_tiles)
    if x.shape[1] != lora_a.shape[3] or y.shape[1] != lora_b.shape[2] or sum(sizes) != y.shape[1] or x.shape[0] != y.shape[0]:
        raise SlotLayoutError(
            f"x {list(x.shape)}, y {list(y.shape)} do not fit stacked A {list(lora_a.shape)}, B {list(lora_b.shape)}"
        )


@_op("y")
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
    in_features: int,
    out_features: int,
    backend: str,
) -> None:
    _same_device(y, x, pool, a_offsets, b_offsets, ranks, scalings, row_slots)
    slots = PagedLoraSlots(pool, a_offsets, b_offsets, ranks, scalings, in_features, out_features)
    dispatch.add_lora(y, x, slots, row_slots=row_slots, y_offset=y_offset, backend=cast(dispatch.Backend, backend), check=False)


@_fake("add_lora_paged")
def _(
    y: torch.Tensor,
    x: torch.Tensor,
    pool: torch.Tensor,
    a_offsets: torch.Tensor,
    b_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    row_slots: torch.Tensor,
    y_offset: int,
    in_features: int,
    out_features: int,
    backend: str,
) -> None:
    _same_device(y, x, pool, a_offsets, b_offsets, ranks, scalings, row_slots)
    if x.shape[1] != in_features or y.shape[1] < y_offset + out_features or x.shape[0] != y.shape[0]:
        raise SlotLayoutError(f"x {list(x.shape)}, y {list(y.shape)} do not fit in={in_features}, out={out_features}")


@_op("out")
def paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    tiles: torch.Tensor | None,
) -> None:
    _same_device(out, q, k_cache, v_cache, block_tables, query_starts, seq_lens, tiles)
    from loraplane.kernels.paged_attention import paged_attention as launch

    launch(
        q, k_cache, v_cache, block_tables, query_starts, seq_lens, out, scale=scale, max_query_len=max_query_len, tiles=tiles
    )  # fmt: skip


@_fake("paged_attention")
def _(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    tiles: torch.Tensor | None,
) -> None:
    _same_device(out, q, k_cache, v_cache, block_tables, query_starts, seq_lens, tiles)
    if out.shape != q.shape or k_cache.shape != v_cache.shape or q.shape[2] != k_cache.shape[3]:
        raise SlotLayoutError(f"q {list(q.shape)}, out {list(out.shape)} and caches {list(k_cache.shape)} do not agree")
    if block_tables.shape[0] != seq_lens.shape[0] or query_starts.shape[0] != seq_lens.shape[0] + 1:
        raise SlotLayoutError("block_tables, query_starts and seq_lens must describe the same sequences")


# The layer's elementwise work on the Triton backend, each one kernel (the eager model's torch ops
# are a dozen launches a norm or a rotation): rms_norm.py, rotary.py, activation.py, kv_write.py.


@_op("out", "residual")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor, residual: torch.Tensor | None) -> None:
    _same_device(out, x, weight, residual)
    from loraplane.kernels.rms_norm import rms_norm as launch

    launch(x, weight, eps, out, residual)


@_fake("rms_norm")
def _(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor, residual: torch.Tensor | None) -> None:
    _same_device(out, x, weight, residual)
    if x.shape != out.shape or (residual is not None and residual.shape != x.shape) or weight.shape != x.shape[-1:]:
        raise SlotLayoutError(f"rms_norm: x {list(x.shape)}, out {list(out.shape)}, weight {list(weight.shape)} do not agree")


@_op("q", "k")
def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    _same_device(q, k, positions, cos, sin)
    from loraplane.kernels.rotary import rotary as launch

    launch(q, k, positions, cos, sin)


@_fake("rotary")
def _(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    _same_device(q, k, positions, cos, sin)
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or cos.shape[1] != q.shape[2] or positions.shape != q.shape[:1]:
        raise SlotLayoutError(f"rotary: q {list(q.shape)}, k {list(k.shape)}, cos {list(cos.shape)} do not agree")


@_op("out")
def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    _same_device(out, gate_up)
    from loraplane.kernels.activation import silu_and_mul as launch

    launch(gate_up, out)


@_fake("silu_and_mul")
def _(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    _same_device(out, gate_up)
    if gate_up.shape[0] != out.shape[0] or gate_up.shape[1] != 2 * out.shape[1]:
        raise SlotLayoutError(f"silu_and_mul: gate_up {list(gate_up.shape)} is not twice out {list(out.shape)}")


@_op("k_cache", "v_cache")
def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    _same_device(k_cache, k, v, v_cache, slot_blocks, slot_offsets)
    from loraplane.kernels.kv_write import kv_write as launch

    launch(k, v, k_cache, v_cache, slot_blocks, slot_offsets)


@_fake("kv_write")
def _(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    _same_device(k_cache, k, v, v_cache, slot_blocks, slot_offsets)
    if k.shape != v.shape or k_cache.stride() != v_cache.stride() or k_cache.shape[2:] != k.shape[1:]:
        raise SlotLayoutError(f"kv_write: k {list(k.shape)}, v {list(v.shape)}, caches {list(k_cache.shape)} do not agree")


@_op("noise")
def seeded_noise(
    noise: torch.Tensor,
    rows: torch.Tensor,
    seed_lo: torch.Tensor,
    seed_hi: torch.Tensor,
    position: torch.Tensor,
    backend: str,
) -> None:
    _same_device(noise, rows, seed_lo, seed_hi, position)
    if dispatch.resolve(cast(dispatch.Backend, backend), noise) == "triton":
        from loraplane.kernels.seeded_noise import seeded_noise as launch

        launch(noise, rows, seed_lo, seed_hi, position)
        return
    from loraplane.kernels.seeded_noise import seeded_noise_reference

    noise.index_copy_(0, rows.long(), seeded_noise_reference(seed_lo, seed_hi, position, noise.shape[1]))


@_fake("seeded_noise")
def _(
    noise: torch.Tensor,
    rows: torch.Tensor,
    seed_lo: torch.Tensor,
    seed_hi: torch.Tensor,
    position: torch.Tensor,
    backend: str,
) -> None:
    _same_device(noise, rows, seed_lo, seed_hi, position)
    if noise.dim() != 2 or not rows.shape == seed_lo.shape == seed_hi.shape == position.shape or rows.dim() != 1:
        raise SlotLayoutError(
            f"seeded_noise: noise {list(noise.shape)}, rows {list(rows.shape)}, seeds {list(seed_lo.shape)}, "
            f"{list(seed_hi.shape)}, positions {list(position.shape)} do not agree"
        )


@_op("out")
def top_k_top_p_threshold(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, out: torch.Tensor, backend: str
) -> None:
    _same_device(out, logits, temperature, top_k, top_p)
    if dispatch.resolve(cast(dispatch.Backend, backend), out) == "triton":
        from loraplane.kernels.top_k_top_p import threshold as launch

        launch(logits, temperature, top_k, top_p, out)
        return
    from loraplane.kernels.top_k_top_p import threshold_reference

    out.copy_(threshold_reference(logits, temperature, top_k, top_p))


@_fake("top_k_top_p_threshold")
def _(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, out: torch.Tensor, backend: str
) -> None:
    _same_device(out, logits, temperature, top_k, top_p)
    if logits.dim() != 2 or not out.shape == temperature.shape == top_k.shape == top_p.shape == logits.shape[:1]:
        raise SlotLayoutError(
            f"top_k_top_p_threshold: logits {list(logits.shape)}, temperature {list(temperature.shape)}, "
            f"top_k {list(top_k.shape)}, top_p {list(top_p.shape)}, out {list(out.shape)} do not agree"
        )


@_op("token")
def race(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    cut: torch.Tensor | None,
    min_p: torch.Tensor,
    noise: torch.Tensor | None,
    token: torch.Tensor,
    backend: str,
) -> None:
    _same_device(token, logits, temperature, cut, min_p, noise)
    if dispatch.resolve(cast(dispatch.Backend, backend), token) == "triton":
        from loraplane.kernels.race import race as launch

        launch(logits, temperature, cut, min_p, noise, token)
        return
    from loraplane.kernels.race import race_reference

    token.copy_(race_reference(logits, temperature, cut, min_p, noise))


@_fake("race")
def _(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    cut: torch.Tensor | None,
    min_p: torch.Tensor,
    noise: torch.Tensor | None,
    token: torch.Tensor,
    backend: str,
) -> None:
    _same_device(token, logits, temperature, cut, min_p, noise)
    rows = logits.shape[:1]
    if (
        logits.dim() != 2 or not token.shape == temperature.shape == min_p.shape == rows
        or (cut is not None and cut.shape != rows) or (noise is not None and noise.shape != logits.shape)
    ):  # fmt: skip
        raise SlotLayoutError(
            f"race: logits {list(logits.shape)}, token {list(token.shape)}, temperature {list(temperature.shape)}, "
            f"min_p {list(min_p.shape)}, cut {None if cut is None else list(cut.shape)}, "
            f"noise {None if noise is None else list(noise.shape)} do not agree"
        )
