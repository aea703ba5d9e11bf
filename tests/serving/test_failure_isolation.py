"""A failure inside one sequence fails that sequence alone; a failure of the shared forward pass
fails the batch it ran, and the engine serves the next requests."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import tiny_engine

from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.engine.sequence import FinishReason


def run(engine, ids: list[str]) -> dict:  # type: ignore[no-untyped-def]
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_a_raising_logits_processor_fails_only_its_own_request(tiny_llama: Path, tiny_adapters, tmp_path: Path) -> None:
    engine = tiny_engine(tiny_llama, tmp_path, tiny_adapters)

    def hostile(tokens, row):  # type: ignore[no-untyped-def]
        if len(tokens) == 2:
            raise RuntimeError("processor exploded")
        return row

    good = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ids = [
        engine.add_request([5, 6, 7], good, adapter="qv4"),
        engine.add_request([9, 10], SamplingParams(max_tokens=8, temperature=0, logits_processors=(hostile,))),
        engine.add_request([11, 12, 13], good),
    ]
    done = run(engine, ids)
    failed = done[ids[1]]
    assert failed.finish_reason is FinishReason.ERROR and failed.error_code == "sampling_failed"
    assert "processor exploded" in (failed.error or "") and len(failed.token_ids) == 2
    for rid in (ids[0], ids[2]):
        assert done[rid].finish_reason is FinishReason.LENGTH and len(done[rid].token_ids) == 8


def test_temperatures_that_underflow_are_greedy_and_huge_seeds_are_reduced(tiny_llama: Path, tmp_path: Path) -> None:
    engine = tiny_engine(tiny_llama, tmp_path)
    greedy = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    tiny = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=1e-40, ignore_eos=True))[0]
    assert tiny.finish_reason is FinishReason.LENGTH and tiny.token_ids == greedy.token_ids
    big = SamplingParams(max_tokens=6, temperature=1.0, seed=2**64 + 3, ignore_eos=True)
    same = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    a, b = engine.generate([[5, 6, 7], [5, 6, 7]], [big, same])
    assert a.token_ids == b.token_ids and big.seed == 3


def test_a_failed_forward_pass_fails_its_batch_and_the_engine_goes_on(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = tiny_engine(tiny_llama, tmp_path, max_num_seqs=1)  # one sequence per batch: the other waits
    real = engine.runner.run
    calls = {"n": 0}

    def flaky(items):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device fault")
        return real(items)

    monkeypatch.setattr(engine.runner, "run", flaky)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ids = [engine.add_request([5, 6, 7], params), engine.add_request([8, 9], params)]
    done = run(engine, ids)
    assert done[ids[0]].finish_reason is FinishReason.ERROR and done[ids[0]].error_code == "engine_error"
    assert done[ids[1]].finish_reason is FinishReason.LENGTH and len(done[ids[1]].token_ids) == 4
    assert engine.blocks.num_free == engine.blocks.num_blocks  # nothing leaked
    later = engine.generate([[5, 6, 7]], params)[0]
    assert later.finish_reason is FinishReason.LENGTH


def test_a_refused_reload_leaves_the_served_version_serving(tiny_llama: Path, tiny_adapters, tmp_path: Path) -> None:
    from loraplane.adapter_format import AdapterValidationError

    engine = tiny_engine(tiny_llama, tmp_path)
    info = engine.load_lora("bot", str(tiny_adapters["qv4"]))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    before = engine.generate([[5, 6, 7]], params, ["bot"])[0].token_ids
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{}")
    for source in (str(tmp_path / "no-such-folder"), str(broken)):
        with pytest.raises(AdapterValidationError):
            engine.load_lora("bot", source)
        assert engine.adapters.info("bot").digest == info.digest
        assert engine.generate([[5, 6, 7]], params, ["bot"])[0].token_ids == before
    assert sorted(engine.adapters.entries) == ["bot"]  # no candidate left behind


def test_a_refused_adapter_is_not_fetched_again_and_a_transient_failure_backs_off(
    tiny_llama: Path, tiny_adapters, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loraplane.serving.lora.entries import AdapterSpec, AdapterUnavailable

    engine = tiny_engine(tiny_llama, tmp_path)
    loads: list[str] = []
    real = engine.adapters.loader.load  # counted: the fetch-and-validate step every load goes through

    def counted(spec):  # type: ignore[no-untyped-def]
        loads.append(spec.name)
        if spec.name == "flaky" and loads.count("flaky") == 1:
            raise OSError("connection reset by the store")
        return real(spec)

    monkeypatch.setattr(engine.adapters.loader, "load", counted)
    engine.register_lora(AdapterSpec("ghost", str(tmp_path / "nothing-here")))
    params = SamplingParams(max_tokens=2, temperature=0)
    first = run(engine, [engine.add_request([5, 6], params, adapter="ghost")])
    assert next(iter(first.values())).error_code == "adapter_load_failed"
    with pytest.raises(AdapterUnavailable, match="failed to load"):
        engine.add_request([5, 6], params, adapter="ghost")  # fails at once, nothing fetched again
    assert loads.count("ghost") == 1

    engine.register_lora(AdapterSpec("flaky", str(tiny_adapters["qv4"])))
    failed = run(engine, [engine.add_request([5, 6], params, adapter="flaky")])
    assert next(iter(failed.values())).finish_reason is FinishReason.ERROR
    retried = run(engine, [engine.add_request([5, 6], params, adapter="flaky")])  # waits out the backoff, then loads
    assert next(iter(retried.values())).finish_reason is FinishReason.LENGTH and loads.count("flaky") == 2


def test_a_failure_taking_requests_between_layers_leaves_the_step_in_flight_alone(tiny_llama: Path, tmp_path: Path) -> None:
    """What runs between a step's layers (the server's intake of new requests) is not the running
    batch's business: its error is logged, and the step's requests finish with their answers."""
    engine = tiny_engine(tiny_llama, tmp_path)
    calls = {"n": 0}

    def broken() -> None:
        calls["n"] += 1
        raise RuntimeError("intake failed")

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ids = [engine.add_request([5, 6, 7], params), engine.add_request([8, 9], params)]
    engine.between_layers = broken
    done = run(engine, ids)
    assert calls["n"] > 0
    assert all(done[i].finish_reason is FinishReason.LENGTH and len(done[i].token_ids) == 4 for i in ids)
