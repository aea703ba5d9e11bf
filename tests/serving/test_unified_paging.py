"""Unified paging: adapters live in the KV block pool, sized by rank, and give pages back to KV."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from engine_helpers import engine_greedy, tiny_engine

from loraplane.admin_api import Tier
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.lora.slot_table import PagedSlotTable

MIX = ["qv4", "all8", None, "mlp16", "ku2", "all8", None, "qv4"]


def test_unified_paging_answers_like_static_slots(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    rng = random.Random(4)
    requests = [([rng.randrange(3, 320) for _ in range(rng.randrange(3, 25))], a) for a in MIX]
    static = engine_greedy(tiny_engine(tiny_llama, tmp_path / "s", tiny_adapters), requests, 12, eos_id=2)
    unified_engine = tiny_engine(tiny_llama, tmp_path / "u", tiny_adapters, lora_memory="unified")
    unified = engine_greedy(unified_engine, requests, 12, eos_id=2)
    assert unified[0] == static[0]
    for ours, ref in zip(unified[1], static[1], strict=True):
        assert torch.allclose(ours, ref, atol=1e-5)
    # The four adapters' pages came out of the KV pool, and nothing else leaked.
    blocks = unified_engine.blocks
    held = sum(len(e.placement.pages) for e in unified_engine.adapters.entries.values() if e.placement is not None)
    assert held == blocks.adapter_pages > 0
    assert blocks.num_free == blocks.num_blocks - held


def test_pages_grow_with_rank(tiny_llama: Path, tmp_path: Path) -> None:
    engine = tiny_engine(tiny_llama, tmp_path, lora_memory="unified", max_lora_rank=64)
    table = engine.slots
    assert isinstance(table, PagedSlotTable)
    dims = {"q_proj": (64, 64), "v_proj": (64, 32)}

    def weights(rank: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        return {(layer, m): (torch.zeros(rank, i), torch.zeros(o, rank)) for layer in range(3) for m, (i, o) in dims.items()}

    r8, r64 = table.pages_needed(weights(8)), table.pages_needed(weights(64))
    assert 7.0 <= r64 / r8 <= 8.5  # a rank-8 adapter takes about an eighth of a rank-64 one


def test_kv_pressure_takes_pages_back_from_idle_adapters(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    engine = tiny_engine(tiny_llama, tmp_path, tiny_adapters, lora_memory="unified", num_kv_blocks=160, max_model_len=160)
    reference = tiny_engine(tiny_llama, tmp_path / "ref", tiny_adapters)
    for name in tiny_adapters:  # all four resident: their pages leave less for KV
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0), [name])
    assert all(engine.adapters.residency(n) is Tier.DEVICE for n in tiny_adapters)
    before = engine.blocks.adapter_pages
    assert engine.blocks.num_blocks - before < 3 * 35  # three 140-token sequences would not fit beside them
    # Bare-base requests whose KV needs most of the pool: idle adapters must make room.
    prompts = [[t % 300 + 3 for t in range(i, i + 120)] for i in range(3)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference.generate(prompts, params)]
    assert engine.blocks.adapter_pages < before
    assert any(engine.adapters.residency(n) is Tier.HOST for n in tiny_adapters)
    # And the adapters come back when asked for, with unchanged answers.
    again = engine_greedy(engine, [([5, 6, 7], "all8")], 6)[0]
    assert again == engine_greedy(reference, [([5, 6, 7], "all8")], 6)[0]


def test_a_half_precision_kv_cache_never_reads_adapter_bits(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """In bfloat16, KV blocks and adapter rows (float32) share pages: half of a float32 word can be
    a NaN in bfloat16. Pages an adapter gives back are cleared, and the CPU path's padded decode
    gather pads with the sequence's own block: logits stay finite and equal to static slots', also
    after KV pressure took pages back from adapters and reused them."""
    unified = tiny_engine(
        tiny_llama, tmp_path / "u", tiny_adapters, lora_memory="unified", dtype="bfloat16", num_kv_blocks=160, max_model_len=160
    )
    static = tiny_engine(tiny_llama, tmp_path / "s", tiny_adapters, dtype="bfloat16", num_kv_blocks=160, max_model_len=160)
    short = [([5, 6, 7, 8, 9, 10], "all8"), ([11, 12, 13], None), ([20, 21, 22, 23], "mlp16"), ([30, 31], "qv4")]
    long = [[t % 300 + 3 for t in range(i, i + 120)] for i in range(3)]
    held = {}
    for name, engine in (("unified", unified), ("static", static)):  # adapters resident, then long prompts push them out
        engine_greedy(engine, short, 4, eos_id=2)
        held[name] = engine.blocks.adapter_pages
        engine.generate(long, SamplingParams(max_tokens=20, temperature=0))
    assert unified.blocks.adapter_pages < held["unified"]  # KV took adapter pages back (and will reuse them)
    tokens, logits = engine_greedy(unified, short, 8, eos_id=2)
    ref_tokens, ref_logits = engine_greedy(static, short, 8, eos_id=2)
    assert all(torch.isfinite(row).all() for row in logits)
    # Later bfloat16 steps may break near-ties apart (the unified engine reloads evicted adapters,
    # so its batches differ); the first step of every request is the same computation.
    assert [t[0] for t in tokens] == [t[0] for t in ref_tokens]
    for ours, ref in zip(logits, ref_logits, strict=True):
        assert torch.allclose(ours[0], ref[0], atol=5e-2)
