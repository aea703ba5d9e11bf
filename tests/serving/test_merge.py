"""A merged checkpoint against PEFT's ``merge_and_unload``: the dedicated deployment's model must
compute what the adapter computes on the shared base, for every rank, target set, rank and alpha
pattern, rsLoRA and the fused projections (q/k/v, gate/up) the engine serves them through."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from engine_helpers import engine_greedy, tiny_engine
from tiny_models import make_peft_adapter

from loraplane.adapter_format import AdapterValidationError, adapter_digest
from loraplane.cli import main
from loraplane.node_cache.base_copy import folder_digest
from loraplane.serving.lora.merge import merge_adapter
from loraplane.serving.weights.base import PROVENANCE, resolve_base


def logits(folder: Path, ids: torch.Tensor, adapter: Path | None = None) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def patterned(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rank and alpha patterns on top of rsLoRA: each module its own rank and scaling."""
    return make_peft_adapter(
        tiny_llama, tmp_path_factory.mktemp("patterned") / "a", 8, 16,
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True, seed=11,
        rank_pattern={"k_proj": 2, r"layers\.1\.mlp\.down_proj": 4}, alpha_pattern={"v_proj": 3.0},
    )  # fmt: skip


@pytest.mark.parametrize("name", ["qv4", "all8", "mlp16", "ku2", "patterned"])
def test_merged_logits_equal_peft_merge_and_unload(
    tiny_llama: Path, tiny_adapters: dict[str, Path], patterned: Path, tmp_path: Path, name: str
) -> None:
    adapter = patterned if name == "patterned" else tiny_adapters[name]
    merged = merge_adapter(resolve_base(str(tiny_llama), tmp_path / "cache"), adapter, tmp_path / "merged")
    ids = torch.tensor([random.Random(3).choices(range(3, 320), k=24)])
    ours, reference, base = logits(merged.folder, ids), logits(tiny_llama, ids, adapter), logits(tiny_llama, ids)
    assert (ours - reference).abs().max().item() < 1e-4
    assert (base - reference).abs().max().item() > 1e-2  # the adapter changes the model: the check can fail
    provenance = json.loads((merged.folder / PROVENANCE).read_text())
    assert provenance["adapter"]["digest"] == adapter_digest(adapter) == merged.adapter_digest
    targets = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    layers = json.loads((tiny_llama / "config.json").read_text())["num_hidden_layers"]
    assert provenance["adapter"]["modules"] == merged.modules == len(targets) * layers


def test_the_engine_serves_the_merged_folder_as_the_adapter_on_the_base(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    merged = merge_adapter(resolve_base(str(tiny_llama), tmp_path / "cache"), tiny_adapters["all8"], tmp_path / "merged")
    prompts = [random.Random(i).choices(range(3, 320), k=9) for i in range(4)]
    dedicated, _ = engine_greedy(tiny_engine(merged.folder, tmp_path / "e1"), [(p, None) for p in prompts], 16, eos_id=2)
    shared = tiny_engine(tiny_llama, tmp_path / "e2", {"all8": tiny_adapters["all8"]})
    with_adapter, _ = engine_greedy(shared, [(p, "all8") for p in prompts], 16, eos_id=2)
    assert dedicated == with_adapter
    assert (
        resolve_base(str(merged.folder), tmp_path / "cache").merged
        and not resolve_base(str(tiny_llama), tmp_path / "cache").merged
    )
    # A base of its own: another fingerprint, so adapters trained on the original are refused on it.
    assert resolve_base(str(merged.folder), tmp_path / "cache").shape.fingerprint != resolve_base(
        str(tiny_llama), tmp_path / "cache").shape.fingerprint  # fmt: skip


def test_a_wrong_digest_or_an_existing_folder_merges_nothing(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    base = resolve_base(str(tiny_llama), tmp_path / "cache")
    with pytest.raises(AdapterValidationError, match="digest"):
        merge_adapter(base, tiny_adapters["qv4"], tmp_path / "merged", expected_digest="sha256:" + "0" * 64)
    assert list(tmp_path.glob("*merged*")) == []  # no folder, and no half-written one beside it
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError):
        merge_adapter(base, tiny_adapters["qv4"], tmp_path / "taken")


def test_the_command_prints_the_folder_digest_a_base_model_declares(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAPLANE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "merged"
    result = CliRunner().invoke(main, ["merge", str(tiny_adapters["ku2"]), "--base", str(tiny_llama), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == folder_digest(out)
    again = CliRunner().invoke(main, ["merge", str(tiny_adapters["ku2"]), "--base", str(tiny_llama), "--out", str(out)])
    assert again.exit_code == 1 and "written once" in again.output
