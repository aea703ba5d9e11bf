"""Golden outputs: an adapter replays the answers it gave on its training base; drift fails it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from engine_helpers import tiny_engine
from tiny_models import make_tiny_llama

from loraplane.adapter_format import AdapterValidationError, ErrorCode
from loraplane.adapter_format.digest import GOLDEN_FILE
from loraplane.adapter_format.golden import DriftLimits
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.lora.entries import AdapterSpec

PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 3, 99, 12, 7]]


def _record_golden(engine, adapter: str, folder: Path) -> None:
    """What a training pipeline would ship: greedy answers and top-5 log-probabilities."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=5)
    outs = engine.generate(PROMPTS, params, [adapter] * len(PROMPTS))
    cases = [
        {
            "prompt_token_ids": p,
            "greedy_token_ids": o.token_ids,
            "top_logprobs": [{str(t): lp for t, lp in step.top} for step in o.logprobs],
        }
        for p, o in zip(PROMPTS, outs, strict=True)
    ]
    (folder / GOLDEN_FILE).write_text(json.dumps({"cases": cases}))


def test_golden_outputs_pass_on_their_own_base_and_fail_when_they_drift(tiny_llama, tiny_adapters, tmp_path) -> None:
    trainer = tiny_engine(tiny_llama, tmp_path / "train", tiny_adapters)
    good = shutil.copytree(tiny_adapters["all8"], tmp_path / "good")
    _record_golden(trainer, "all8", good)
    # The same adapter's answers recorded on another base (another revision of the weights).
    other_base = make_tiny_llama(tmp_path / "other-base", seed=5)
    other = tiny_engine(other_base, tmp_path / "other", {"all8": tiny_adapters["all8"]}, base_name=tiny_llama.name)
    drifted = shutil.copytree(tiny_adapters["all8"], tmp_path / "drifted")
    _record_golden(other, "all8", drifted)

    server = tiny_engine(tiny_llama, tmp_path / "serve")
    server.load_lora("good", str(good))
    report = server.verify_golden("good")
    assert report is not None and report.steps == 30
    assert report.token_agreement == 1.0 and report.mean_kl is not None and report.mean_kl < 1e-6

    lenient = DriftLimits(min_token_agreement=0.0, max_mean_kl=1e9)
    server.adapters.register(AdapterSpec("drifted", str(drifted)))
    assert server.verify_golden("drifted", lenient) is not None  # measured, accepted under lenient limits
    with pytest.raises(AdapterValidationError) as err:
        server.verify_golden("drifted", DriftLimits(min_token_agreement=0.9))
    assert err.value.code is ErrorCode.GOLDEN_DRIFT
    assert "drifted" not in server.adapters.entries
    assert server.verify_golden("good") is not None  # the other adapter is untouched


def test_a_lower_precision_base_reports_its_drift(tiny_llama, tiny_adapters, tmp_path) -> None:
    trainer = tiny_engine(tiny_llama, tmp_path / "train", tiny_adapters)
    folder = shutil.copytree(tiny_adapters["all8"], tmp_path / "all8")
    _record_golden(trainer, "all8", folder)
    bf16 = tiny_engine(tiny_llama, tmp_path / "bf16", dtype="bfloat16", golden_min_token_agreement=0.5, golden_max_mean_kl=1.0)
    bf16.load_lora("all8", str(folder))
    report = bf16.verify_golden("all8", DriftLimits(min_token_agreement=0.5, max_mean_kl=1.0))
    assert report is not None
    assert report.mean_kl is not None and 0 < report.mean_kl < 1.0


