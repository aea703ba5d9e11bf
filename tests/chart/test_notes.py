"""NOTES.txt: after `helm install` a person knows the next commands, with this release's names."""

from __future__ import annotations

from typing import Any


def test_a_bare_install_says_how_to_add_a_base_and_adapters_and_reach_them(notes: Any) -> None:
    text = notes()
    assert "kubectl -n lp rollout status deployment/loraplane-operator" in text
    assert "kubectl -n lp apply -f examples/embedded/basemodel.yaml" in text
    assert "kubectl -n lp apply -f examples/embedded/loraadapters.yaml" in text
    assert "kubectl -n lp get loraadapters" in text
    assert "kubectl -n lp port-forward svc/<basemodel>-router 8000:8000" in text
    assert "Secret <name>-admin in the\n  BaseModel's namespace" in text


def test_a_self_contained_install_names_its_base_router_and_store(notes: Any) -> None:
    text = notes({"baseModel": {"enabled": True, "name": "tiny"}, "objectStore": {"enabled": True, "buckets": ["models"]}})
    assert "kubectl -n lp get basemodel tiny -w" in text
    assert "kubectl -n lp port-forward svc/tiny-router 8000:8000" in text
    assert "kubectl -n lp port-forward svc/loraplane-object-store 9000:9000" in text
    assert "local/models/" in text
    assert "examples/embedded/basemodel.yaml" not in text


def test_without_crds_it_says_to_apply_them_first(notes: Any) -> None:
    assert "apply the CRDs yourself first" in notes({"crds": {"enabled": False}})
    assert "apply the CRDs yourself" not in notes()
