"""The chart's CRDs are the generated ones in crds/, templated so that `helm upgrade` upgrades them,
behind crds.enabled, and kept on uninstall unless crds.keep is off."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from crd_schema import ROOT

CHART = ROOT / "charts" / "loraplane"
# The CRDs and the operator's role, which the chart templates from copies: Helm reads only files
# inside the chart.
SOURCES = sorted((ROOT / "crds").glob("*.yaml"))
GENERATED = sorted((ROOT / "crds").glob("*.loraplane.dev.yaml"))
SYNC = "loraplane crds"


def test_the_chart_carries_a_copy_of_every_file_in_crds() -> None:
    copies = sorted(p.name for p in (CHART / "files" / "crds").glob("*.yaml"))
    assert copies == [p.name for p in SOURCES], f"run `{SYNC}` (and delete copies of removed files)"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_each_copy_is_byte_for_byte_the_file_in_crds(path: Any) -> None:
    copy = CHART / "files" / "crds" / path.name
    assert copy.read_bytes() == path.read_bytes(), f"crds/ changed: run `{SYNC}`"


def test_the_rendered_crds_are_the_generated_ones(render: Any) -> None:
    rendered = {c["metadata"]["name"]: c for c in render().kind("CustomResourceDefinition")}
    generated = [yaml.safe_load(p.read_text()) for p in GENERATED]
    assert sorted(rendered) == sorted(c["metadata"]["name"] for c in generated)
    for crd in generated:
        ours = rendered[crd["metadata"]["name"]]
        assert ours["apiVersion"] == crd["apiVersion"]
        assert ours["spec"] == crd["spec"]
        assert crd["metadata"]["labels"].items() <= ours["metadata"]["labels"].items()


def test_crds_enabled_false_renders_no_crd(render: Any) -> None:
    assert render({"crds": {"enabled": False}}).kind("CustomResourceDefinition") == []


def test_crds_are_kept_on_uninstall_unless_keep_is_off(render: Any) -> None:
    kept = render().kind("CustomResourceDefinition")
    assert kept and all(c["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"} for c in kept)
    released = render({"crds": {"keep": False}}).kind("CustomResourceDefinition")
    assert released and all("annotations" not in c["metadata"] for c in released)


def test_the_chart_ships_no_crds_folder_helm_would_never_upgrade(chart: Any) -> None:
    assert chart.crds == []
