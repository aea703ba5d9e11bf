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


def test_a_base_with_a_tenant_policy_admits_only_its_tenants_from_their_sources() -> None:
    base = {**copy.deepcopy(BASE), "tenancy": {**BASE.get("tenancy", {}), "tenants": [
        {"name": LORA["tenant"], "sources": [LORA["source"]["uri"].rsplit("/", 1)[0] + "/"]},
        {"name": "globex", "sources": ["s3://adapters/globex/"]},
    ]}}  # fmt: skip
    assert review_adapter(LORA, base) == []
    stranger = review_adapter({**LORA, "tenant": "initech"}, base)
    assert any("'initech' is not one of" in p for p in stranger), stranger
    # A namespace user naming globex cannot serve files from outside globex's prefix.
    borrowed = review_adapter({**LORA, "tenant": "globex"}, base)
    assert any("must be under s3://adapters/globex/" in p for p in borrowed), borrowed


def test_a_served_name_another_adapter_holds_is_refused() -> None:
    taken = review_adapter({**LORA, "servedName": "support"}, BASE, name="support-v2", served_by="support-v1")
    assert any("'support' is already served by LoraAdapter 'support-v1'" in p for p in taken), taken
    assert review_adapter({**LORA, "servedName": "support"}, BASE, name="support-v1", served_by="support-v1") == []
