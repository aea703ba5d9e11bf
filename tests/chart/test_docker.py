"""The images the chart and the operator run, read as text (`make cluster-test` builds and runs
them; these checks answer in a second): the subcommands they are given exist, the users are
numeric, the operator image has no torch, and the serving image has what `loraplane router`
imports."""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any

import click
import pytest
from crd_schema import ROOT

from loraplane.cli import main
from loraplane.operator.api import BaseModelSpec
from loraplane.operator.children.base_model import children

DOCKER = ROOT / "docker"


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    lines = [line for line in (DOCKER / name).read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in joined.splitlines() if line.strip()]


def last(name: str, instruction: str) -> Any:
    value = [args for ins, args in instructions(name) if ins == instruction][-1]
    return json.loads(value) if value.startswith("[") else value


def installs(name: str) -> str:
    return " ".join(args for ins, args in instructions(name) if ins == "RUN" and "pip install" in args)


@pytest.mark.parametrize(("name", "command"), [("operator.Dockerfile", "operator"), ("serving.Dockerfile", "serve")])
def test_the_image_runs_loraplane_with_the_subcommand_as_its_argument(name: str, command: str) -> None:
    assert last(name, "ENTRYPOINT") == ["loraplane"]
    assert last(name, "CMD")[0] == command
    user = last(name, "USER")
    assert user.isdigit() and int(user) > 0  # runAsNonRoot can only check a numeric user


def test_every_pod_passes_a_subcommand_the_image_has(render: Any) -> None:
    operator = render().one("Deployment", "loraplane-operator")["spec"]["template"]["spec"]["containers"][0]
    base = BaseModelSpec.model_validate({"source": {"uri": "embedded"}})
    owned = [m for m in children("smollm2", "lp", base) if m["kind"] == "Deployment"]
    firsts = {operator["args"][0]} | {m["spec"]["template"]["spec"]["containers"][0]["args"][0] for m in owned}
    assert firsts == {"operator", "serve", "router"}
    assert firsts <= set(main.list_commands(click.Context(main)))


def installed_parts(name: str) -> dict[str, set[str]]:
    """The part folders a Dockerfile's pip install names (``./cli[operator]`` -> ``cli`` with the
    extra ``operator``)."""
    parts: dict[str, set[str]] = {}
    for arg in installs(name).split():
        match = re.fullmatch(r'"?\./(\w+)(?:\[([\w,]+)\])?"?', arg)
        if match:
            parts[match[1]] = set(match[2].split(",")) if match[2] else set()
    return parts


def closure(root: str, extras: set[str]) -> tuple[set[str], list[str]]:
    """Every part folder ``root`` with ``extras`` needs, following the ``loraplane-*`` requirements
    of each part's pyproject.toml, and every requirement from an index on the way."""
    seen: set[tuple[str, str]] = set()
    parts: set[str] = set()
    external: list[str] = []
    todo = [(root, extra) for extra in {"", *extras}]
    while todo:
        part, extra = todo.pop()
        if (part, extra) in seen:
            continue
        seen.add((part, extra))
        parts.add(part)
        project = tomllib.loads((ROOT / part / "pyproject.toml").read_text())["project"]
        for requirement in project.get("optional-dependencies", {})[extra] if extra else project["dependencies"]:
            match = re.match(r"loraplane(?:-([\w-]+))?(?:\[([\w,]+)\])?", requirement)
            if not match:
                external.append(requirement)
                continue
            folder = (match[1] or "cli").replace("-", "_")
            todo += [(folder, e) for e in {"", *(match[2].split(",") if match[2] else [])}]
    return parts, external


def test_the_operator_image_is_slim_python_without_torch() -> None:
    assert last("operator.Dockerfile", "FROM") == "${PYTHON_IMAGE}"
    assert "PYTHON_IMAGE=python:3.11-slim" in [args for ins, args in instructions("operator.Dockerfile") if ins == "ARG"]
    named = installed_parts("operator.Dockerfile")
    assert named["cli"] == {"operator"}
    parts, external = closure("cli", {"operator"})
    assert parts == set(named), "the image installs exactly the parts its command needs, each from its folder"
    assert "serving" not in parts and "kernels" not in parts
    assert not [r for r in external if re.match(r"(torch|triton)\b", r)]
    assert "torch" not in installs("operator.Dockerfile")


def test_the_serving_image_has_cuda_torch_the_parts_and_the_routers_client() -> None:
    assert last("serving.Dockerfile", "FROM") == "${CUDA_IMAGE}"
    assert any(args.startswith("CUDA_IMAGE=nvidia/cuda:") for ins, args in instructions("serving.Dockerfile") if ins == "ARG")
    pip = installs("serving.Dockerfile")
    named = installed_parts("serving.Dockerfile")
    assert named["cli"] == {"serving"}
    parts, external = closure("cli", {"serving"})
    assert parts == set(named) and "operator" not in parts
    pinned = next(r for r in external if r.startswith("torch"))
    assert f'--index-url "${{TORCH_INDEX}}" {pinned}' in pip  # the CUDA build of the pinned version
    # serving's router/discovery.py imports kubernetes for --service: a dependency must bring it.
    assert (
        "from kubernetes import" in (ROOT / "serving" / "src" / "loraplane" / "serving" / "router" / "discovery.py").read_text()
    )
    assert any(r.startswith("kubernetes") for r in external)


def test_the_images_are_the_ones_the_chart_pulls(chart: Any) -> None:
    readme = (DOCKER / "README.md").read_text()
    for component in ("operator", "serving"):
        repository = chart.values[component]["image"]["repository"]
        assert f"-f docker/{component}.Dockerfile -t {repository}:" in readme


@pytest.mark.parametrize("name", ["operator.Dockerfile", "serving.Dockerfile"])
def test_the_build_context_has_every_part_the_image_installs(name: str) -> None:
    kept = {line[1:] for line in (DOCKER / f"{name}.dockerignore").read_text().splitlines() if line.startswith("!")}
    assert kept == set(installed_parts(name))
