"""The embedded SmolLM2 GGUF: our conversion against transformers' own GGUF loader, the cache,
the fingerprint, and the FP8 base."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from loraplane.serving.config import EngineConfig, default_cache_dir
from loraplane.serving.engine.builder import build_engine
from loraplane.serving.engine.llm_engine import LLMEngine
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.weights.base import resolve_base
from loraplane.serving.weights.embedded import EMBEDDED_NAME, embedded_gguf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return build_engine(EngineConfig())


def test_conversion_matches_transformers_gguf_loader(engine: LLMEngine) -> None:
    """transformers dequantises and un-permutes q/k itself; every tensor must agree with ours."""
    from transformers import AutoModelForCausalLM

    gguf = embedded_gguf()
    theirs = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).state_dict()
    ours = load_file(str(engine.base.folder / "model.safetensors"))
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: transformers lists the shared head too
    for name, tensor in ours.items():
        assert torch.allclose(tensor, theirs[name], atol=1e-6), name


def test_second_start_reads_the_cache_and_keeps_the_fingerprint(engine: LLMEngine) -> None:
    again = resolve_base("embedded", default_cache_dir())
    assert again.folder == engine.base.folder
    assert again.shape.fingerprint == engine.base.shape.fingerprint
    assert again.shape.fingerprint and again.shape.fingerprint.startswith("sha256:")
    assert engine.base.shape.name == EMBEDDED_NAME
    assert (engine.base.shape.num_layers, engine.base.shape.hidden_size, engine.base.shape.num_kv_heads) == (30, 576, 3)


def test_chat_template_and_answer(engine: LLMEngine) -> None:
    ids = engine.tokenizer.chat([{"role": "user", "content": "What is the capital of France?"}])
    assert engine.tokenizer.hf.decode(ids).startswith("<|im_start|>system")
    out = engine.generate([ids], SamplingParams(max_tokens=20, temperature=0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ends its turn with <|im_end|>


def test_fp8_base_quarters_fp32_and_halves_bf16_weight_memory_and_stays_close(engine: LLMEngine) -> None:
    fp8 = build_engine(EngineConfig(quantization="fp8"))
    dense = sum(p.weight.numel() for _, p in engine.model.linear_layers())
    fp8_bytes = sum(p.weight.nbytes + p.weight_scale.nbytes for _, p in fp8.model.linear_layers())  # type: ignore[union-attr]
    assert all(p.weight.dtype == torch.float8_e4m3fn for _, p in fp8.model.linear_layers())
    assert fp8_bytes <= 0.51 * dense * 2  # bf16 holds 2 bytes a weight; fp8 one, plus one scale per row
    assert all(s.lora_a.dtype == torch.float32 for s in fp8.slots.slots.values())  # adapters stay high precision
    ids = engine.tokenizer.chat([{"role": "user", "content": "What is the capital of France?"}])
    p = SamplingParams(max_tokens=8, temperature=0)
    assert "Paris" in fp8.generate([ids], p)[0].text
