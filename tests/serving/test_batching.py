"""Continuous batching, chunked prefill, preemption and prefix caching change how work is
scheduled, never what a request gets back."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from engine_helpers import LogitsRecorder, engine_greedy, tiny_engine
from tiny_models import make_peft_adapter

from loraplane.serving.engine.sampling_params import SamplingParams

STEPS = 16
MIX = ["qv4", "all8", None, "mlp16", "ku2", "all8", None, "qv4"]


@pytest.fixture(scope="module")
def requests() -> list[tuple[list[int], str | None]]:
    rng = random.Random(9)
    return [([rng.randrange(3, 320) for _ in range(rng.randrange(2, 30))], a) for a in MIX]


@pytest.fixture(scope="module")
def alone(tiny_llama: Path, tiny_adapters: dict[str, Path], requests, tmp_path_factory) -> list[tuple[list[int], torch.Tensor]]:
    """Each request run by itself in a fresh engine: the answer every batch must reproduce."""
    engine = tiny_engine(tiny_llama, tmp_path_factory.mktemp("alone"), tiny_adapters, enable_prefix_caching=False)
    out = []
    for req in requests:
        tokens, logits = engine_greedy(engine, [req], STEPS, eos_id=2)
        out.append((tokens[0], logits[0]))
    return out


@pytest.mark.parametrize(
    "settings",
    [
        {},  # everything in one step
        {"max_num_batched_tokens": 7},  # prompts chunked across steps, mixed with decodes
        {"max_num_seqs": 3},  # requests join as others finish
        {"num_kv_blocks": 24, "block_size": 4, "max_model_len": 64},  # too few blocks: preemption, recompute
    ],
    ids=["one-batch", "chunked-prefill", "seq-cap", "preemption"],
)
def test_output_does_not_depend_on_batch(tiny_llama, tiny_adapters, requests, alone, settings, tmp_path) -> None:
    engine = tiny_engine(tiny_llama, tmp_path, tiny_adapters, **settings)
    tokens, logits = engine_greedy(engine, requests, STEPS, eos_id=2)
    for i, ((ref_tokens, ref_logits), got, got_logits) in enumerate(zip(alone, tokens, logits, strict=True)):
        assert got == ref_tokens, f"request {i} ({MIX[i]})"
        assert torch.allclose(got_logits, ref_logits, atol=1e-5), f"request {i} logits"
    if "num_kv_blocks" in settings:
        assert engine.scheduler.num_preemptions > 0
    # Every block came back: nothing leaks when sequences finish.
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_fair_shares_chunks_change_no_answer(tiny_llama, tiny_adapters, requests, alone, tmp_path) -> None:
    """Tenant a sends seven requests, b one, four run at once: beyond its share of two, a's prompt
    goes in chunks of ``fair_prefill_chunk`` tokens while b runs (the setting reaches the
    scheduler), and every request still gets its own answer. The chunk's sharing between several
    prompts is the scheduler tests' (test_scheduler.py)."""
    engine = tiny_engine(tiny_llama, tmp_path, tiny_adapters, max_num_seqs=4, fair_prefill_chunk=3)
    chunks: list[int] = []  # tenant a's prompt tokens in each step after the first while b runs
    schedule = engine.scheduler.schedule

    def watched():  # type: ignore[no-untyped-def]
        batch = schedule()
        if any(s.tenant == "b" for s, _ in batch.items):
            chunks.append(sum(n for s, n in batch.items if s.tenant == "a" and n > 1))
        return batch

    engine.scheduler.schedule = watched  # type: ignore[method-assign]
    recorders = [LogitsRecorder(2) for _ in requests]
    ids = {
        engine.add_request(
            prompt, SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logits_processors=[rec]),
            adapter=adapter, tenant="a" if i < 7 else "b",
        ): i
        for i, ((prompt, adapter), rec) in enumerate(zip(requests, recorders, strict=True))
    }  # fmt: skip
    tokens: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[ids[out.request_id]] = out.token_ids
    for i, (ref_tokens, ref_logits) in enumerate(alone):
        assert tokens[i] == ref_tokens, f"request {i} ({MIX[i]})"
        assert torch.allclose(recorders[i].stacked(), ref_logits, atol=1e-5), f"request {i} logits"
    assert max(chunks[1:]) == 3  # the first step admits each tenant's share whole


