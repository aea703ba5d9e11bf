"""The checks `kubectl apply` hears back from the validating webhook, before anything is fetched."""

from __future__ import annotations

import copy

import pytest
from crd_schema import examples

from loraplane.operator.admission import review_adapter, review_base

BASE = next(d for d in examples() if d["kind"] == "BaseModel")["spec"]
LORA = next(d for d in examples() if d["kind"] == "LoraAdapter")["spec"]


def test_the_examples_are_admitted() -> None:
    assert review_adapter(LORA, BASE) == [] and review_base(BASE) == []


@pytest.mark.parametrize(
    ("change", "base", "message"),
    [
        ({"rank": 32}, BASE, "above smollm2's maxLoraRank 16"),
        ({"source": {"uri": "gs://bucket/a", "digest": LORA["source"]["digest"]}}, BASE, "spec.source.uri"),
        ({"tenant": "Not A Label"}, BASE, "spec.tenant"),
        ({"quotas": {"tokensPerMinute": 0}}, BASE, "spec.quotas.tokensPerMinute"),
        ({"unknownField": 1}, BASE, "spec.unknownField"),
        ({}, None, "BaseModel 'smollm2' does not exist"),
    ],
)
def test_a_bad_adapter_is_refused_with_a_message_naming_the_field(change: dict, base: dict | None, message: str) -> None:
    spec = {**copy.deepcopy(LORA), **change}
    problems = review_adapter(spec, base)
    assert any(message in p for p in problems), problems


def test_truncation_admits_a_rank_over_the_cap() -> None:
    assert review_adapter({**LORA, "rank": 32, "rankPolicy": "Truncate"}, BASE) == []


def test_a_base_model_with_cpu_slots_below_device_slots_is_refused() -> None:
    spec = copy.deepcopy(BASE)
    spec["engine"].update(maxLoras=32, maxCpuLoras=8)
    assert any("maxCpuLoras must be at least maxLoras" in p for p in review_base(spec))
