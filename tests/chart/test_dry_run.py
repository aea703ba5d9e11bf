"""Every object the chart renders, for every value set CI renders, is accepted by a real API server
(envtest.py) in a server-side dry run: its own schemas for Deployments, RBAC and webhooks, and
ours for the CRDs the chart carries, not a copy of them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from envtest import Kube, control_plane

pytestmark = pytest.mark.slow
# The Prometheus Operator's kinds: this server does not serve them (no Prometheus Operator here).
NOT_SERVED = ("monitoring.coreos.com/",)


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    with control_plane(tmp_path_factory.mktemp("apiserver")) as k:
        yield k


def test_every_rendered_object_passes_server_side_dry_run(
    kube: Kube, render: Callable[..., list[dict[str, Any]]], value_set: tuple[dict[str, Any], list[str]]
) -> None:
    values, api_versions = value_set
    docs = [d for d in render(values, api_versions) if not d["apiVersion"].startswith(NOT_SERVED)]
    by_namespace: dict[str, list[dict[str, Any]]] = {}
    for d in docs:  # what Helm sends without a namespace goes to the release's (the test renders with `lp`)
        by_namespace.setdefault(d["metadata"].get("namespace") or "lp", []).append(d)
    accepted = 0
    for namespace, group in sorted(by_namespace.items()):
        kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        r = kube.kubectl("apply", "--server-side", "--force-conflicts", "--dry-run=server", "-n", namespace, "-f", "-",
                         input=yaml.safe_dump_all(group), check=False)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        accepted += r.stdout.count("(server dry run)")
    assert accepted == len(docs)
