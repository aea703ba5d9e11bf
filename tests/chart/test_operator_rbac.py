"""The operator with exactly the permissions the chart grants it, on a real API server (envtest.py):
the chart's ServiceAccount, ClusterRole and bindings are applied as rendered, the operator runs on
a token of that account, and a BaseModel must get its children. Cluster-wide and with
``operator.watchNamespaces`` (`--namespace`), where the grants hold only in the watched namespace
and a BaseModel elsewhere is left alone."""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from crd_schema import examples
from envtest import Kube, control_plane, token_kubeconfig
from operator_process import start_operator, stop

from loraplane.serving.http.loopback import free_port

pytestmark = pytest.mark.slow
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
MODES = {
    "cluster-wide": ({}, ()),
    "namespaced": ({"operator": {"watchNamespaces": ["team-b"]}}, ("--namespace", "team-b")),
    # kopf then manages its webhook configurations, validating and mutating; without a grant for
    # either it exits after nine tries (the chart's operator restarted every minute on a cluster).
    "webhook": ({"operator": {"webhook": {"enabled": True}}}, ("--webhook-port",)),
}


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    with control_plane(tmp_path_factory.mktemp("apiserver")) as k:
        yield k


def base_model(name: str, namespace: str) -> dict[str, Any]:
    manifest = copy.deepcopy(next(d for d in examples() if d["kind"] == "BaseModel"))
    manifest["metadata"] = {"name": name, "namespace": namespace}
    manifest["spec"]["nodeCache"] = {"enabled": True}  # its DaemonSet needs the chart's grant too
    manifest["spec"]["resources"] = {**manifest["spec"].get("resources", {}), "nodeSelector": {"pool": "serving"}}
    return manifest


@pytest.mark.parametrize("mode", list(MODES))
def test_the_operator_works_with_the_charts_rbac_and_nothing_more(
    kube: Kube, render: Callable[..., list[dict[str, Any]]], mode: str, tmp_path: Path
) -> None:
    values, flags = MODES[mode]
    for namespace in ("lp", "team-a", "team-b"):
        kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    rbac = [d for d in render(values) if d["kind"] in RBAC_KINDS]
    for obj in rbac:
        kube.apply({**obj, "metadata": {"namespace": "lp", **obj["metadata"]}} if obj["kind"] == "ServiceAccount" else obj)
    account = next(d for d in rbac if d["kind"] == "ServiceAccount")["metadata"]["name"]
    access = token_kubeconfig(kube, "lp", account, tmp_path / "operator.kubeconfig")

    def can_i(*args: str) -> str:
        return kube.kubectl("auth", "can-i", *args, "--kubeconfig", str(access), check=False).stdout.strip()

    if mode == "namespaced":  # least privilege, asked of the API server's own authorizer
        assert can_i("list", "pods", "-n", "team-b") == "yes"
        assert can_i("list", "pods", "-n", "team-a") == "no"
        assert can_i("get", "secrets", "-n", "lp") == "no"
        assert can_i("create", "deployments", "-n", "team-a") == "no"
    else:
        assert can_i("list", "pods", "--all-namespaces") == "yes"
    assert can_i("delete", "loraadapters", "-n", "team-b") == "no"

    env = {}
    if "--webhook-port" in flags:  # the API server (envtest's, on loopback) calls it on loopback
        flags, env = (*flags, str(free_port())), {"LORAPLANE_WEBHOOK_HOST": "127.0.0.1"}
    operator = start_operator(access, tmp_path / "operator.log", extra_args=flags, extra_env=env)
    watched, other = f"{mode}-b", f"{mode}-a"
    try:
        kube.apply(base_model(watched, "team-b"))
        kube.apply(base_model(other, "team-a"))
        for kind, suffix in (("Deployment", "-serving"), ("Service", "-serving"), ("RoleBinding", "-router"),
                             ("DaemonSet", "-node-cache")):  # fmt: skip
            found = lambda kind=kind, suffix=suffix: kube.get(kind, "team-b", watched + suffix)  # noqa: E731
            try:
                kube.wait_for(f"{kind} {watched}{suffix}", found, timeout=60)
            except AssertionError:
                raise AssertionError((tmp_path / "operator.log").read_text()[-4000:]) from None
        time.sleep(3)  # several syncs: a namespaced operator must not have touched the other namespace
        if mode == "namespaced":
            untouched = kube.get("BaseModel", "team-a", other)
            assert untouched is not None and "status" not in untouched and not untouched["metadata"].get("finalizers")
            assert kube.get("Deployment", "team-a", f"{other}-serving") is None
        else:
            kube.wait_for("the other namespace's children", lambda: kube.get("Deployment", "team-a", f"{other}-serving"))
        log = (tmp_path / "operator.log").read_text()
        # A refusal as the clients log it ("Forbidden", kopf's {'code': 403}, status=403 or "(403)"),
        # not the digits of a port number or of a timestamp's milliseconds (",403]" failed a run).
        refused = re.compile(r"forbidden|['\"]code['\"]: 403\b|status=403\b|\(403\)", re.IGNORECASE)
        assert not refused.search(log.replace(kube.url, "")), log[-4000:]
    finally:
        stop(operator)
        for obj in rbac:  # the next mode starts from no grants
            kube.delete(obj["kind"], obj["metadata"].get("namespace", "lp"), obj["metadata"]["name"])
