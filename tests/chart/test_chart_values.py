"""values.schema.json is generated from the chart's values model (operator/chart_values.py) and
checked in without drift; values.yaml holds exactly the model's defaults; and baseModel.spec is
checked as the CRD's BaseModelSpec, by Helm and by the model alike, while a partial override of it
still merges over the chart's defaults."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml
from click.testing import CliRunner
from crd_schema import ROOT
from pydantic import ValidationError

from loraplane.cli import main
from loraplane.operator.schema.chart_values import ChartValues, render, values_schema, values_schema_drifted

CHART = ROOT / "charts" / "loraplane"
SCHEMA = CHART / "values.schema.json"


def test_the_checked_in_schema_matches_the_model() -> None:
    assert SCHEMA.read_text(encoding="utf-8") == render(), "run `loraplane crds` and commit charts/loraplane/values.schema.json"
    assert not values_schema_drifted(SCHEMA)


def test_values_yaml_holds_the_models_defaults() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert ChartValues().model_dump(mode="json", by_alias=True) == values
    ChartValues.model_validate(values)  # the default spec is a valid BaseModelSpec as well


def nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from nodes(child, f"{path}/{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from nodes(node[key], f"{path}[{key}]")


def test_the_schema_is_draft_07_and_refuses_unknown_keys_everywhere() -> None:
    schema = values_schema()
    jsonschema.Draft7Validator.check_schema(schema)
    for path, node in nodes(schema):
        assert not {"nullable", "$ref", "$defs", "anyOf", "default"} & set(node), path  # OpenAPI's and pydantic's spellings
        if "properties" in node:
            assert node["additionalProperties"] is False, path


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"resources": {"gpus": "one"}}, "at '/baseModel/spec/resources/gpus': got string, want integer"),
        ({"engine": {"maxLoras": 0}}, "at '/baseModel/spec/engine/maxLoras': minimum: got 0, want 1"),
        ({"replica": 2}, "at '/baseModel/spec': additional properties 'replica' not allowed"),
        ({"source": {"dtype": "int4"}}, "at '/baseModel/spec/source/dtype': value must be one of"),
        ({"resources": {"cpu": 2}}, "at '/baseModel/spec/resources/cpu': got number, want null or string"),
        ({"tenancy": {"tenants": [{"name": "acme"}]}}, "at '/baseModel/spec/tenancy/tenants/0': missing property 'sources'"),
    ],
)
def test_a_spec_the_crd_refuses_fails_the_render_and_the_model(chart: helm.Chart, spec: dict[str, Any], message: str) -> None:
    values = {"baseModel": {"spec": spec}}
    with pytest.raises(helm.HelmValuesError, match=re.escape(message)):
        chart.render(values, name="loraplane")
    with pytest.raises(ValidationError):
        ChartValues.model_validate(chart.merge_values(values))


@pytest.mark.parametrize(
    "spec",
    [{"resources": {"gpus": 1}}, {"source": {"uri": "/models/qwen"}, "replicas": 3}, {"engine": {"maxCpuLoras": None}}],
    ids=["one-field", "source-and-replicas", "unset-an-optional"],
)
def test_a_partial_spec_merges_over_the_defaults_and_passes(chart: helm.Chart, spec: dict[str, Any]) -> None:
    merged = chart.merge_values({"baseModel": {"enabled": True, "spec": spec}})
    chart.validate_schema(merged)
    ChartValues.model_validate(merged)


def test_crds_check_names_a_stale_values_schema_and_writing_fixes_it(tmp_path: Path) -> None:
    schema = tmp_path / "values.schema.json"
    args = ["crds", "--out", str(tmp_path / "crds"), "--doc", str(tmp_path / "crd-reference.md"), "--values-schema", str(schema)]
    runner = CliRunner()
    assert runner.invoke(main, args).exit_code == 0
    schema.write_text(render().replace('"maxLoras"', '"maxLoraz"'))
    stale = runner.invoke(main, [*args, "--check"])
    assert stale.exit_code != 0 and str(schema) in stale.output and "crd-reference" not in stale.output
    assert runner.invoke(main, args).exit_code == 0
    assert schema.read_text(encoding="utf-8") == render()
    fresh = runner.invoke(main, [*args, "--check"])
    assert fresh.exit_code == 0, fresh.output
