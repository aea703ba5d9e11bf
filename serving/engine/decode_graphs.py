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
from loraplane.serving.model.attention import KVCache
from loraplane.serving.model.context import LoraBatch, PagedBatch, StepContext
from loraplane.serving.model.llama import LlamaModel


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's capture sizes: 1, 2, 4, then every multiple of 8 up to ``max_num_seqs`` (and it)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    return sorted(set(sizes) | {max_num_seqs})


@dataclass
class StaticInputs:
    """Views of one int32 device buffer, ``max_rows`` rows each (``tables`` has ``width`` columns)."""

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
    def allocate(cls, max_rows: int, width: int, device: torch.device) -> StaticInputs:
        sizes = [max_rows] * 6 + [max_rows * width, max_rows + 1]
        buffer = torch.zeros(sum(sizes), dtype=torch.int32, device=device)
        views, start = [], 0
        for n in sizes:
            views.append(buffer[start : start + n])
            start += n
        views[6] = views[6].view(max_rows, width)
        return cls(buffer, *views)


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
        self.static = StaticInputs.allocate(self.sizes[-1], max_blocks, self.device)
        # Each decode row is one query: the starts are fixed for every bucket. Until the first
        # step fills them, rows point at the scratch block (the warm-up before capture runs them).
        self.static.query_starts.copy_(torch.arange(self.sizes[-1] + 1, dtype=torch.int32))
        self.static.blocks.fill_(scratch_block)
        self.static.tables.fill_(scratch_block)
        self.static.seq_lens.fill_(1)
        self.static.row_slots.fill_(-1)
        self.real = self.device.type == "cuda" and torch.cuda.is_available()
        self.pool = torch.cuda.graph_pool_handle() if self.real else None
        self.graphs: dict[int, Callable[[], None]] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def bucket(self, rows: int) -> int | None:
        return next((s for s in self.sizes if s >= rows), None)

    def _forward(self, size: int) -> torch.Tensor:
        """The decode step of ``size`` padded rows, on the static buffers: logits [size, vocab]."""
        s = self.static
        lora = LoraBatch(
            row_slots=s.row_slots[:size], seg_starts=None, seg_slots=None, active_modules=frozenset(LLAMA_TARGETS),
            max_seg_len=1, backend=self.backend,
        )  # fmt: skip
        paged = PagedBatch(
            block_tables=s.tables[:size], query_starts=s.query_starts[: size + 1], seq_lens=s.seq_lens[:size], max_query_len=1
        )
        ctx = StepContext(
            positions=s.positions[:size], slot_blocks=s.blocks[:size], slot_offsets=s.offsets[:size], lora=lora, paged=paged
        )
        hidden = self.model(s.ids[:size], ctx, self.cache)
        return self.model.logits(hidden)

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

    def host_rows(self, rows: list[tuple[int, int, int, int, int, list[int]]], size: int) -> list[int]:
        """The static buffer's contents for these decode rows, padded to ``size``: (token id,
        position, KV slot, adapter slot, context length, block table) per row."""
        n, width, bs = len(rows), self.width, self.cache.block_size
        pad = size - n
        scratch = self.scratch_block * bs
        ids = [r[0] for r in rows] + [0] * pad
        positions = [r[1] for r in rows] + [0] * pad
        slots = [r[2] for r in rows] + [scratch] * pad
        row_slots = [r[3] for r in rows] + [-1] * pad
        lens = [r[4] for r in rows] + [1] * pad
        tables = [b for r in rows for b in r[5] + [0] * (width - len(r[5]))] + [self.scratch_block] * (pad * width)
        total = self.sizes[-1]
        fill = total - size

        def field(values: list[int]) -> list[int]:
            return values + [0] * fill

        return (
            field(ids) + field(positions) + field([s // bs for s in slots]) + field([s % bs for s in slots])
            + field(row_slots) + field(lens) + tables + [0] * (fill * width) + list(range(total + 1))
        )  # fmt: skip

    def run(self, rows: list[tuple[int, int, int, int, int, list[int]]]) -> torch.Tensor:
        """Logits [len(rows), vocab] of one decode step, replayed from its bucket's graph."""
        size = self.bucket(len(rows))
        assert size is not None, "the runner checks the bucket first"
        host = torch.tensor(self.host_rows(rows, size), dtype=torch.int32)
        if self.real:
            host = host.pin_memory()
        self.static.buffer.copy_(host, non_blocking=True)
        if size not in self.graphs:
            self.capture(size)
        self.graphs[size]()
        return self.outputs[size][: len(rows)]
