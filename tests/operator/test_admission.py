"""The checks `kubectl apply` hears back from the validating webhook, before anything is fetched."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from crd_schema import examples

from loraplane.operator.runtime.admission import ClusterPolicy, review_adapter, review_base, sets_spec

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
        ({"servedName": "Support Bot"}, BASE, "spec.servedName"),
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


@pytest.mark.parametrize("uri", ["s3://adapters/acme/../globex/v1", "s3://adapters/acme/./v1", "file:///srv/acme/.."])
def test_a_source_with_dot_segments_is_refused_whatever_the_policy(uri: str) -> None:
    problems = review_adapter({**LORA, "source": {**LORA["source"], "uri": uri}}, BASE)
    assert any("may not contain . or .. path segments" in p for p in problems), problems


def test_a_source_prefix_holds_at_a_path_boundary() -> None:
    """A policy written without its trailing slash still keeps acme out of acme-evil's files."""
    base = {**copy.deepcopy(BASE), "tenancy": {"tenants": [{"name": "acme", "sources": ["s3://adapters/acme"]}]}}
    source = LORA["source"]
    assert review_adapter({**LORA, "tenant": "acme", "source": {**source, "uri": "s3://adapters/acme/v1"}}, base) == []
    evil = review_adapter({**LORA, "tenant": "acme", "source": {**source, "uri": "s3://adapters/acme-evil/v1"}}, base)
    assert any("must be under s3://adapters/acme" in p for p in evil), evil


def test_the_operators_allow_lists_hold_in_every_namespace_whatever_the_base_says() -> None:
    uri = LORA["source"]["uri"]
    bucket = uri.split("/", 3)[:3]
    assert review_adapter(LORA, BASE, policy=ClusterPolicy(allowed_sources=["/".join(bucket) + "/"])) == []
    outside = review_adapter(LORA, BASE, policy=ClusterPolicy(allowed_sources=["s3://other-bucket/"]))
    assert any("not under a source prefix this cluster's operator allows" in p for p in outside), outside
    internal = {**copy.deepcopy(BASE), "adapterStore": {**BASE.get("adapterStore", {}), "endpoint": "http://10.0.0.1:80"}}
    refused = review_adapter(LORA, internal, policy=ClusterPolicy(allowed_endpoints=["https://s3.internal.example:9000"]))
    assert any("is not an endpoint this cluster allows" in p for p in refused), refused
    allowed = {**internal, "adapterStore": {**internal["adapterStore"], "endpoint": "https://s3.internal.example:9000/"}}
    assert review_adapter(LORA, allowed, policy=ClusterPolicy(allowed_endpoints=["https://s3.internal.example:9000"])) == []
    aws = {**internal, "adapterStore": {k: v for k, v in internal["adapterStore"].items() if k != "endpoint"}}
    assert review_adapter(LORA, aws, policy=ClusterPolicy(allowed_endpoints=["https://s3.internal.example:9000"])) == []


def test_with_tenants_bound_to_namespaces_an_adapter_serves_its_namespaces_tenant_only() -> None:
    tenant = LORA["tenant"]
    assert review_adapter(LORA, BASE, policy=ClusterPolicy(namespace_tenant=tenant)) == []
    other = review_adapter(LORA, BASE, policy=ClusterPolicy(namespace_tenant="team-b"))
    assert any("adapters in namespace 'team-b' serve tenant 'team-b'" in p for p in other), other
    # A BaseModel that lists its tenants decides for itself.
    listed = {**copy.deepcopy(BASE), "tenancy": {"tenants": [{"name": tenant, "sources": [LORA["source"]["uri"]]}]}}
    assert review_adapter(LORA, listed, policy=ClusterPolicy(namespace_tenant="team-b")) == []


def test_a_served_name_another_adapter_holds_is_refused() -> None:
    taken = review_adapter({**LORA, "servedName": "support"}, BASE, name="support-v2", served_by="support-v1")
    assert any("'support' is already served by LoraAdapter 'support-v1'" in p for p in taken), taken
    assert review_adapter({**LORA, "servedName": "support"}, BASE, name="support-v1", served_by="support-v1") == []


@pytest.mark.parametrize(
    ("operation", "old", "new", "meta", "reviewed"),
    [
        ("CREATE", None, {"baseModel": "b"}, {}, True),
        ("UPDATE", {"spec": {"baseModel": "b"}}, {"baseModel": "c"}, {}, True),  # a new spec: reviewed
        ("UPDATE", {"spec": {"baseModel": "b"}}, {"baseModel": "b"}, {"labels": {"team": "x"}}, False),
        ("UPDATE", {"spec": {"baseModel": "b"}}, {"baseModel": "b"}, {"finalizers": []}, False),  # the finalizer goes
        ("UPDATE", {"spec": {"baseModel": "b"}}, {"baseModel": "c"}, {"deletionTimestamp": "2026-12-06T00:00:00Z"}, False),
        ("DELETE", {"spec": {"baseModel": "b"}}, {"baseModel": "b"}, {}, False),
    ],
)  # fmt: skip
def test_only_a_write_that_sets_a_spec_is_reviewed(
    operation: str, old: dict[str, Any] | None, new: dict[str, Any], meta: dict[str, Any], reviewed: bool
) -> None:
    """Whatever now refuses an adapter (its BaseModel gone, a tightened allow-list, its served name
    claimed by another), it can still be labelled and deleted, and its finalizer removed."""
    assert sets_spec(operation, old, new, meta) is reviewed
