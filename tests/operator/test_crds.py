"""The CRDs: generated from the pydantic models and checked in without drift, valid
apiextensions.k8s.io/v1 objects with structural schemas, and every example manifest valid
against them offline, without an API server (test_apiserver.py asks a real one)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from crd_schema import ROOT, crds, errors, examples
from pydantic import ValidationError

from loraplane.operator.api import BaseModelResource, LoraAdapterResource
from loraplane.operator.schema.crdgen import drifted

MODELS = {"BaseModel": BaseModelResource, "LoraAdapter": LoraAdapterResource}


def test_checked_in_crds_match_the_models() -> None:
    assert drifted(ROOT / "crds") == [], "run `loraplane crds` and commit the result"


@pytest.mark.parametrize("kind", ["BaseModel", "LoraAdapter"])
def test_crds_are_valid_apiextensions_v1_objects(kind: str) -> None:
    kubernetes_validate.validate(crds()[kind], kubernetes_validate.latest_version(), strict=True)


def _walk(node: dict[str, Any], path: str = "") -> list[str]:
    """Structural-schema rules the API server enforces: every node typed, no $ref or anyOf, no
    properties next to additionalProperties."""
    problems = []
    if "type" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        problems.append(f"{path or '<root>'}: no type")
    for banned in ("$ref", "anyOf", "oneOf", "allOf", "definitions", "$defs"):
        if banned in node:
            problems.append(f"{path}: {banned}")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{path}: properties and additionalProperties")
    for name, child in node.get("properties", {}).items():
        problems += _walk(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            problems += _walk(node[key], f"{path}[{key}]")
    return problems


@pytest.mark.parametrize("kind", ["BaseModel", "LoraAdapter"])
def test_schemas_are_structural_and_printer_columns_resolve(kind: str) -> None:
    version = crds()[kind]["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    assert _walk(schema) == []
    assert "status" in version["subresources"]
    for column in version["additionalPrinterColumns"]:
        node = schema
        # A filter over a list (`conditions[?(@.type=="Ready")]`) steps into its items, and the field
        # it filters on must be one of theirs.
        filters = re.findall(r"\[\?\(@\.(\w+)==", column["jsonPath"])
        parts = re.sub(r"\[\?\(@[^]]*\]", "[]", column["jsonPath"]).strip(".").split(".")
        if parts[0] == "metadata":
            continue
        for part in parts:
            node = node["properties"][part.removesuffix("[]")]
            if part.endswith("[]"):
                node = node["items"]
                assert filters.pop(0) in node["properties"]
        assert node["type"] == column["type"] or (column["type"] == "number" and node["type"] in ("number", "integer"))


def test_examples_validate_against_the_schema_and_the_models() -> None:
    docs = examples()
    assert {d["kind"] for d in docs} == {"BaseModel", "LoraAdapter"}
    for doc in docs:
        assert errors(doc) == [], doc["metadata"]["name"]
        MODELS[doc["kind"]].model_validate(doc)


LORA = next(d for d in examples() if d["kind"] == "LoraAdapter")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["spec"]["source"].pop("digest"), "'digest' is a required property"),
        (lambda d: d["spec"]["source"].update(digest="md5:abc"), "does not match"),
        (lambda d: d["spec"]["source"].update(uri="http://example.com/a"), "does not match"),
        (lambda d: d["spec"].update(tenant="Acme Corp"), "does not match"),
        (lambda d: d["spec"].update(rank=0), "less than the minimum of 1"),
        (lambda d: d["spec"].update(rankPolicy="Sometimes"), "is not one of"),
        (lambda d: d["spec"].update(pinned="yes"), "is not of type 'boolean'"),
        (lambda d: d["spec"].update(quotas={"maxConcurrent": -1}), "less than the minimum of 1"),
    ],
)
def test_a_bad_adapter_manifest_fails_with_the_schemas_message(mutate: Any, message: str) -> None:
    bad = copy.deepcopy(LORA)
    mutate(bad)
    found = errors(bad)
    assert any(message in e for e in found), found
    with pytest.raises(ValidationError):
        LoraAdapterResource.model_validate(bad)


def test_a_rule_across_fields_is_in_the_crd_and_the_model() -> None:
    base = next(d for d in examples() if d["kind"] == "BaseModel")
    engine = crds()["BaseModel"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"]
    assert engine["x-kubernetes-validations"][0]["rule"] == "!has(self.maxCpuLoras) || self.maxCpuLoras >= self.maxLoras"
    bad = copy.deepcopy(base)
    bad["spec"]["engine"].update(maxLoras=32, maxCpuLoras=8)
    with pytest.raises(ValidationError, match="maxCpuLoras must be at least maxLoras"):
        BaseModelResource.model_validate(bad)


def test_crd_files_say_they_are_generated() -> None:
    for path in Path(ROOT / "crds").glob("*.loraplane.dev.yaml"):
        assert path.read_text().startswith("# GENERATED")


def test_the_operator_role_is_valid_and_grants_no_spec_writes_or_secret_listing() -> None:
    role = yaml.safe_load((ROOT / "crds" / "rbac.yaml").read_text())
    kubernetes_validate.validate(role, kubernetes_validate.latest_version(), strict=True)
    grants = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert "update" not in grants[("loraplane.dev", "loraadapters")] and "delete" not in grants[("loraplane.dev", "loraadapters")]
    assert grants[("", "secrets")] == {"get", "create"}  # by name, never listed; created once, never updated
    assert not any("*" in verbs for verbs in grants.values())
