"""``load_format="dummy"``: a base of a checkpoint's shape with random weights, from a folder that
holds only config.json and a tokenizer (what the GPU benchmarks use for an 8B shape)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from engine_helpers import tiny_engine

from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.weights.checkpoint import CheckpointError


def test_a_dummy_base_serves_without_weight_files(tiny_llama: Path, tmp_path: Path) -> None:
    folder = tmp_path / "shape-only"
    shutil.copytree(tiny_llama, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(CheckpointError, match="no safetensors"):
        tiny_engine(folder, tmp_path / "cache")  # the default still needs the weights
    engine = tiny_engine(folder, tmp_path / "cache", load_format="dummy")
    weights = [p for _, p in engine.model.named_parameters() if p.dim() == 2]
    assert all(0.015 < float(p.std()) < 0.025 for p in weights)  # N(0, 0.02), not zeros
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
