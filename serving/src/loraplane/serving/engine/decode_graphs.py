"""Decode steps replayed as CUDA graphs: one launch sequence per batch-size bucket, recorded once.

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

Only steps where every scheduled sequence decodes one token and samples run through a graph;
prefill, chunked prefill and mixed steps run eagerly. ``enforce_eager`` (vLLM's flag) turns the
graphs off. Where no CUDA device exists (the CPU tests, or fake CUDA tensors) a "graph" is the
recorded function run again on the same static buffers, so everything here but the capture
itself is exercised by the CPU tests against PEFT.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraplane.adapter_format import LLAMA_TARGETS
from loraplane.kernels.lora_batch import LoraBatch
from loraplane.serving import cuda_runtime
from loraplane.serving.host_side import host_side
from loraplane.serving.model.attention import KVCache
from loraplane.serving.model.context import PagedBatch, StepContext
from loraplane.serving.model.llama import LlamaModel


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's capture sizes: 1, 2, 4, then every multiple of 8 up to ``max_num_seqs`` (and it)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    return sorted(set(sizes) | {max_num_seqs})


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


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        scratch_block: int,
        max_num_seqs: int,
        max_blocks: int,
        backend: str,
    ) -> None:
        self.model, self.cache, self.backend = model, cache, backend
        self.device = model.embed_tokens.weight.device
        self.scratch_block, self.width = scratch_block, max_blocks
        self.sizes = bucket_sizes(max_num_seqs)
        rows = self.sizes[-1]
        self.real = cuda_runtime.available(self.device)
        self.pool = torch.cuda.graph_pool_handle() if self.real else None
        # The host side of the static buffer: filled in place each step (only the bucket's rows,
        # only each row's own blocks) and sent whole in one copy; real, and page-locked on a GPU,
        # even while fake tensors are traced. Until a step fills them, rows point at the scratch
        # block (the warm-up before capture runs them); each decode row is one query, so the
        # query starts never change.
        with host_side():
            staging = torch.zeros(StaticInputs.size(rows, max_blocks), dtype=torch.int32)
            self.staging = staging.pin_memory() if self.real else staging
            host = StaticInputs.views(self.staging, rows, max_blocks)
            host.query_starts.copy_(torch.arange(rows + 1, dtype=torch.int32))
            for field, value in (
                (host.blocks, scratch_block),
                (host.tables, scratch_block),
                (host.seq_lens, 1),
                (host.row_slots, -1),
            ):
                field.fill_(value)
            self.host = {
                name: getattr(host, name).numpy()
                for name in ("ids", "positions", "blocks", "offsets", "row_slots", "seq_lens", "tables")
            }
        self.static = StaticInputs.views(torch.empty_like(self.staging, device=self.device), rows, max_blocks)
        self.static.buffer.copy_(self.staging)
        self.graphs: dict[int, Callable[[], None]] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def bucket(self, rows: int) -> int | None:
        return next((s for s in self.sizes if s >= rows), None)

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

    def fill(self, rows: list[tuple[int, int, int, int, int, list[int]]], size: int) -> None:
        """Write these decode rows, padded to ``size``, into the host buffer: (token id, position,
        KV slot, adapter slot, context length, block table) per row. Rows past ``size`` and table
        columns past a row's context are never read (the kernel stops at each row's length)."""
        h, n, bs = self.host, len(rows), self.cache.block_size
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

    def run(self, rows: list[tuple[int, int, int, int, int, list[int]]]) -> torch.Tensor:
        """Logits [len(rows), vocab] of one decode step, replayed from its bucket's graph. The
        host buffer is free to refill: the previous step's copy was waited for when its tokens
        came back."""
        size = self.bucket(len(rows))
        assert size is not None, "the runner checks the bucket first"
        with host_side():
            self.fill(rows, size)
        self.static.buffer.copy_(self.staging, non_blocking=True)
        if size not in self.graphs:
            self.capture(size)
        self.graphs[size]()
        return self.model.logits(self.outputs[size][: len(rows)])
