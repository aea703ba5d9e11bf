"""The engine's sizing knobs, defined once: the engine's config, the CRD and `loraplane serve`'s
flags take the same bounds and the same rule across them, and the batch limits the operator does
not set are the engine's device defaults."""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner
from pydantic import ValidationError

from loraplane.admin_api.engine_sizing import BATCH_DEFAULTS
from loraplane.cli import main
from loraplane.operator.api.basemodel import BaseModelSpec
from loraplane.operator.children.base_model import engine_config
from loraplane.serving.config import EngineConfig

SPEC = {"source": {"uri": "embedded"}}


def test_each_side_refuses_fewer_host_slots_than_device_slots_in_its_own_spelling() -> None:
    with pytest.raises(ValidationError, match="max_cpu_loras must be at least max_loras"):
        EngineConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValidationError, match="maxCpuLoras must be at least maxLoras"):
        BaseModelSpec.model_validate({**SPEC, "engine": {"maxLoras": 4, "maxCpuLoras": 2}})


def test_bounds_are_the_same_on_both_sides() -> None:
    with pytest.raises(ValidationError, match="max_lora_rank"):
        EngineConfig(max_lora_rank=513)
    with pytest.raises(ValidationError, match="maxLoraRank"):
        BaseModelSpec.model_validate({**SPEC, "engine": {"maxLoraRank": 513}})


def test_unset_batch_limits_are_left_to_the_engine_and_set_ones_are_passed_on() -> None:
    unset = engine_config(BaseModelSpec.model_validate(SPEC))
    assert "max_num_seqs" not in unset and "max_num_batched_tokens" not in unset
    assert EngineConfig.model_validate(unset).batch_limits("cpu") == BATCH_DEFAULTS["cpu"]
    assert EngineConfig.model_validate(unset).batch_limits("cuda") == BATCH_DEFAULTS["cuda"]
    written = engine_config(BaseModelSpec.model_validate({**SPEC, "engine": {"maxNumSeqs": 12}}))
    config = EngineConfig.model_validate(yaml.safe_load(yaml.safe_dump(written)))
    assert config.batch_limits("cpu") == (12, BATCH_DEFAULTS["cpu"][1])


def test_serve_flags_carry_the_models_bounds_and_rule() -> None:
    runner = CliRunner()
    out = runner.invoke(main, ["serve", "--max-lora-rank", "513"])
    assert out.exit_code == 2 and "--max-lora-rank" in out.output and "512" in out.output
    # Refused before any engine is built: the rule is EngineConfig's.
    out = runner.invoke(main, ["serve", "--max-loras", "4", "--max-cpu-loras", "2"])
    assert out.exit_code == 1 and "max_cpu_loras must be at least max_loras" in out.output
    assert "Adapters resident at once (device slots)." in runner.invoke(main, ["serve", "--help"]).output


def test_serve_takes_the_gpu_flags_with_their_bounds() -> None:
    runner = CliRunner()
    out = runner.invoke(main, ["serve", "--gpu-memory-utilization", "0"])  # (0, 1]: an empty GPU budget is refused
    assert out.exit_code == 2 and "--gpu-memory-utilization" in out.output
    out = runner.invoke(main, ["serve", "--gpu-memory-utilization", "1.5"])
    assert out.exit_code == 2 and "--gpu-memory-utilization" in out.output
    out = runner.invoke(main, ["serve", "--device", "tpu"])
    assert out.exit_code == 2 and "'auto', 'cuda', 'cpu'" in out.output
    help = runner.invoke(main, ["serve", "--help"]).output
    assert "--enforce-eager" in help and "--device [auto|cuda|cpu]" in help
