"""Render charts/loraplane offline with Helm's own engine (helm-python-sdk: Helm v4's Go SDK as a
shared library), so the tests see exactly what `helm install` would send."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from helm_python import _native

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "loraplane"
NAMESPACE = "lp"
MONITORING = ["monitoring.coreos.com/v1"]
# A cluster that serves kopf's peering kinds (its CRDs registered, by an earlier release or by
# another kopf operator): only there does the chart render the peering object of a peered operator.
KOPF_PEERING = ["kopf.dev/v1", "kopf.dev/v1/ClusterKopfPeering", "kopf.dev/v1/KopfPeering"]


class Rendered(list[dict[str, Any]]):
    """The objects of one render, NOTES.txt left out."""

    def kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [o for o in self.kind(kind) if name is None or o["metadata"]["name"] == name]
        assert len(found) == 1, f"{len(found)} {kind} named {name}: {[o['metadata']['name'] for o in self.kind(kind)]}"
        return found[0]


def value_sets() -> dict[str, tuple[dict[str, Any], list[str]]]:
    """Name -> (values, API versions the cluster offers): the defaults, the value files next to the
    chart (what CI renders), each peered one (operator.replicas >= 2) also on a cluster that serves
    kopf's peering kinds, and the defaults on a cluster with the Prometheus Operator."""
    sets: dict[str, tuple[dict[str, Any], list[str]]] = {"default": ({}, [])}
    for path in sorted((CHART / "ci").glob("*-values.yaml")):
        name, values = path.name.removesuffix("-values.yaml"), yaml.safe_load(path.read_text())
        sets[name] = (values, [])
        if values.get("operator", {}).get("replicas", 1) >= 2:
            sets[f"{name}+kopf-peering"] = (values, KOPF_PEERING)
    sets["prometheus-operator"] = ({}, ["monitoring.coreos.com/v1"])
    return sets


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "value_set" in metafunc.fixturenames:
        sets = value_sets()
        metafunc.parametrize("value_set", list(sets.values()), ids=list(sets))


def render_files(chart: helm.Chart, values: dict[str, Any] | None, api_versions: list[str] | None) -> dict[str, str]:
    """Template path -> rendered text, as `helm template loraplane --namespace lp [--api-versions ...]`."""
    # Chart.render (0.2.2) does not pass api_versions on, though the library reads them: call the
    # library directly so that .Capabilities.APIVersions can say the Prometheus Operator is there.
    opts = {"name": "loraplane", "namespace": NAMESPACE, "is_install": True, "api_versions": api_versions or []}
    rendered = _native.call_string("helm_render", chart._raw(), json.dumps(values or {}), json.dumps(opts))
    out: dict[str, str] = json.loads(rendered)
    return out


@pytest.fixture(scope="session")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def render(chart: helm.Chart) -> Callable[..., Rendered]:
    def objects(values: dict[str, Any] | None = None, api_versions: list[str] | None = None) -> Rendered:
        docs = Rendered()
        for path, text in sorted(render_files(chart, values, api_versions).items()):
            if not path.endswith("NOTES.txt"):
                docs += [d for d in yaml.safe_load_all(text) if d]
        return docs

    return objects


@pytest.fixture(scope="session")
def notes(chart: helm.Chart) -> Callable[..., str]:
    def text(values: dict[str, Any] | None = None, api_versions: list[str] | None = None) -> str:
        return render_files(chart, values, api_versions)["loraplane/templates/NOTES.txt"]

    return text
