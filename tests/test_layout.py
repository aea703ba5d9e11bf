"""The repository's layout as tools read it: every part an ordinary package folder that an import
graph resolves from the checkout (no links, no import hooks), and nothing at the root that a
``python`` started there would import in place of the standard library or an installed package."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PARTS = sorted(p.parent.name for p in ROOT.glob("*/pyproject.toml"))


def _sources() -> dict[str, Path]:
    """Every module of every part by its dotted name, read off the folders."""
    found = {}
    for part in PARTS:
        src = ROOT / part / "src"
        for path in src.rglob("*.py"):
            parts = path.relative_to(src).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def test_each_part_is_a_distribution_in_the_namespace() -> None:
    assert {"kernels", "serving", "operator", "cli", "adapter_format", "usage"} <= set(PARTS)
    for part in PARTS:
        project = tomllib.loads((ROOT / part / "pyproject.toml").read_text())["project"]
        assert project["name"] == ("loraplane" if part == "cli" else f"loraplane-{part.replace('_', '-')}")
        assert (ROOT / part / "src" / "loraplane" / part / "__init__.py").is_file()
        # PEP 420: the namespace itself has no __init__.py in any part.
        assert not (ROOT / part / "src" / "loraplane" / "__init__.py").exists()


def test_no_links_in_the_tree() -> None:
    staged = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    links = [line.split("\t")[1] for line in staged.splitlines() if line.startswith("120000")]
    assert links == []


def test_an_import_graph_of_the_checkout_sees_every_import_of_ours() -> None:
    """grimp (import-linter's graph) built from the parts' folders has every module a file holds,
    and an edge for every ``loraplane.*`` import a file makes (to the module, or the package a
    name is imported from)."""
    sources = _sources()
    graph = grimp.build_graph(*(f"loraplane.{p}" for p in PARTS), cache_dir=None)
    assert set(graph.modules) == set(sources)
    missing = []
    for module, path in sources.items():
        edges = graph.find_modules_directly_imported_by(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("loraplane.") and node.level == 0:
                targets = {f"{node.module}.{a.name}" for a in node.names} | {node.module}
            elif isinstance(node, ast.Import):
                targets = {a.name for a in node.names if a.name.startswith("loraplane.")}
            else:
                continue
            if targets and not targets & (edges | {module}):
                missing.append(f"{module} -> {sorted(targets)}")
    assert missing == []


def test_nothing_at_the_root_shadows_the_standard_library() -> None:
    """``python -c`` puts its working folder first on ``sys.path``; from the root, ``operator`` is
    still the standard library's, and no part's folder is a package of its own name (at most an
    empty PEP 420 namespace, which any installed package of that name takes precedence over)."""
    probe = (
        "import importlib.util, json, operator, sys; "
        f"print(json.dumps([operator.__file__, [n for n in {PARTS!r} "
        "if (s := importlib.util.find_spec(n)) is not None and (s.origin or '').startswith(sys.argv[1] + '/' + n)]]))"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(ROOT)], cwd=ROOT, capture_output=True, text=True, check=True)
    operator_file, ours = json.loads(out.stdout)
    assert not Path(operator_file).is_relative_to(ROOT)
    assert ours == [], "a part's folder imports as a package from the root"