def test_load_replays_golden_outputs_with_the_configured_threshold(tiny_llama, tiny_adapters, tmp_path) -> None:
    trainer = tiny_engine(tiny_llama, tmp_path / "train", tiny_adapters)
    other_base = make_tiny_llama(tmp_path / "other-base", seed=5)
    other = tiny_engine(other_base, tmp_path / "other", {"all8": tiny_adapters["all8"]}, base_name=tiny_llama.name)
    drifted = shutil.copytree(tiny_adapters["all8"], tmp_path / "drifted")
    _record_golden(other, "all8", drifted)
    strict = tiny_engine(tiny_llama, tmp_path / "strict")
    with pytest.raises(AdapterValidationError) as err:
        strict.load_lora("drifted", str(drifted))  # replayed at load, refused
    assert err.value.code is ErrorCode.GOLDEN_DRIFT and "drifted" not in strict.adapters.entries
    # A drifting new version of a name that serves is refused and the old version keeps serving.
    strict.load_lora("drifted", str(tiny_adapters["all8"]))
    with pytest.raises(AdapterValidationError):
        strict.load_lora("drifted", str(drifted))
    assert strict.adapters.info("drifted").source == str(tiny_adapters["all8"])
    assert sorted(strict.adapters.entries) == ["drifted"]
    lenient = tiny_engine(tiny_llama, tmp_path / "lenient", golden_min_token_agreement=0.0, golden_max_mean_kl=1e9)
    assert lenient.load_lora("drifted", str(drifted)).name == "drifted"
    del trainer


def test_the_quality_gate_replays_a_candidates_golden_outputs_and_registers_nothing(tiny_llama, tiny_adapters, tmp_path) -> None:
    import httpx

    from loraplane.serving.api.app import create_app
    from loraplane.serving.http.loopback import serve_app

    trainer = tiny_engine(tiny_llama, tmp_path / "train", tiny_adapters)
    good = shutil.copytree(tiny_adapters["all8"], tmp_path / "good")
    _record_golden(trainer, "all8", good)
    drifted = shutil.copytree(tiny_adapters["all8"], tmp_path / "drifted")
    cases = [{"prompt_token_ids": [5, 6, 7], "greedy_token_ids": [1] * 10}]  # never what this base says
    (drifted / GOLDEN_FILE).write_text(json.dumps({"cases": cases}))

    app = create_app(lambda: tiny_engine(tiny_llama, tmp_path / "serve", {"live": tiny_adapters["qv4"]}))
    with serve_app(app) as url:
        passed = httpx.post(f"{url}/admin/verify", json={"lora_path": str(good)}, timeout=60)
        assert passed.status_code == 200 and passed.json()["token_agreement"] == 1.0 and passed.json()["steps"] == 30
        failed = httpx.post(f"{url}/admin/verify", json={"lora_path": str(drifted)}, timeout=60)
        assert failed.status_code == 422 and failed.json()["error"]["code"] == "GoldenOutputDrift"
        missing = httpx.post(f"{url}/admin/verify", json={"lora_path": str(tiny_adapters["qv4"])}, timeout=60)
        assert missing.status_code == 400 and missing.json()["error"]["code"] == "golden_outputs_missing"
        stats = httpx.get(f"{url}/admin/stats").json()["adapters"]
        assert list(stats) == ["live"]  # candidates leave nothing behind
        models = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
        assert not any(m.startswith("quality-gate") for m in models)


