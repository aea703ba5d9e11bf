"""Steps replayed as CUDA graphs: one launch sequence per bucket, recorded once. Decode steps
(:class:`DecodeGraphs`, a bucket per batch size) and steps with prompts (:class:`PromptGraphs`, a
bucket per token count).

A decode step of a small model is hundreds of kernel launches of a few microseconds each; the
host's launch overhead, not the GPU, sets its length. A CUDA graph records a step's launches
once and replays them with one call. What a graph bakes in is fixed here on purpose:

- **shapes**: the batch is padded up to the next bucket (1, 2, 4, then multiples of 8 up to
  ``max_num_seqs``, vLLM's sizes), and every per-step input lives in one static int32 buffer
  (:class:`StaticInputs`) that each step refills with a single host-to-device copy;
- **LoRA**: decode rows use BGMV with a per-row slot vector, every target module active. Which
  adapters a step uses, and how many distinct ones, are data in that vector, never part of the
  graph; a slice whose adapter does not target it reads rank 0 and its programs exit at once;
- **pad rows**: slot -1 (no adapter), one query at position 0 reading and writing a scratch KV
  block the block manager never hands out, so padding cannot touch a sequence's cache.

Steps where every scheduled sequence decodes one token and samples replay a decode graph; other
steps (prefill, chunked prefill, mixed) replay a prompt graph, whose differences are below.
``enforce_eager`` (vLLM's flag) turns both off. A prompt graph differs from a decode graph in:

- **buckets**: token counts (16 to 256 doubling, then every multiple of 256 up to
  ``max_num_batched_tokens``), so padding costs a bucket's step at most 256 tokens of GPU work
  beyond its own at the sizes where that work dominates;
- **grids from work lists**: the SGMV segments and the attention's sequences are data, not grid
  dimensions: both kernels take a work list (``kernels.tiles``) sized by the bucket's tokens and
  ``max_num_seqs``, so one graph serves any mix of prompts, chunks and decode rows;
- **pad tokens** are in no segment and no attention tile (their rows are never read by a real
  row: every other op is row-wise); they write their keys to the scratch block;
- the bucket's final hidden states are copied into one buffer shared by every bucket, so graphs
  do not each keep an output of their own alive in the pool.

vLLM V1 captures piecewise graphs around attention up to 512 tokens and runs larger steps
compiled but eagerly; here the attention is inside the graph (its grid is fixed by the work
list), so one replay serves every step up to the largest bucket. Where no CUDA device exists (the
CPU tests, or fake CUDA tensors) a "graph" is the recorded function run again on the same static
buffers, so everything here but the capture itself is exercised by the CPU tests against PEFT.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from loraplane.adapter_format import LLAMA_TARGETS
from loraplane.kernels.lora_batch import LoraBatch, LoraPlan, segment_tile_capacity, segment_tiles
from loraplane.kernels.paged_attention import launch_config
from loraplane.kernels.tiles import tile_capacity, tiles
from loraplane.serving import cuda_runtime
from loraplane.serving.host_side import host_side
from loraplane.serving.model.attention import KVCache
from loraplane.serving.model.context import PagedBatch, StepContext
from loraplane.serving.model.llama import LlamaModel


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's capture sizes: 1, 2, 4, then every multiple of 8 up to ``max_num_seqs`` (and it)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    return sorted(set(sizes) | {max_num_seqs})


def token_buckets(max_tokens: int) -> list[int]:
    """A prompt graph's token counts: 16 to 256 doubling, then every multiple of 256 up to
    ``max_tokens`` (and it)."""
    sizes = [s for s in (16, 32, 64, 128, 256) if s < max_tokens] + list(range(256, max_tokens + 1, 256))
    return sorted(set(sizes) | {max_tokens})


class StepGraphs:
    """Graphs of one kind, a bucket each: recorded once, replayed by one call. A subclass says
    what a bucket's forward is (:meth:`_forward`, on its static buffers) and which buckets exist."""

    def __init__(self, model: LlamaModel, cache: KVCache, backend: str, sizes: list[int], pool: Any = None) -> None:
        self.model, self.cache, self.backend, self.sizes = model, cache, backend, sizes
        self.device = model.embed_tokens.weight.device
        self.real = cuda_runtime.available(self.device)
        # One memory pool for every graph of the engine (a subclass's is handed the first's).
        self.pool = pool if pool is not None or not self.real else torch.cuda.graph_pool_handle()
        self.graphs: dict[int, Callable[[], None]] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def bucket(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def _forward(self, size: int) -> torch.Tensor:
        raise NotImplementedError

    def _stage(self, staging: torch.Tensor, views: Callable[[torch.Tensor], dict[str, np.ndarray]]) -> None:
        """Two page-locked host copies of the static buffer (``staging``, holding its first
        values, and a twin), filled by turns. A step's copy to the device is queued behind the
        device's work, so the host copy it reads may be refilled only once the copy has run: a
        step that samples waits for its tokens anyway, one that samples nothing (a long prompt's
        middle chunks) does not, and the next fill would race with its queued copy. With two, a
        fill waits (``_host``) only for the send of two steps ago, which has almost always run."""
        twin = staging.clone()
        self.stagings = [staging, twin.pin_memory() if self.real else twin]
        self.hosts = [views(buffer) for buffer in self.stagings]
        self.sends: list[Any] = [None, None]  # the event after each host copy's last send
        self.turn = 0

    def _host(self) -> dict[str, np.ndarray]:
        """This step's host copy, once its previous send has left it."""
        sent = self.sends[self.turn]
        if sent is not None:
            sent.synchronize()
        return self.hosts[self.turn]

    def _send(self, device_buffer: torch.Tensor, end: int | None = None) -> None:
        """This step's host copy (its first ``end`` entries, or all) to the static buffer, in one
        asynchronous copy; the next step fills the other host copy."""
        staging = self.stagings[self.turn]
        if end is None:
            device_buffer.copy_(staging, non_blocking=True)
        else:
            device_buffer[:end].copy_(staging[:end], non_blocking=True)
        if self.real:
            sent = torch.cuda.Event()  # type: ignore[no-untyped-call]
            sent.record()
            self.sends[self.turn] = sent
        self.turn ^= 1

    def capture(self, size: int) -> None:
        """Record the bucket's graph (after one eager run, which compiles the Triton kernels and
        settles the allocator), or keep the function for replay where there is no CUDA."""
        if not self.real:

            def run() -> None:
                self.outputs[size] = self._forward(size)

            self.graphs[size] = run
            return
        self.outputs[size] = self._forward(size)  # warm-up: Triton compiles, nothing may compile while recording
        torch.cuda.synchronize(self.device)
        # The warm-up's activations go back to the device, so the graph's pool can take them
        # rather than hold as much again beside the caching allocator's blocks.
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[size] = self._forward(size)
        self.graphs[size] = graph.replay

    def capture_all(self) -> None:
        """Every bucket at start, largest first so smaller graphs reuse its memory pool: no step
        pays for a capture while serving."""
        with torch.inference_mode():
            for size in reversed(self.sizes):
                self.capture(size)

    def replay(self, size: int) -> torch.Tensor:
        if size not in self.graphs:
            self.capture(size)
        self.graphs[size]()
        return self.outputs[size]


@dataclass
class StaticInputs:
    """Views of one int32 buffer, ``max_rows`` rows each (``tables`` has ``width`` columns)."""

    buffer: torch.Tensor
    ids: torch.Tensor
    positions: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor
    row_slots: torch.Tensor
    seq_lens: torch.Tensor
    tables: torch.Tensor
    query_starts: torch.Tensor

    @classmethod
    def views(cls, buffer: torch.Tensor, max_rows: int, width: int) -> StaticInputs:
        sizes = [max_rows] * 6 + [max_rows * width, max_rows + 1]
        parts, start = [], 0
        for n in sizes:
            parts.append(buffer[start : start + n])
            start += n
        parts[6] = parts[6].view(max_rows, width)
        return cls(buffer, *parts)

    @staticmethod
    def size(max_rows: int, width: int) -> int:
        return max_rows * (7 + width) + 1


class DecodeGraphs(StepGraphs):
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        scratch_block: int,
        max_num_seqs: int,
        max_blocks: int,
        backend: str,
        pool: Any = None,
    ) -> None:
        super().__init__(model, cache, backend, bucket_sizes(max_num_seqs), pool)
        self.scratch_block, self.width = scratch_block, max_blocks
        rows = self.sizes[-1]
        # The host side of the static buffer: filled in place each step (only the bucket's rows,
        # only each row's own blocks) and sent whole in one copy; real, and page-locked on a GPU,
        # even while fake tensors are traced (two of them, by turns: ``_stage``). Until a step
        # fills them, rows point at the scratch block (the warm-up before capture runs them);
        # each decode row is one query, so the query starts never change.
        with host_side():
            staging = torch.zeros(StaticInputs.size(rows, max_blocks), dtype=torch.int32)
            staging = staging.pin_memory() if self.real else staging
            host = StaticInputs.views(staging, rows, max_blocks)
            host.query_starts.copy_(torch.arange(rows + 1, dtype=torch.int32))
            for field, value in (
                (host.blocks, scratch_block),
                (host.tables, scratch_block),
                (host.seq_lens, 1),
                (host.row_slots, -1),
            ):
                field.fill_(value)

            def views(buffer: torch.Tensor) -> dict[str, np.ndarray]:
                host = StaticInputs.views(buffer, rows, max_blocks)
                names = ("ids", "positions", "blocks", "offsets", "row_slots", "seq_lens", "tables")
                return {name: getattr(host, name).numpy() for name in names}

            self._stage(staging, views)
        self.static = StaticInputs.views(torch.empty_like(staging, device=self.device), rows, max_blocks)
        self.static.buffer.copy_(staging)

    def _forward(self, size: int) -> torch.Tensor:
        """The decode step of ``size`` padded rows on the static buffers: hidden states [size,
        hidden]. Logits stay outside the graph, for the real rows only: a float32 [size, vocab]
        output kept per bucket would hold gigabytes for a 128k vocabulary."""
        s = self.static
        lora = LoraBatch(
            row_slots=s.row_slots[:size], seg_starts=None, seg_slots=None, active_modules=frozenset(LLAMA_TARGETS),
            max_seg_len=1, backend=self.backend,
        )  # fmt: skip
        paged = PagedBatch(
            block_tables=s.tables[:size], query_starts=s.query_starts[: size + 1], seq_lens=s.seq_lens[:size], max_query_len=1
        )
        ctx = StepContext(
            positions=s.positions[:size], slot_blocks=s.blocks[:size], slot_offsets=s.offsets[:size], lora=lora, paged=paged,
            fused=True,
        )  # fmt: skip
        hidden: torch.Tensor = self.model(s.ids[:size], ctx, self.cache)
        return hidden

    def fill(self, rows: list[tuple[int, int, int, int, int, list[int]]], size: int) -> None:
        """Write these decode rows, padded to ``size``, into the host buffer: (token id, position,
        KV slot, adapter slot, context length, block table) per row. Rows past ``size`` and table
        columns past a row's context are never read (the kernel stops at each row's length)."""
        h, n, bs = self._host(), len(rows), self.cache.block_size
        for name, column in (("ids", 0), ("positions", 1), ("row_slots", 3), ("seq_lens", 4)):
            h[name][:n] = [r[column] for r in rows]
        h["blocks"][:n] = [r[2] // bs for r in rows]
        h["offsets"][:n] = [r[2] % bs for r in rows]
        for i, r in enumerate(rows):
            h["tables"][i, : len(r[5])] = r[5]
        # Pad rows: no adapter, one token at position 0 of the scratch block.
        for name, value in (
            ("ids", 0),
            ("positions", 0),
            ("row_slots", -1),
            ("seq_lens", 1),
            ("blocks", self.scratch_block),
            ("offsets", 0),
        ):
            h[name][n:size] = value
        h["tables"][n:size, 0] = self.scratch_block

    def run(
        self, rows: list[tuple[int, int, int, int, int, list[int]]], patch: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor:
        """Logits [len(rows), vocab] of one decode step, replayed from its bucket's graph;
        ``patch`` rewrites the input ids on the device first (tokens still in flight)."""
        size = self.bucket(len(rows))
        assert size is not None, "the runner checks the bucket first"
        with host_side():
            self.fill(rows, size)
        self._send(self.static.buffer)
        if patch is not None:
            patch(self.static.ids)
        return self.model.logits(self.replay(size)[: len(rows)])


class PromptGraphs(StepGraphs):
    """Steps with prompts (any step that is not decode-only) on graphs of ``token_buckets``.

    The static int32 buffer holds, for the largest bucket ``T`` and ``S = max_num_seqs``: per
    token the id, position, KV block and offset, adapter slot; per segment its start and slot;
    both SGMV work lists and the attention's; per sequence its block table row, query start,
    context length and the row its logits come from. A bucket reads the first entries of each."""

    # The block tables last: a step sends the buffer up to its own sequences' rows only.
    FIELDS = ("ids", "positions", "blocks", "offsets", "row_slots", "seg_starts", "seg_slots", "seg_tiles",
              "attn_tiles", "query_starts", "seq_lens", "logit_rows", "tables")  # fmt: skip

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        scratch_block: int,
        max_num_seqs: int,
        max_tokens: int,
        max_blocks: int,
        backend: str,
        pool: Any = None,
    ) -> None:
        super().__init__(model, cache, backend, token_buckets(max_tokens), pool)
        self.scratch_block, self.max_seqs = scratch_block, max_num_seqs
        top, seqs = self.sizes[-1], max_num_seqs
        cfg = model.config
        self.block_q = {
            size: int(
                launch_config(
                    num_seqs=seqs, num_heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                    head_dim=cfg.head_dim, block_size=cache.block_size, dtype=cache.k[0].dtype, max_query_len=size,
                ).constexprs["BLOCK_Q"]
            )
            for size in self.sizes
        }  # fmt: skip
        self.seg_cap = {size: segment_tile_capacity(size, seqs) for size in self.sizes}
        self.attn_cap = {size: tile_capacity(size, seqs, self.block_q[size]) for size in self.sizes}
        shapes: dict[str, tuple[int, ...]] = {
            "ids": (top,), "positions": (top,), "blocks": (top,), "offsets": (top,), "row_slots": (top,),
            "seg_starts": (seqs + 1,), "seg_slots": (seqs,), "seg_tiles": (2, self.seg_cap[top], 2),
            "attn_tiles": (max(self.attn_cap.values()), 2), "tables": (seqs, max_blocks), "query_starts": (seqs + 1,),
            "seq_lens": (seqs,), "logit_rows": (seqs,),
        }  # fmt: skip
        # Host side as the decode graphs' (page-locked, real under a trace); until a step fills it,
        # every work list is empty and every token a pad token, which the warm-up runs.
        size = sum(int(np.prod(shape)) for shape in shapes.values())
        self.tables_at, self.width = size - seqs * max_blocks, max_blocks

        def views(buffer: torch.Tensor) -> dict[str, np.ndarray]:
            return {name: view.numpy() for name, view in self._carve(buffer, shapes).items() if name != "_buffer"}

        with host_side():
            staging = torch.zeros(size, dtype=torch.int32)
            staging = staging.pin_memory() if self.real else staging
            first = views(staging)
            first["seg_tiles"][:, :, 0] = -1
            first["attn_tiles"][:, 0] = -1
            first["blocks"][:] = scratch_block
            first["row_slots"][:] = -1
            self._stage(staging, views)
        self.static = self._carve(torch.empty_like(staging, device=self.device), shapes)
        self.device_buffer = self.static.pop("_buffer")
        self.device_buffer.copy_(staging)
        # Every bucket's last hidden states land here (the graphs copy them in), so the pool does
        # not keep one output per bucket alive.
        self.out = torch.empty((top, cfg.hidden_size), dtype=model.embed_tokens.weight.dtype, device=self.device)

    @classmethod
    def _carve(cls, buffer: torch.Tensor, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        views, start = {"_buffer": buffer}, 0
        for name in cls.FIELDS:
            n = int(np.prod(shapes[name]))
            views[name] = buffer[start : start + n].view(shapes[name])
            start += n
        return views

    def _forward(self, size: int) -> torch.Tensor:
        """The bucket's step on the static buffers, its hidden states copied into ``out[:size]``."""
        s = self.static
        lora = LoraBatch(
            row_slots=s["row_slots"][:size], seg_starts=s["seg_starts"], seg_slots=s["seg_slots"],
            active_modules=frozenset(LLAMA_TARGETS), max_seg_len=size, backend=self.backend,
            seg_tiles=s["seg_tiles"][:, : self.seg_cap[size]],
        )  # fmt: skip
        paged = PagedBatch(
            block_tables=s["tables"], query_starts=s["query_starts"], seq_lens=s["seq_lens"], max_query_len=size,
            tiles=s["attn_tiles"][: self.attn_cap[size]],
        )  # fmt: skip
        ctx = StepContext(
            positions=s["positions"][:size], slot_blocks=s["blocks"][:size], slot_offsets=s["offsets"][:size], lora=lora,
            paged=paged, fused=True,
        )  # fmt: skip
        hidden = self.model(s["ids"][:size], ctx, self.cache)
        out = self.out[:size]
        out.copy_(hidden)
        return out

    def fits(self, tokens: int, seqs: int) -> int | None:
        """The bucket of a step of ``tokens`` over ``seqs`` sequences, or None (it runs eagerly)."""
        return self.bucket(tokens) if seqs <= self.max_seqs else None

    def run(
        self,
        size: int,
        token_arrays: Sequence[np.ndarray],
        plan: LoraPlan | None,
        query_starts: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        logit_rows: list[int],
        patch: Callable[[torch.Tensor], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states of the step's rows [tokens, hidden], the sampled rows' [len(logit_rows),
        hidden]) from the bucket's graph. ``token_arrays``: ids, positions, KV blocks, offsets, slots
        per token (the runner's); the rest per sequence, as the eager step takes them. ``patch``
        rewrites the input ids on the device first (tokens still in flight)."""
        n = query_starts[-1]
        with host_side():
            self.fill(size, token_arrays, plan, query_starts, seq_lens, tables, logit_rows)
        self._send(self.device_buffer, self.tables_at + len(seq_lens) * self.width)
        if patch is not None:
            patch(self.static["ids"])
        hidden = self.replay(size)
        return hidden[:n], hidden[self.static["logit_rows"][: len(logit_rows)]]

    def fill(
        self,
        size: int,
        token_arrays: Sequence[np.ndarray],
        plan: LoraPlan | None,
        query_starts: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        logit_rows: list[int],
    ) -> None:
        """Write the step into the host buffer, padded to the bucket: pad tokens at position 0 of
        the scratch block with no adapter, in no segment or attention tile."""
        h, n, b = self._host(), query_starts[-1], len(seq_lens)
        for name, values, pad in zip(
            ("ids", "positions", "blocks", "offsets", "row_slots"), token_arrays, (0, 0, self.scratch_block, 0, -1),
            strict=True,
        ):  # fmt: skip
            h[name][:n] = values
            h[name][n:size] = pad
        starts, slots = (plan.seg_starts, plan.seg_slots) if plan is not None else ([0], [])
        h["seg_starts"][: len(starts)] = starts
        h["seg_slots"][: len(slots)] = slots
        h["seg_tiles"][:, : self.seg_cap[size]] = segment_tiles(starts, self.seg_cap[size])
        h["attn_tiles"][: self.attn_cap[size]] = tiles(query_starts, self.block_q[size], self.attn_cap[size])
        for i, table in enumerate(tables):
            h["tables"][i, : len(table)] = table
        h["query_starts"][: b + 1] = query_starts
        h["seq_lens"][:b] = seq_lens
        h["logit_rows"][: len(logit_rows)] = logit_rows
