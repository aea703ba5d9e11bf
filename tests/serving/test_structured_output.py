"""Structured output in the engine: documents that validate against their request's schema, in
batches that mix schemas, adapters and plain requests."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from engine_helpers import tiny_engine

from loraplane.serving.config import EngineConfig
from loraplane.serving.engine.builder import build_engine
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.engine.sequence import FinishReason, Sequence
from loraplane.serving.engine.structured import GrammarError, advance

FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
PICK = {
    "type": "object",
    "properties": {"tone": {"enum": ["calm", "loud", "dry"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["tone", "n"],
    "additionalProperties": False,
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def test_each_row_of_a_mixed_batch_follows_its_own_schema(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    engine = tiny_engine(tiny_llama, tmp_path, {"qv4": tiny_adapters["qv4"]})
    flag, pick = engine.grammars.compile(FLAG), engine.grammars.compile(PICK)
    plain = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    alone = engine.generate([[5, 17, 42]], plain)[0]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, guide=g) for i, g in enumerate([flag, pick, pick])]
    outs = engine.generate([[5, 6, 7], [8, 9], [10, 11, 12], [5, 17, 42]], [*params, plain], ["qv4", None, "qv4", None])
    for out, schema in zip(outs[:3], [FLAG, PICK, PICK], strict=True):
        assert out.finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(out.text), schema)
    assert outs[3].token_ids == alone.token_ids  # the plain row is not masked by its neighbours


def test_a_schema_the_library_refuses_is_an_error_before_anything_runs(tiny_llama: Path, tmp_path: Path) -> None:
    engine = tiny_engine(tiny_llama, tmp_path)
    with pytest.raises(GrammarError, match="nope"):
        engine.grammars.compile({"type": "nope"})


@pytest.mark.slow
def test_twenty_prompts_on_the_embedded_base_give_twenty_valid_documents() -> None:
    engine = build_engine(EngineConfig())
    guide = engine.grammars.compile(PERSON)
    people = ["a retired sailor", "a young painter", "a chess champion", "a baker", "a pilot"]
    prompts = [
        engine.tokenizer.chat([{"role": "user", "content": f"Invent {who} number {i} and describe them as JSON."}])
        for i, who in enumerate(people * 4)
    ]
    outs = engine.generate(prompts, SamplingParams(max_tokens=96, temperature=0.7, seed=7, guide=guide))
    for out in outs:
        assert out.finish_reason is FinishReason.STOP, out.text
        jsonschema.validate(json.loads(out.text), PERSON)
    assert len({out.text for out in outs}) > 10


def test_the_device_path_holds_a_row_to_its_grammar(tiny_llama: Path, tmp_path: Path) -> None:
    """The sampler's device path (``_sample_from_device``, run here on CPU tensors as a GPU runs
    it): the grammar's bitmask goes over and is applied there, so every drawn token is one the
    grammar accepts, whatever the logits favour."""
    engine = tiny_engine(tiny_llama, tmp_path)
    guide = engine.grammars.compile(FLAG)
    vocab = engine.base.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    for seed in range(8):
        seq = Sequence(f"r{seed}", [5, 6], SamplingParams(max_tokens=8, temperature=1.5, seed=seed, guide=guide))
        seq.matcher = guide.matcher()  # what the engine's first mask would make: advance() checks against it
        for _ in range(4):  # the first few tokens of a document, each from fresh logits
            logits = torch.randn(1, vocab, generator=generator) * 5
            ((token, _),) = engine.sampler._sample_from_device(logits, [seq])  # type: ignore[misc]
            assert advance(seq, token, engine.eos_ids) is None, engine.tokenizer.decode([*seq.output_token_ids, token])
            seq.output_token_ids.append(token)