def test_a_slow_candidate_fetch_stalls_no_other_request(tiny_llama, tiny_adapters, tmp_path, monkeypatch) -> None:
    """A quality-gate check and a load with golden outputs whose fetches hang: completions on the
    same replica still answer, and both finish once the fetch does."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from loraplane.adapter_format import sources
    from loraplane.serving.api.app import create_app
    from loraplane.serving.http.loopback import serve_app

    trainer = tiny_engine(tiny_llama, tmp_path / "train", tiny_adapters)
    good = shutil.copytree(tiny_adapters["all8"], tmp_path / "good")
    _record_golden(trainer, "all8", good)
    del trainer
    app = create_app(lambda: tiny_engine(tiny_llama, tmp_path / "serve", {"live": tiny_adapters["qv4"]}))
    body = {"model": "live", "prompt": "hi", "max_tokens": 4}
    with serve_app(app) as url, ThreadPoolExecutor(2) as pool:
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200  # live is loaded
        gate, entered = threading.Event(), []
        real_fetch = sources.FileSource.fetch

        def hanging_fetch(self, into, bounds=None):  # type: ignore[no-untyped-def]
            entered.append(self)
            gate.wait(timeout=60)
            real_fetch(self, into, bounds)

        monkeypatch.setattr(sources.FileSource, "fetch", hanging_fetch)
        verify = pool.submit(httpx.post, f"{url}/admin/verify", json={"lora_path": str(good)}, timeout=120)
        load = pool.submit(httpx.post, f"{url}/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": str(good)},
                           timeout=120)  # fmt: skip
        deadline = time.monotonic() + 30
        while len(entered) < 2:  # both are inside their fetch now
            assert time.monotonic() < deadline, "the fetches never started"
            time.sleep(0.02)
        served = httpx.post(f"{url}/v1/completions", json=body, timeout=20)
        assert served.status_code == 200 and not verify.done() and not load.done()
        gate.set()
        assert verify.result().status_code == 200, verify.result().text
        assert load.result().status_code == 200, load.result().text
        models = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
        assert "new" in models and not any(m.startswith(("quality-gate", "candidate")) for m in models)


def test_golden_ids_outside_the_vocabulary_refuse_the_file_not_the_step(tiny_llama, tiny_adapters, tmp_path) -> None:
    engine = tiny_engine(tiny_llama, tmp_path / "serve")
    engine.load_lora("kept", str(tiny_adapters["qv4"]))
    vocab = engine.base.config.vocab_size
    for case in (
        {"prompt_token_ids": [5, vocab + 7], "greedy_token_ids": [3]},
        {"prompt_token_ids": [5, 6], "greedy_token_ids": [3, 10**9]},
        {"prompt_token_ids": [5, 6], "greedy_token_ids": [3], "top_logprobs": [{str(vocab): -0.1}]},
    ):
        bad = shutil.copytree(tiny_adapters["all8"], tmp_path / f"bad-{len(list(tmp_path.iterdir()))}")
        (bad / GOLDEN_FILE).write_text(json.dumps({"cases": [case]}))
        with pytest.raises(AdapterValidationError, match="vocabulary") as err:
            engine.load_lora("kept", str(bad))  # a new version of a serving name: refused, the old one stays
        assert err.value.code is ErrorCode.BAD_CONFIG
        assert engine.adapters.info("kept").source == str(tiny_adapters["qv4"])
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0), ["kept"])[0]
    assert len(out.token_ids) == 3


def test_a_replay_keeps_two_figures_a_step_not_the_logits(tiny_llama, tiny_adapters, tmp_path) -> None:
    """What a forced step keeps is whether its argmax agreed and its KL: a vocabulary-sized row per
    step would be gigabytes for a large golden file at a 128k vocabulary."""
    import torch

    from loraplane.adapter_format.golden import load_golden
    from loraplane.serving.engine.golden_replay import drift, forced_requests

    engine = tiny_engine(tiny_llama, tmp_path / "serve", tiny_adapters)
    folder = shutil.copytree(tiny_adapters["all8"], tmp_path / "good")
    _record_golden(engine, "all8", folder)
    golden = load_golden(folder)
    assert golden is not None
    paths, params = forced_requests(golden, engine.base.config.vocab_size)
    engine.generate([c.prompt_token_ids for c in golden.cases], params, ["all8"] * len(golden.cases))
    for path in paths:
        kept = [v for value in vars(path).values() for v in (value if isinstance(value, list) else [value])]
        assert not any(isinstance(v, torch.Tensor) for v in kept), "a forced step kept a tensor"
        assert len(path.agreed) == 10 and len(path.kls) == 10
    report = drift(golden, paths)
    assert report.steps == 30 and report.token_agreement == 1.0


def test_an_over_budget_golden_file_is_refused_when_the_adapter_is_validated(tiny_llama, tiny_adapters, tmp_path) -> None:
    """The operator validates an adapter before any replica replays it: a golden file past the
    replay's token budget, or past its byte cap, is refused there by name (TooLarge)."""
    from loraplane.adapter_format import ValidationLimits, validate_adapter_dir
    from loraplane.adapter_format.golden import MAX_FORCED_TOKENS, MAX_GOLDEN_BYTES
    from loraplane.serving.weights.base import resolve_base

    shape = resolve_base(str(tiny_llama), tmp_path / "shape").shape
    many = shutil.copytree(tiny_adapters["all8"], tmp_path / "many")
    case = {"prompt_token_ids": [5, 6], "greedy_token_ids": [7] * 1024}
    (many / GOLDEN_FILE).write_text(json.dumps({"cases": [case] * (MAX_FORCED_TOKENS // 1024 + 1)}))
    with pytest.raises(AdapterValidationError, match="forced") as err:
        validate_adapter_dir(many, shape, ValidationLimits(max_lora_rank=64))
    assert err.value.code is ErrorCode.TOO_LARGE
    huge = shutil.copytree(tiny_adapters["all8"], tmp_path / "huge")
    with (huge / GOLDEN_FILE).open("wb") as fh:  # sparse: its size is past the cap, nothing is written
        fh.truncate(MAX_GOLDEN_BYTES + 1)
    with pytest.raises(AdapterValidationError, match="limit") as err:
        validate_adapter_dir(huge, shape, ValidationLimits(max_lora_rank=64))
    assert err.value.code is ErrorCode.TOO_LARGE


def test_one_replay_per_version_and_none_once_its_callers_are_gone(tiny_llama, tiny_adapters, tmp_path, monkeypatch) -> None:
    """Two callers of one version (the operator retrying after a lost connection) share a replay;
    a verify whose callers all went away is cancelled and leaves nothing on the replica."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from loraplane.adapter_format import sources
    from loraplane.serving.api.admin import quality_gate
    from loraplane.serving.api.app import create_app
    from loraplane.serving.http.loopback import serve_app

    trainer = tiny_engine(tiny_llama, tmp_path / "train", tiny_adapters)
    good = shutil.copytree(tiny_adapters["all8"], tmp_path / "good")
    _record_golden(trainer, "all8", good)
    del trainer
    started, gate, entered = [], threading.Event(), []
    real_verify, real_fetch = quality_gate.verify_candidate, sources.FileSource.fetch

    async def counted(engine, req):  # type: ignore[no-untyped-def]
        started.append(req.lora_path)
        return await real_verify(engine, req)

    def hanging_fetch(self, into, bounds=None):  # type: ignore[no-untyped-def]
        entered.append(self)
        gate.wait(timeout=60)
        real_fetch(self, into, bounds)

    monkeypatch.setattr(quality_gate, "verify_candidate", counted)
    monkeypatch.setattr(sources.FileSource, "fetch", hanging_fetch)
    app = create_app(lambda: tiny_engine(tiny_llama, tmp_path / "serve"))
    with serve_app(app) as url, ThreadPoolExecutor(2) as pool:
        body = {"lora_path": str(good)}
        first = pool.submit(httpx.post, f"{url}/admin/verify", json=body, timeout=120)
        while not entered:
            time.sleep(0.02)
        second = pool.submit(httpx.post, f"{url}/admin/verify", json=body, timeout=120)
        time.sleep(0.5)
        gate.set()
        assert first.result().status_code == 200 and second.result().status_code == 200
        assert first.result().json() == second.result().json()
        assert started == [str(good)], "the second caller joined the first replay"

        gate.clear()
        with pytest.raises(httpx.TimeoutException):  # the caller gives up while the fetch hangs
            httpx.post(f"{url}/admin/verify", json=body, timeout=1.0)
        deadline = time.monotonic() + 10
        while app.state.server.verifies.running:
            assert time.monotonic() < deadline, "the abandoned verify is still running"
            time.sleep(0.05)
        gate.set()
        time.sleep(1.0)  # the fetch's thread returns: nothing may be installed or run after it
        engine = app.state.server.engine.engine
        assert not [n for n in engine.adapters.entries if n.startswith("quality-gate")]
        assert not engine.has_unfinished()
