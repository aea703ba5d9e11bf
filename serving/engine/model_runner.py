"""Build one forward pass's tensors from the scheduled sequences, run the model, sample.

Rows are the scheduled tokens of every sequence back to back. A sequence with one new token is
a decode row (attended together with the other decode rows); more than one is a prefill span.
Each row carries its adapter slot, and runs of rows with the same slot form the SGMV segments.
"""

from __future__ import annotations

import torch

from loraplane.serving.engine.sampler import SampleFailure, Sampler
from loraplane.serving.engine.sequence import Sequence, TokenLogprob
from loraplane.serving.lora.slot_table import SlotTable
from loraplane.serving.model.attention import KVCache
from loraplane.serving.model.context import LoraBatch, PrefillSpan, StepContext
from loraplane.serving.model.llama import LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, slots: SlotTable, sampler: Sampler) -> None:
        self.model, self.cache, self.slots, self.sampler = model, cache, slots, sampler
        self.block_size = cache.block_size

    def _lora_batch(self, row_slots: list[int]) -> LoraBatch | None:
        used = set(row_slots) - {-1}
        if not used:
            return None
        starts, seg_slots = [0], []
        for i, s in enumerate(row_slots):
            if i and s == row_slots[i - 1]:
                continue
            if i:
                starts.append(i)
            seg_slots.append(s)
        starts.append(len(row_slots))
        long_runs = len(seg_slots) < len(row_slots)
        return LoraBatch(
            row_slots=torch.tensor(row_slots, dtype=torch.int32),
            seg_starts=torch.tensor(starts, dtype=torch.int32) if long_runs else None,
            seg_slots=torch.tensor(seg_slots, dtype=torch.int32) if long_runs else None,
            active_modules=self.slots.active_modules(used),
        )

    def build(self, items: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, StepContext, list[int], list[Sequence]]:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        row_slots: list[int] = []
        prefills: list[PrefillSpan] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        for seq, n in items:
            start, first = len(ids), seq.num_computed_tokens
            ids += seq.tokens(first, first + n)
            span = range(first, first + n)
            positions += span
            table = seq.block_table
            slot_mapping += [table[p // bs] * bs + p % bs for p in span]
            row_slots += [seq.adapter_slot] * n
            context = first + n
            if n == 1:
                decode_rows.append(start)
                decode_tables.append(table[: -(-context // bs)])
                decode_lens.append(context)
            else:
                blocks = torch.tensor(table[: -(-context // bs)], dtype=torch.long)
                prefills.append(PrefillSpan(start, n, context, blocks))
            if context == len(seq):
                logit_rows.append(start + n - 1)
                sampled.append(seq)
        decode_kwargs = {}
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            padded = [t + [0] * (width - len(t)) for t in decode_tables]
            lens = torch.tensor(decode_lens, dtype=torch.long)
            mask = torch.arange(width * bs).unsqueeze(0) < lens.unsqueeze(1)
            decode_kwargs = {
                "decode_rows": torch.tensor(decode_rows, dtype=torch.long),
                "decode_block_tables": torch.tensor(padded, dtype=torch.long),
                "decode_mask": mask.view(len(decode_rows), 1, 1, width * bs),
            }
        slots = torch.tensor(slot_mapping, dtype=torch.long)
        ctx = StepContext(
            positions=torch.tensor(positions, dtype=torch.long),
            slot_blocks=slots // bs,
            slot_offsets=slots % bs,
            prefills=tuple(prefills),
            lora=self._lora_batch(row_slots),
            **decode_kwargs,
        )
        return torch.tensor(ids, dtype=torch.long), ctx, logit_rows, sampled

    @torch.inference_mode()
    def run(self, items: list[tuple[Sequence, int]]) -> dict[int, tuple[int, TokenLogprob | None] | SampleFailure]:
        """Next token (and log-probability) for every sequence that reached its last token, by seq
        id; a ``SampleFailure`` for one whose row could not be sampled."""
        input_ids, ctx, logit_rows, sampled = self.build(items)
        hidden = self.model(input_ids, ctx, self.cache)
        if not sampled:
            return {}
        logits = self.model.logits(hidden[logit_rows])
        results = self.sampler.sample(logits, sampled)
        return {seq.seq_id: r for seq, r in zip(sampled, results, strict=True)}
