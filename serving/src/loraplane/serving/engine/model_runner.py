"""Build one forward pass's tensors from the scheduled sequences, run the model, sample.

Rows are the scheduled tokens of every sequence back to back. A sequence with one new token is
a decode row; more than one is a prefill span (a prompt, a chunk of one, or the rest after a
cached prefix). Each row carries its adapter slot; the step's LoRA plan (``kernels.lora_batch``) makes
the SGMV segments of its runs of equal slots where they pay.

The metadata is built on the host as lists and crosses to the device in one copy
(:func:`~loraplane.serving.engine.transfers.to_device`), once per step for every layer. What
the attention needs depends on the backend: the Triton kernel reads every sequence through its
block table (``PagedBatch``); the CPU path attends prefill spans one at a time and gathers the
decode rows' blocks into one padded batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field

import numpy as np
import torch

from loraplane.kernels import lora_batch
from loraplane.kernels.lora_batch import LoraBatch
from loraplane.serving.engine import prompt_logprobs, transfers
from loraplane.serving.engine.sampler import SampleFailure, Sampler
from loraplane.serving.engine.sequence import Sequence, TokenLogprob
from loraplane.serving.engine.step_graphs import DecodeGraphs, PromptGraphs
from loraplane.serving.lora.slot_table import SlotTable
from loraplane.serving.model.attention import KVCache
from loraplane.serving.model.context import PagedBatch, PrefillSpan, StepContext
from loraplane.serving.model.llama import LlamaModel


@dataclass
class _Rows:
    """A step's metadata on the host, before it crosses to the device: per-token arrays built a
    sequence at a time (numpy, not a Python loop per token: a step may carry 8,192 prompt
    tokens), per-sequence lists."""

    ids: list[np.ndarray] = field(default_factory=list)
    positions: list[np.ndarray] = field(default_factory=list)
    blocks: list[np.ndarray] = field(default_factory=list)  # KV block of each new token
    offsets: list[np.ndarray] = field(default_factory=list)  # its place in the block
    runs: list[tuple[int, int]] = field(default_factory=list)  # (adapter slot, rows) per sequence
    query_starts: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    sampled: list[Sequence] = field(default_factory=list)

    def row_slots(self) -> np.ndarray:
        """Each token's adapter slot, from the sequences' runs."""
        return np.repeat(np.array([slot for slot, _ in self.runs], dtype=np.int32), [n for _, n in self.runs])


@dataclass(frozen=True)
class Feed:
    """The step in flight's sampled token ids, on the device, and each sequence's row in them:
    what the next step's input ids take for tokens not read back yet (async scheduling)."""

    tokens: torch.Tensor
    rows: dict[int, int]  # seq id -> row of ``tokens``


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        slots: SlotTable,
        sampler: Sampler,
        backend: str = "cpu",
        graphs: DecodeGraphs | None = None,
        prompt_graphs: PromptGraphs | None = None,
    ) -> None:
        """``backend``: "triton" (the paged-attention kernel and the Triton LoRA kernels) or
        "cpu" (numba loops for LoRA and decode attention, SDPA for prompts), resolved by the builder from the device; ``graphs``
        replays decode-only steps and ``prompt_graphs`` the others (absent: those run eagerly)."""
        self.model, self.cache, self.slots, self.sampler, self.backend = model, cache, slots, sampler, backend
        self.graphs, self.prompt_graphs = graphs, prompt_graphs
        self.block_size = cache.block_size
        self.device = model.embed_tokens.weight.device
        self.activation_dtype = model.embed_tokens.weight.dtype  # what the LoRA plan weighs on the CPU

    def _rows(self, items: list[tuple[Sequence, int]]) -> _Rows:
        bs, r = self.block_size, _Rows()
        for seq, n in items:
            start, first = r.query_starts[-1], seq.num_computed_tokens
            r.ids.append(np.asarray(seq.tokens(first, first + n), dtype=np.int32))
            span = np.arange(first, first + n, dtype=np.int32)
            r.positions.append(span)
            table = seq.block_table
            r.blocks.append(np.asarray(table[first // bs : -(-(first + n) // bs)], dtype=np.int32)[span // bs - first // bs])
            r.offsets.append(span % bs)
            r.runs.append((seq.adapter_slot, n))
            context = first + n
            r.query_starts.append(start + n)
            r.seq_lens.append(context)
            r.tables.append(table[: -(-context // bs)])
            if context == len(seq):
                r.logit_rows.append(start + n - 1)
                r.sampled.append(seq)
        return r

    def build(self, items: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, StepContext, torch.Tensor, list[Sequence]]:
        """(input ids, the step's context, the rows to compute logits for, the sequences sampled).
        One function: every host list crosses to the device in one transfer, and both backends'
        contexts are cut from those same tensors."""
        r = self._rows(items)
        num_rows = r.query_starts[-1]
        plan = lora_batch.plan(r.runs, self.backend, self.activation_dtype)
        starts, seg_slots = (plan.seg_starts, plan.seg_slots) if plan else ([0], [])
        width = max(len(t) for t in r.tables)
        # Padding repeats the sequence's own first block: the CPU path's padded gather reads it
        # (masked), and under unified paging block 0 may hold an adapter's float32 rows, whose
        # bits can be NaN in the KV dtype, and 0 x NaN is NaN. The Triton kernel never reads it.
        padded = [x for t in r.tables for x in t + t[:1] * (width - len(t))]
        decode = [i for i, (_, n) in enumerate(items) if n == 1]
        arrays: list[tuple[Sequence_[int] | np.ndarray, tuple[int, ...]]] = [
            (np.concatenate(r.ids), (num_rows,)),
            (np.concatenate(r.positions), (num_rows,)),
            (np.concatenate(r.blocks), (num_rows,)),
            (np.concatenate(r.offsets), (num_rows,)),
            (r.logit_rows, (len(r.logit_rows),)),
            (r.row_slots(), (num_rows,)),
            (starts, (len(starts),)),
            (seg_slots, (len(seg_slots),)),
            (padded, (len(items), width)),
            (r.query_starts, (len(items) + 1,)),
            (r.seq_lens, (len(items),)),
            ([r.query_starts[i] for i in decode], (len(decode),)),
        ]
        ids, positions, blocks, offsets, logit_rows, row_slots, seg_starts, seg_slot_ids, tables, qstarts, lens, drows = (
            transfers.to_device(arrays, self.device)
        )
        lora = None
        if plan is not None:
            self.slots.wait_for_writes(plan.used)  # adapter copies on their own stream, before the first layer reads them
            lora = LoraBatch(
                row_slots=row_slots,
                seg_starts=seg_starts if plan.by_segments else None,
                seg_slots=seg_slot_ids if plan.by_segments else None,
                active_modules=self.slots.active_modules(plan.used),
                max_seg_len=plan.max_seg_len,
                backend=self.backend,
            )
        if self.backend == "triton":
            max_query = max(n for _, n in items)
            paged = PagedBatch(block_tables=tables, query_starts=qstarts, seq_lens=lens, max_query_len=max_query)
            ctx = StepContext(positions=positions, slot_blocks=blocks, slot_offsets=offsets, lora=lora, paged=paged, fused=True)
            return ids, ctx, logit_rows, r.sampled
        prefills = tuple(
            PrefillSpan(r.query_starts[i], n, r.seq_lens[i], tables[i, : len(r.tables[i])])
            for i, (_, n) in enumerate(items)
            if n > 1
        )
        ctx = StepContext(positions=positions, slot_blocks=blocks, slot_offsets=offsets, prefills=prefills, lora=lora)
        if decode:
            # Each decode row's table, as wide as the longest decode row's (not a prefill's context
            # beside them), and its length: float32 reads the cache through them in place, other
            # dtypes gather those blocks into one padded batch.
            dw = max(len(r.tables[i]) for i in decode)
            ctx = dataclasses.replace(ctx, decode_rows=drows, decode_block_tables=tables[decode, :dw], decode_lens=lens[decode])
        return ids, ctx, logit_rows, r.sampled

    def _decode_rows(self, items: list[tuple[Sequence, int]]) -> list[tuple[int, int, int, int, int, list[int]]] | None:
        """The step as graph rows, when it can replay one: every sequence decodes its last token
        and a bucket holds them all; else None (the step runs eagerly)."""
        if self.graphs is None or self.graphs.bucket(len(items)) is None:
            return None
        bs, rows = self.block_size, []
        for seq, n in items:
            p = seq.num_computed_tokens
            if n != 1 or p + 1 != len(seq):
                return None
            table = seq.block_table[: p // bs + 1]
            rows.append((seq.tokens(p, p + 1)[0], p, table[p // bs] * bs + p % bs, seq.adapter_slot, p + 1, table))
        return rows

    @torch.inference_mode()
    def run(
        self, items: list[tuple[Sequence, int]], between_layers: Callable[[], None] | None = None
    ) -> dict[int, tuple[int, TokenLogprob | None] | SampleFailure]:
        """Next token (and log-probability) for every sequence that reached its last token, by seq
        id; a ``SampleFailure`` for one whose row could not be sampled. ``between_layers`` is the
        model's (an eager step only: a replayed graph has no Python between its layers)."""
        logits, sampled = self._forward(items, between_layers, None)
        if logits is None:
            return {}
        results = self.sampler.sample(logits, sampled)
        return {seq.seq_id: r for seq, r in zip(sampled, results, strict=True)}

    @torch.inference_mode()
    def launch(self, items: list[tuple[Sequence, int]], feed: Feed | None) -> tuple[list[Sequence], torch.Tensor | None]:
        """Async scheduling: the step issued, its sampled token ids left on the device, nothing
        read back: (the sequences sampled, their token ids in that order; None when none samples).
        A sequence whose last token is still in flight (``PENDING``) is fed it from ``feed``, the
        step before's token ids, on the device. Every sequence must be ``device_sampling.deferrable``."""
        logits, sampled = self._forward(items, None, self._feeder(items, feed))
        if logits is None:
            return [], None
        return sampled, self.sampler.choose(logits, sampled)

    def _feeder(self, items: list[tuple[Sequence, int]], feed: Feed | None) -> Callable[[torch.Tensor], None] | None:
        """What writes the in-flight tokens into a step's input ids once those are on the device
        (one small copy of row indices, one indexed write); None when no row needs one."""
        dst: list[int] = []
        src: list[int] = []
        end = 0
        for seq, n in items:
            end += n
            if not seq.awaits_token:
                continue
            # Only a sequence's last token can be in flight, and only the step after the one that
            # sampled it reads it: a scheduler that broke this would feed a placeholder as a token.
            if feed is None or seq.seq_id not in feed.rows or seq.num_computed_tokens + n != len(seq):
                raise RuntimeError(f"request {seq.request_id}: a token still in flight was scheduled out of turn")
            dst.append(end - 1)
            src.append(feed.rows[seq.seq_id])
        if not dst:
            return None
        assert feed is not None
        tokens = feed.tokens

        def patch(ids: torch.Tensor) -> None:
            rows, index = transfers.to_device([(dst, (len(dst),)), (src, (len(src),))], ids.device)
            # A row that failed to sample carries a negative code: fed as id 0, its result is discarded.
            ids.index_put_((rows.long(),), tokens.index_select(0, index.long()).clamp(min=0).to(ids.dtype))

        return patch

    def _forward(
        self,
        items: list[tuple[Sequence, int]],
        between_layers: Callable[[], None] | None,
        patch: Callable[[torch.Tensor], None] | None,
    ) -> tuple[torch.Tensor | None, list[Sequence]]:
        """(the logits of the sequences sampled, those sequences), or (None, []) when none
        reached its last token; ``patch`` rewrites the input ids on the device before they are read."""
        rows = self._decode_rows(items)
        if rows is not None:
            assert self.graphs is not None
            self.slots.wait_for_writes({r[3] for r in rows} - {-1})
            return self.graphs.run(rows, patch), [seq for seq, _ in items]
        replayed = self._replay_prompt_graph(items, patch) if between_layers is None else None
        if replayed is not None:
            hidden, sampled_hidden, sampled = replayed
        else:
            input_ids, ctx, logit_rows, sampled = self.build(items)
            if patch is not None:
                patch(input_ids)
            # The hook only when there is one: the forward's three-argument call stays what it
            # was for every step that has none (every step on a GPU).
            if between_layers is None:
                hidden = self.model(input_ids, ctx, self.cache)
            else:
                hidden = self.model(input_ids, ctx, self.cache, between_layers=between_layers)
            sampled_hidden = hidden[logit_rows]
        if any(seq.params.prompt_logprobs is not None for seq, _ in items):
            prompt_logprobs.record(items, hidden, self.model.logits)
        if not sampled:
            return None, []
        return self.model.logits(sampled_hidden), sampled

    def _replay_prompt_graph(
        self, items: list[tuple[Sequence, int]], patch: Callable[[torch.Tensor], None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, list[Sequence]] | None:
        """(the rows' hidden states, the sampled rows', the sequences sampled) of a step with
        prompts replayed from its token bucket's graph, or None when no bucket holds it (or there
        are no prompt graphs: the step then runs eagerly)."""
        graphs = self.prompt_graphs
        if graphs is None:
            return None
        size = graphs.fits(sum(n for _, n in items), len(items))
        if size is None:
            return None
        r = self._rows(items)
        plan = lora_batch.plan(r.runs, self.backend, self.activation_dtype)
        if plan is not None:
            self.slots.wait_for_writes(plan.used)
        token_arrays = [np.concatenate(a) for a in (r.ids, r.positions, r.blocks, r.offsets)] + [r.row_slots()]
        hidden, sampled_hidden = graphs.run(size, token_arrays, plan, r.query_starts, r.seq_lens, r.tables, r.logit_rows, patch)
        return hidden, sampled_hidden, r.sampled
