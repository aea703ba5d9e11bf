"""Adapters in the engine: PEFT folders in, clear refusals for anything that does not fit,
and a refused adapter changes nothing for the ones already serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from engine_helpers import engine_greedy, tiny_engine
from tiny_models import make_peft_adapter

from loraplane.adapter_format import AdapterValidationError, ErrorCode
from loraplane.serving.engine.llm_engine import RequestError
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.lora.entries import AdapterBusy, AdapterNotFound, AdapterSpec


@pytest.fixture
def engine(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path):
    return tiny_engine(tiny_llama, tmp_path / "cache", {"qv4": tiny_adapters["qv4"]}, max_loras=2, base_revision="r1")


def _serves_qv4_unchanged(engine, before) -> None:
    assert engine_greedy(engine, [([5, 6, 7], "qv4")], 6)[0] == before


def test_adapter_for_another_base_is_refused_alone(engine, tiny_llama: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig, LlamaForCausalLM

    before = engine_greedy(engine, [([5, 6, 7], "qv4")], 6)[0]
    # A PEFT adapter trained on a 96-wide model that carries our base's name.
    wide = tmp_path / "wide" / tiny_llama.name
    LlamaForCausalLM(AutoConfig.from_pretrained(str(tiny_llama), hidden_size=96)).save_pretrained(str(wide))
    adapter = make_peft_adapter(wide, tmp_path / "wide-adapter", 4, 8, ["q_proj"], False, seed=1)
    with pytest.raises(AdapterValidationError) as err:
        engine.load_lora("wide", str(adapter))
    assert err.value.code is ErrorCode.SHAPE_MISMATCH
    assert "wide" not in engine.adapters.entries
    _serves_qv4_unchanged(engine, before)


def test_revision_and_pickle_refusals_have_their_own_codes(engine, tiny_adapters, tmp_path: Path) -> None:
    before = engine_greedy(engine, [([5, 6, 7], "qv4")], 6)[0]
    cases: dict[str, tuple[Path, ErrorCode]] = {}
    rev = shutil.copytree(tiny_adapters["all8"], tmp_path / "rev")
    raw = json.loads((rev / "adapter_config.json").read_text())
    (rev / "adapter_config.json").write_text(json.dumps({**raw, "revision": "r0"}))
    cases["rev"] = (rev, ErrorCode.BASE_MISMATCH)
    pickled = shutil.copytree(tiny_adapters["ku2"], tmp_path / "pickled")
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04")
    cases["pickled"] = (pickled, ErrorCode.PICKLE_REFUSED)
    for name, (folder, code) in cases.items():
        with pytest.raises(AdapterValidationError) as err:
            engine.load_lora(name, str(folder))
        assert err.value.code is code, name
    assert set(engine.adapters.entries) == {"qv4"}
    _serves_qv4_unchanged(engine, before)


def test_rank_above_max_lora_rank_is_refused(tiny_llama, tiny_adapters, tmp_path: Path) -> None:
    engine = tiny_engine(tiny_llama, tmp_path, max_lora_rank=8)
    with pytest.raises(AdapterValidationError) as err:
        engine.load_lora("mlp16", str(tiny_adapters["mlp16"]))
    assert err.value.code is ErrorCode.RANK_OVER_CAP


def test_more_adapters_than_slots_take_turns(engine, tiny_adapters) -> None:
    """Two device slots, three adapters: idle ones give their slot up, answers do not change."""
    alone = {}
    for name in ("qv4", "all8", "ku2"):
        if name != "qv4":
            engine.load_lora(name, str(tiny_adapters[name]))
        alone[name] = engine_greedy(engine, [([5, 6, 7], name)], 6)[0]
    mixed = engine_greedy(engine, [([5, 6, 7], n) for n in ("qv4", "all8", "ku2", "qv4")], 6)[0]
    assert mixed == [alone["qv4"][0], alone["all8"][0], alone["ku2"][0], alone["qv4"][0]]
    assert sum(1 for e in engine.adapters.entries.values() if e.slot is not None) <= 2


def test_unknown_names_busy_adapters_and_long_prompts(engine, tiny_adapters) -> None:
    engine.load_lora("all8", str(tiny_adapters["all8"]))
    with pytest.raises(AdapterNotFound, match="nope"):
        engine.add_request([1, 2, 3], adapter="nope")
    with pytest.raises(ValueError, match=r"path|name|character"):
        engine.load_lora("../escape", str(tiny_adapters["ku2"]))
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4), adapter="all8")
    with pytest.raises(AdapterBusy, match="queued"):  # queued requests name it; running ones finish on a retired copy
        engine.unload_lora("all8")
    engine.abort(rid)
    engine.unload_lora("all8")
    assert "all8" not in engine.adapters.entries
    with pytest.raises(RequestError, match="maximum context length is"):
        engine.add_request([1] * 500, SamplingParams(max_tokens=100))
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request([1, 99999])
    assert not engine.has_unfinished()


def test_a_base_folder_called_base_still_checks_what_adapters_declare(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """The base's identity is its name whatever its folder is called; the name check once turned
    off for a folder named ``base``. ``--served-model-name`` (base_name) names it explicitly."""
    folder = shutil.copytree(tiny_llama, tmp_path / "base")
    adapter = shutil.copytree(tiny_adapters["qv4"], tmp_path / "for-another")
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "someone/another-model"
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    plain = tiny_engine(folder, tmp_path / "cache-a")
    assert plain.base.shape.name == "base"
    with pytest.raises(AdapterValidationError) as err:
        plain.load_lora("other", str(adapter))
    assert err.value.code is ErrorCode.BASE_MISMATCH and "someone/another-model" in str(err.value)
    named = tiny_engine(folder, tmp_path / "cache-b", base_name="someone/another-model")
    assert named.load_lora("other", str(adapter)).name == "other"


def test_the_server_reads_registrations_from_a_published_snapshot(engine, tiny_adapters) -> None:
    """The event loop reads ``catalog`` without the engine thread: each registration replaces it
    whole, so a reader holding one sees a consistent version that never changes under it."""
    before = engine.adapters.catalog
    engine.register_lora(AdapterSpec("snapshot-a", str(tiny_adapters["qv4"]), tenant="acme"))
    after = engine.adapters.catalog
    assert "snapshot-a" not in before and after["snapshot-a"].tenant == "acme"
    with pytest.raises(TypeError):
        after["x"] = after["snapshot-a"]  # type: ignore[index]
    engine.unload_lora("snapshot-a")
    assert "snapshot-a" in after and "snapshot-a" not in engine.adapters.catalog
    assert set(engine.adapters.catalog) == set(engine.adapters.entries)
