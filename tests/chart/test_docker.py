"""The images the chart and the operator run (docker/ cannot be built here): the subcommands they
are given exist, the users are numeric, the operator image has no torch, and the serving image
has what `loraplane router` imports."""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any

import pytest
from crd_schema import ROOT

from loraplane.cli import main
from loraplane.operator.api import BaseModelSpec
from loraplane.operator.children import children

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
    assert firsts <= set(main.commands)


def test_the_operator_image_is_slim_python_without_torch() -> None:
    assert last("operator.Dockerfile", "FROM") == "python:3.11-slim"
    assert '"/src[operator]"' in installs("operator.Dockerfile")
    assert "torch" not in installs("operator.Dockerfile")


def test_the_serving_image_has_cuda_torch_the_extra_and_the_routers_client() -> None:
    assert last("serving.Dockerfile", "FROM") == "${CUDA_IMAGE}"
    assert any(args.startswith("CUDA_IMAGE=nvidia/cuda:") for ins, args in instructions("serving.Dockerfile") if ins == "ARG")
    pip = installs("serving.Dockerfile")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pinned = next(d for d in extras["serving"] if d.startswith("torch"))
    assert f'--index-url "${{TORCH_INDEX}}" {pinned}' in pip  # the CUDA build of the pinned version
    assert '"/src[serving]"' in pip
    # serving/router/discovery.py imports kubernetes for --service: the extra or the image must bring it.
    assert "from kubernetes import" in (ROOT / "serving" / "router" / "discovery.py").read_text()
    assert any(d.startswith("kubernetes") for d in extras["serving"]) or '"kubernetes' in pip


def test_the_images_are_the_ones_the_chart_pulls(chart: Any) -> None:
    readme = (DOCKER / "README.md").read_text()
    for component in ("operator", "serving"):
        repository = chart.values[component]["image"]["repository"]
        assert f"-f docker/{component}.Dockerfile -t {repository}:" in readme


@pytest.mark.parametrize("name", ["operator.Dockerfile", "serving.Dockerfile"])
def test_the_build_context_has_every_part_the_package_links_to(name: str) -> None:
    kept = {line[1:] for line in (DOCKER / f"{name}.dockerignore").read_text().splitlines() if line.startswith("!")}
    parts = {p.resolve().name for p in (ROOT / "loraplane").iterdir() if p.is_symlink()}
    assert parts and parts | {"loraplane", "pyproject.toml", "README.md"} <= kept
