"""docs/crd-reference.md: rendered from the models, checked in without drift, complete (every field of
both kinds, walked from the pydantic models themselves rather than from the schema the renderer
reads), and kept fresh by `loraplane crds --check`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest
from click.testing import CliRunner
from crd_schema import ROOT
from pydantic import BaseModel

from loraplane.cli import main
from loraplane.operator.schema.chart_values import write_values_schema
from loraplane.operator.schema.crd_docs import NOTES, doc_drifted, fields, render, schema_of
from loraplane.operator.schema.crdgen import KINDS, write_crds

DOC = ROOT / "docs" / "crd-reference.md"


def _models_in(annotation: Any) -> Iterator[tuple[type[BaseModel], bool]]:
    """The pydantic models an annotation holds, each with whether it sits inside a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, False
        return
    origin = get_origin(annotation)
    for arg in get_args(annotation):  # Optional[X], list[X], dict[str, X]; Literal's args are no models
        for model, in_list in _models_in(arg):
            yield model, in_list or origin is list


def model_paths(model: type[BaseModel], prefix: str) -> Iterator[str]:
    for name, info in model.model_fields.items():
        path = f"{prefix}.{info.alias or name}"
        yield path
        for child, in_list in _models_in(info.annotation):
            yield from model_paths(child, f"{path}[]" if in_list else path)


def test_the_checked_in_reference_matches_the_models() -> None:
    assert DOC.read_text() == render(), "run `loraplane crds` and commit docs/crd-reference.md"
    assert not doc_drifted(DOC)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_every_field_of_both_models_is_in_the_reference(kind: Any) -> None:
    text = DOC.read_text()
    section = text[text.index(f"## {kind.kind}\n") :]
    paths = [*model_paths(kind.spec, "spec"), *model_paths(kind.status, "status")]
    assert len(paths) > 20
    missing = [p for p in paths if f"| `{p}` |" not in section]
    assert missing == []


def test_maxloras_row_says_type_default_bounds_and_description() -> None:
    row = next(line for line in DOC.read_text().splitlines() if line.startswith("| `spec.engine.maxLoras` |"))
    assert row == "| `spec.engine.maxLoras` | integer | `8` | ≥ 1; ≤ 4096 | adapters resident at once (device slots) |"


def test_printer_columns_and_cel_rules_are_in_the_reference() -> None:
    text = DOC.read_text()
    for kind in KINDS:
        for column in kind.columns:
            assert f"| {column['name']} | {column['type']} | `{column['jsonPath']}` |" in text
        for rules in kind.rules.values():
            for rule in rules:
                assert rule["rule"].replace("|", "\\|") in text and rule["message"] in text


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_notes_name_real_fields_the_models_leave_undescribed(kind: Any) -> None:
    schema = schema_of(kind)
    nodes = {path: node for part in ("spec", "status") for path, node, _ in fields(schema["properties"][part], part)}
    for path in NOTES[kind.kind]:
        assert path in nodes, f"{path}: no such field"
        assert "description" not in nodes[path], f"{path}: the model describes it now; drop the note"


def test_crds_check_fails_on_a_stale_reference_and_writing_fixes_it(tmp_path: Path) -> None:
    folder, doc, values = tmp_path / "crds", tmp_path / "docs" / "crd-reference.md", tmp_path / "values.schema.json"
    write_crds(folder)
    write_values_schema(values)
    doc.parent.mkdir()
    doc.write_text(render().replace("adapters resident at once (device slots)", "something else"))
    runner = CliRunner()
    args = ["crds", "--out", str(folder), "--doc", str(doc), "--values-schema", str(values)]
    stale = runner.invoke(main, [*args, "--check"])
    assert stale.exit_code != 0 and str(doc) in stale.output and "loraplane crds" in stale.output
    assert runner.invoke(main, args).exit_code == 0
    assert doc.read_text() == render()
    fresh = runner.invoke(main, [*args, "--check"])
    assert fresh.exit_code == 0, fresh.output


def test_crds_check_still_names_drifted_crds(tmp_path: Path) -> None:
    folder, doc, values = tmp_path / "crds", tmp_path / "crd-reference.md", tmp_path / "values.schema.json"
    write_crds(folder)
    write_values_schema(values)
    doc.write_text(render())
    (folder / "basemodels.loraplane.dev.yaml").write_text("# edited\n")
    args = ["crds", "--out", str(folder), "--doc", str(doc), "--values-schema", str(values), "--check"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and "basemodels.loraplane.dev" in result.output and str(doc) not in result.output
