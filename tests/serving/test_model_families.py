"""The decoder against transformers for each family it claims: Llama 2 (plain rope), Llama 3
(rope scaling), tied embeddings (SmolLM2-style), Mistral, Qwen2 (attention biases); plus sharded
checkpoints and clear errors for checkpoints that do not fit."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from engine_helpers import engine_greedy, tiny_engine
from peft_reference import hf_greedy
from tiny_models import TINY_SHAPE, save_tokenizer

from loraplane.serving.model.llama_config import ConfigError
from loraplane.serving.weights.checkpoint import CheckpointError

COMMON = dict(**TINY_SHAPE, num_hidden_layers=2, max_position_embeddings=256)


def _save(model: torch.nn.Module, folder: Path, **save_kwargs: object) -> Path:
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
            elif name.endswith("bias"):
                p.uniform_(-0.2, 0.2)
            elif p.dim() == 1:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(str(folder), safe_serialization=True, **save_kwargs)
    save_tokenizer(folder)
    return folder


def _family(kind: str, folder: Path) -> Path:
    import transformers as tf

    if kind == "llama2":
        return _save(tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON)).eval(), folder)
    if kind == "llama3-rope-scaling":
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        return _save(tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON, rope_theta=500000.0, rope_scaling=scaling)).eval(), folder)
    if kind == "tied":
        return _save(tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON, tie_word_embeddings=True)).eval(), folder)
    if kind == "mistral":
        return _save(tf.MistralForCausalLM(tf.MistralConfig(**COMMON, sliding_window=None)).eval(), folder)
    if kind == "qwen2":
        return _save(tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON, tie_word_embeddings=False)).eval(), folder)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["llama2", "llama3-rope-scaling", "tied", "mistral", "qwen2"])
def test_family_matches_transformers(kind: str, tmp_path: Path) -> None:
    folder = _family(kind, tmp_path / kind)
    rng = random.Random(3)
    # Prompts long enough that positions pass the Llama 3 scaling band (wavelengths up to 32).
    requests = [([rng.randrange(3, 320) for _ in range(n)], None) for n in (5, 40, 70)]
    ref_tokens, ref_logits = hf_greedy(folder, {}, requests, 12)
    tokens, logits = engine_greedy(tiny_engine(folder, tmp_path / "cache"), requests, 12, eos_id=2)
    for ours, ref in zip(logits, ref_logits, strict=True):
        assert (ours - ref).abs().max().item() < 1e-4
    assert tokens == ref_tokens


def test_sharded_checkpoint_loads_like_a_single_file(tiny_llama: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    model.save_pretrained(str(tmp_path / "sharded"), safe_serialization=True, max_shard_size="100KB")
    save_tokenizer(tmp_path / "sharded")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    requests = [([5, 6, 7, 8, 9], None)]
    single = engine_greedy(tiny_engine(tiny_llama, tmp_path / "c1"), requests, 6, eos_id=2)
    sharded = engine_greedy(tiny_engine(tmp_path / "sharded", tmp_path / "c2"), requests, 6, eos_id=2)
    assert single[0] == sharded[0]
    assert torch.equal(single[1][0], sharded[1][0])


def test_checkpoint_that_does_not_fit_its_config_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw["intermediate_size"] = 128
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight has shape .* the config needs"):
        tiny_engine(bad, tmp_path / "cache")
    raw["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        tiny_engine(bad, tmp_path / "cache")


def test_pickle_only_checkpoint_is_refused(tmp_path: Path, tiny_llama: Path) -> None:
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_llama / "config.json").read_text())
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickle"):
        tiny_engine(folder, tmp_path / "cache")
