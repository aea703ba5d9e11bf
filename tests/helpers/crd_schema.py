"""Validate manifests against a CRD's openAPIV3Schema offline, without an API server (the tests that
start one, through envtest.py, ask it instead): OpenAPI 3.0's ``nullable`` becomes a null type for
jsonschema's draft-4 validator, whose boolean ``exclusiveMinimum`` matches OpenAPI 3.0's. CEL rules
are not evaluated here; the pydantic models carry the same rules and the tests check both."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]


def crds() -> dict[str, dict[str, Any]]:
    """Kind -> CRD, read from the checked-in files."""
    out = {}
    for path in sorted((ROOT / "crds").glob("*.loraplane.dev.yaml")):
        crd = yaml.safe_load(path.read_text())
        out[crd["spec"]["names"]["kind"]] = crd
    return out


def _jsonschema(node: Any) -> Any:
    if isinstance(node, list):
        return [_jsonschema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _jsonschema(v) for k, v in node.items() if k != "nullable"}
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


@functools.cache
def validator(kind: str) -> jsonschema.Draft4Validator:
    schema = crds()[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return jsonschema.Draft4Validator(_jsonschema(schema))


def errors(manifest: dict[str, Any]) -> list[str]:
    """Schema violations of ``manifest`` (empty when valid), each with its path."""
    found = validator(manifest["kind"]).iter_errors(manifest)
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in found]


def examples() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((ROOT / "examples").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("apiVersion", "").startswith("loraplane.dev/"):
                docs.append(doc)
    return docs
