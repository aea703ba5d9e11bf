"""values.schema.json: a wrong value fails `helm install` with a message naming the key, and the
values table in charts/README.md documents exactly the chart's values."""

from __future__ import annotations

import re
from typing import Any

import helm_python as helm
import pytest
import yaml
from crd_schema import ROOT

CHART = ROOT / "charts" / "loraplane"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"operator": {"replicas": "one"}}, "at '/operator/replicas': got string, want integer"),
        ({"crds": {"enabeld": True}}, "at '/crds': additional properties 'enabeld' not allowed"),
        ({"operator": {"image": {"pullPolicy": "Sometimes"}}}, "at '/operator/image/pullPolicy': value must be one of"),
        ({"operator": {"watchNamespaces": "team-a"}}, "at '/operator/watchNamespaces': got string, want array"),
        ({"operator": {"podDisruptionBudget": {"enabled": "auto"}}}, "enabled': got string, want null or boolean"),
        ({"baseModel": {"name": "My_Model"}}, "at '/baseModel/name': 'My_Model' does not match pattern"),
        ({"baseModel": {"spec": {"source": None}}}, "at '/baseModel/spec': missing property 'source'"),
        ({"objectStore": {"buckets": ["Adapters"]}}, "at '/objectStore/buckets/0': 'Adapters' does not match pattern"),
        ({"monitoring": {"serviceMonitor": {"interval": "30 seconds"}}}, "at '/monitoring/serviceMonitor/interval'"),
        ({"monitoring": {"prometheusRule": {"tenantSaturation": {"share": 1.5}}}}, "share': maximum: got 1.5, want 1"),
    ],
)
def test_a_wrong_value_fails_the_render_with_the_schemas_message(chart: helm.Chart, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=re.escape(message)):
        chart.render(values, name="loraplane")


def test_the_defaults_and_every_ci_file_satisfy_the_schema(chart: helm.Chart) -> None:
    chart.validate_schema(chart.values)
    for path in (CHART / "ci").glob("*.yaml"):
        chart.validate_schema(chart.merge_values(yaml.safe_load(path.read_text())))


def documented() -> set[str]:
    rows = [line.split("|")[1] for line in (ROOT / "charts" / "README.md").read_text().splitlines() if line.startswith("| `")]
    return {key for cell in rows for key in re.findall(r"`([A-Za-z0-9_.]+)`", cell)}


def leaves(values: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for key, value in values.items():
        path = f"{prefix}{key}"
        out |= leaves(value, f"{path}.") if isinstance(value, dict) and value else {path}
    return out


def test_the_readme_table_documents_every_value(chart: helm.Chart) -> None:
    rows = documented()
    # A row may stand for a whole subtree (`operator.resources`, `baseModel.spec`).
    undocumented = {leaf for leaf in leaves(chart.values) if not any(leaf == r or leaf.startswith(f"{r}.") for r in rows)}
    assert undocumented == set()
    stale = {r for r in rows if not any(leaf == r or leaf.startswith(f"{r}.") for leaf in leaves(chart.values))}
    assert stale == set()