def test_a_request_run_between_a_steps_layers_changes_no_answer(tiny_llama, tiny_adapters, requests, alone, tmp_path) -> None:
    """Tenant a fills the batch (four of its seven requests running, three queued); tenant b's
    request arrives during a step of a's, after its second layer, and runs there (the engine's
    interjection, as the server's engine loop makes it): b's first token comes before that step
    ends, a's running sequences are parked back to the cap afterwards, and every request's tokens
    and logits still equal its run alone, b's and those of the step it ran inside alike."""
    engine = tiny_engine(tiny_llama, tmp_path, tiny_adapters, max_num_seqs=4)
    assert engine.interjects  # the CPU backend's default
    recorders = [LogitsRecorder(2) for _ in requests]

    def add(i: int, tenant: str) -> str:
        params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logits_processors=[recorders[i]])
        return engine.add_request(requests[i][0], params, adapter=requests[i][1], tenant=tenant)

    ids = {add(i, "a"): i for i in range(7)}
    outputs = list(engine.step())  # a's first four prompts
    layers = 0
    inside: list = []

    def between_layers() -> None:
        nonlocal layers
        layers += 1
        if layers == 2:
            ids[add(7, "b")] = 7
            inside.extend(engine.interject())

    engine.between_layers = between_layers
    outputs += engine.step()
    engine.between_layers = None
    assert [(ids[o.request_id], len(o.token_ids)) for o in inside] == [(7, 1)]
    assert engine.num_interjections == 1 and engine.scheduler.num_parks == 0
    outputs += inside
    while engine.has_unfinished():
        outputs += engine.step()
    assert engine.scheduler.num_parks == 1
    tokens = {ids[o.request_id]: o.token_ids for o in outputs if o.finished}
    for i, (ref_tokens, ref_logits) in enumerate(alone):
        assert tokens[i] == ref_tokens, f"request {i} ({MIX[i]})"
        assert torch.allclose(recorders[i].stacked(), ref_logits, atol=1e-5), f"request {i} logits"
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_requests_join_a_running_batch(tiny_llama, tiny_adapters, requests, alone, tmp_path) -> None:
    """Requests added between steps join the running batch and still get their own answer."""
    engine = tiny_engine(tiny_llama, tmp_path, tiny_adapters)
    ids = {}
    for step in range(60):
        if step < len(requests):
            prompt, adapter = requests[step]
            ids[engine.add_request(prompt, SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True), adapter=adapter)] = (
                step
            )
        for out in engine.step():
            if out.finished:
                assert out.token_ids[: len(alone[ids[out.request_id]][0])] == alone[ids[out.request_id]][0]
                ids.pop(out.request_id)
        if step >= len(requests) and not engine.has_unfinished():
            break
    assert not ids


def test_abort_frees_blocks_and_spares_others(tiny_llama, tiny_adapters, requests, alone, tmp_path) -> None:
    engine = tiny_engine(tiny_llama, tmp_path, tiny_adapters)
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    keep = engine.add_request(requests[0][0], params, adapter=requests[0][1])
    drop = engine.add_request(requests[1][0], params, adapter=requests[1][1])
    engine.step()
    engine.abort(drop)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    assert drop not in outs
    assert outs[keep].token_ids == alone[0][0]
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert all(e.running == 0 for e in engine.adapters.entries.values())


def test_prefix_cache_is_shared_only_under_the_same_adapter_version(tiny_llama, tiny_adapters, tmp_path) -> None:
    system = list(range(10, 34))  # 24 tokens: 6 full blocks of 4
    engine = tiny_engine(tiny_llama, tmp_path / "cache", tiny_adapters)
    fresh = tiny_engine(tiny_llama, tmp_path / "fresh", tiny_adapters, enable_prefix_caching=False)

    def run(e, prompt, adapter):
        recorder = LogitsRecorder(None)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logits_processors=[recorder])
        out = e.generate([prompt], params, [adapter])[0]
        logits[id(out)] = recorder.stacked()
        return out

    logits: dict[int, torch.Tensor] = {}

    first = run(engine, [*system, 40, 41], "qv4")
    assert first.num_cached_tokens == 0
    same = run(engine, [*system, 50, 51, 52], "qv4")
    assert same.num_cached_tokens == 24
    assert same.token_ids == run(fresh, [*system, 50, 51, 52], "qv4").token_ids
    other = run(engine, [*system, 50, 51, 52], "all8")
    assert other.num_cached_tokens == 0, "a prompt under another adapter must not reuse its KV"
    bare = run(engine, [*system, 50, 51, 52], None)
    assert bare.num_cached_tokens == 0
    assert other.token_ids == run(fresh, [*system, 50, 51, 52], "all8").token_ids

    # The same adapter name reloaded with new weights is a new version: no sharing either.
    spec_new = make_peft_adapter(tiny_llama, tmp_path / "qv4-v2", 4, 8, ["q_proj", "v_proj"], False, seed=77)
    engine.load_lora("qv4", str(spec_new))
    fresh.load_lora("qv4", str(spec_new))
    reloaded = run(engine, [*system, 50, 51, 52], "qv4")
    assert reloaded.num_cached_tokens == 0, "a reloaded adapter with new weights must not reuse old KV"
    assert reloaded.token_ids == run(fresh, [*system, 50, 51, 52], "qv4").token_ids
    assert not torch.allclose(logits[id(reloaded)], logits[id(same)], atol=1e-3), "the new weights change the answer"

    # A new config over the very same weights (lora_alpha scales every product) is a new version too.
    scaled = tmp_path / "qv4-v3"
    shutil.copytree(spec_new, scaled)
    config = json.loads((scaled / "adapter_config.json").read_text())
    (scaled / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 4 * config["lora_alpha"]}))
    engine.load_lora("qv4", str(scaled))
    fresh.load_lora("qv4", str(scaled))
    rescaled = run(engine, [*system, 50, 51, 52], "qv4")
    assert rescaled.num_cached_tokens == 0, "a new lora_alpha over the same weights must not reuse old KV"
    assert rescaled.token_ids == run(fresh, [*system, 50, 51, 52], "qv4").token_ids
