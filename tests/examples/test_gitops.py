"""examples/gitops: every kustomization names files that exist and uses standard fields only; each
overlay, built the way `kustomize build` would (no kustomize binary here: `build` below applies the
few fields these kustomizations use), gives valid objects the admission webhook would admit; staging
runs tomorrow's versions while production runs today's; docs/gitops.md names paths that exist."""

from __future__ import annotations

import copy
import datetime as dt
import re
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml
from crd_schema import ROOT, errors

from loraplane.operator.api import BaseModelResource, LoraAdapterResource
from loraplane.operator.children.base_model import children
from loraplane.operator.runtime.admission import review_adapter

GITOPS = ROOT / "examples" / "gitops"
OVERLAYS = ["staging", "production"]
FIELDS = {"apiVersion", "kind", "resources", "namespace", "labels", "patches"}
TARGET_FIELDS = {"group", "version", "kind", "name"}


def _load_all(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def build(folder: Path) -> list[dict[str, Any]]:
    """kustomize's result for the fields in FIELDS: resources (files, or folders with their own
    kustomization, built first), then this folder's patches (JSON 6902 only; a target matching
    nothing is an error here, so a misspelt name cannot leave an object unpatched), namespace and
    labels."""
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(k) <= FIELDS, f"{folder}: fields this test does not apply: {set(k) - FIELDS}"
    objects: list[dict[str, Any]] = []
    for ref in k.get("resources", []):
        path = folder / ref
        objects += build(path) if path.is_dir() else _load_all(path)
    for p in k.get("patches", []):
        assert set(p) == {"path", "target"} and set(p["target"]) <= TARGET_FIELDS, p
        ops = yaml.safe_load((folder / p["path"]).read_text())
        # A partial LoraAdapter as a strategic merge patch would be read by crd_schema.examples()
        # as a whole (invalid) object; a JSON patch is a list, which it skips.
        assert isinstance(ops, list), f"{p['path']}: write patches as JSON 6902 operations"
        hits = [i for i, o in enumerate(objects) if _selected(o, p["target"])]
        assert hits, f"{folder}: {p['path']} matches no object"
        for i in hits:
            objects[i] = jsonpatch.apply_patch(objects[i], ops)
    for obj in objects:
        if "namespace" in k:
            obj["metadata"]["namespace"] = k["namespace"]
        for label in k.get("labels", []):
            obj["metadata"].setdefault("labels", {}).update(label["pairs"])
    return copy.deepcopy(objects)


def _selected(obj: dict[str, Any], target: dict[str, str]) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    wanted = {"group": group, "version": version, "kind": obj["kind"], "name": obj["metadata"]["name"]}
    return all(re.fullmatch(pattern, wanted[field]) for field, pattern in target.items())  # kustomize: anchored regexes


def built(overlay: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in build(GITOPS / "overlays" / overlay)}


def source_date(adapter: dict[str, Any]) -> dt.date:
    match = re.search(r"/(\d{4}-\d{2}-\d{2})/?$", adapter["spec"]["source"]["uri"])
    assert match is not None, adapter["spec"]["source"]["uri"]
    return dt.date.fromisoformat(match.group(1))


def test_every_kustomization_under_examples_names_files_that_exist() -> None:
    kustomizations = sorted((ROOT / "examples").rglob("kustomization.yaml"))
    assert len(kustomizations) == 3
    for path in kustomizations:
        k = yaml.safe_load(path.read_text())
        assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
        for ref in [*k.get("resources", []), *(p["path"] for p in k.get("patches", []))]:
            target = path.parent / ref
            assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{path}: {ref}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_overlay_builds_valid_objects_that_the_webhook_admits(overlay: str) -> None:
    objects = built(overlay)
    assert sorted(objects) == [
        ("BaseModel", "smollm2"),
        ("LoraAdapter", "bullets"),
        ("LoraAdapter", "pirate"),
        ("LoraAdapter", "shouty"),
    ]
    namespace = {"staging": "loraplane-staging", "production": "loraplane-prod"}[overlay]
    for obj in objects.values():
        assert errors(obj) == [], obj["metadata"]["name"]
        assert obj["metadata"]["namespace"] == namespace and obj["metadata"]["labels"]["environment"] == overlay
    base = BaseModelResource.model_validate(objects["BaseModel", "smollm2"])
    for (kind, name), obj in objects.items():
        if kind == "LoraAdapter":
            LoraAdapterResource.model_validate(obj)
            assert review_adapter(obj["spec"], base.spec.body()) == [], name
    assert children("smollm2", namespace, base.spec)


def test_production_is_sized_up_from_staging() -> None:
    staging, production = (built(o)["BaseModel", "smollm2"]["spec"] for o in OVERLAYS)
    assert production["replicas"] > staging["replicas"] >= 1
    assert production["engine"]["maxLoras"] > staging["engine"]["maxLoras"]
    assert production["routing"]["replicas"] > staging["routing"]["replicas"]


def test_staging_runs_tomorrows_versions_and_production_todays() -> None:
    staging, production = (built(o) for o in OVERLAYS)
    base = {(o["kind"], o["metadata"]["name"]): o for o in build(GITOPS / "base")}
    ahead = 0
    for key, prod in production.items():
        if key[0] != "LoraAdapter":
            continue
        stage = staging[key]
        assert prod["spec"]["source"] == base[key]["spec"]["source"]  # production serves the base's versions
        assert source_date(stage) >= source_date(prod), key
        ahead += source_date(stage) > source_date(prod)
        # A new folder without a new digest (or the reverse) is refused with DigestMismatch.
        same_uri = stage["spec"]["source"]["uri"] == prod["spec"]["source"]["uri"]
        assert same_uri == (stage["spec"]["source"]["digest"] == prod["spec"]["source"]["digest"]), key
        assert f"/{stage['spec']['tenant']}/{key[1]}/" in stage["spec"]["source"]["uri"]
        # Versions differ, nothing else does: staging tries the same adapter production will get.
        assert {k: v for k, v in stage["spec"].items() if k != "source"} == {
            k: v for k, v in prod["spec"].items() if k != "source"
        }
    assert ahead >= 1


def test_version_patches_replace_the_source_and_nothing_else() -> None:
    for path in sorted((GITOPS / "overlays" / "staging" / "versions").glob("*.yaml")):
        [op] = yaml.safe_load(path.read_text())
        assert op["op"] == "replace" and op["path"] == "/spec/source" and set(op["value"]) == {"uri", "digest"}, path


def test_the_paths_docs_gitops_names_exist() -> None:
    text = (ROOT / "docs" / "gitops.md").read_text()
    paths = {p.removeprefix("../") for p in re.findall(r"(?:[\w.-]+/)*examples/[\w./-]*[\w/]", text)}
    assert "examples/gitops/overlays/staging/versions/pirate.yaml" in paths
    for p in paths:
        assert (ROOT / p).exists(), p
