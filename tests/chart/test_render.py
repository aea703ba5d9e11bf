"""Every value set renders, passes `helm lint --strict`, and yields objects the API server accepts."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
from crd_schema import ROOT, errors

CHART = ROOT / "charts" / "loraplane"
# Kinds whose schemas come from CRDs: kubernetes-validate knows only the built-in API. Our own are
# checked against crds/, kopf's peering objects against the peering CRD the same render carries;
# the Prometheus Operator's are not vendored here, so they are checked by the monitoring tests for
# what they must contain, not for their schema.
OURS = {"BaseModel"}
KOPF_PEERING = {"ClusterKopfPeering", "KopfPeering"}
PROMETHEUS_OPERATOR = {"ServiceMonitor", "PrometheusRule"}


def test_every_object_is_valid_for_a_current_kubernetes(render: Any, value_set: tuple[dict[str, Any], list[str]]) -> None:
    values, api_versions = value_set
    objects = render(values, api_versions)
    assert objects.kind("Deployment"), "no Deployment rendered"
    crds = {c["spec"]["names"]["kind"]: c for c in objects.kind("CustomResourceDefinition")}
    for obj in objects:
        if obj["kind"] in OURS:
            assert errors(obj) == [], obj["metadata"]["name"]
        elif obj["kind"] in KOPF_PEERING:
            crd = crds[obj["kind"]]
            assert obj["apiVersion"] == f"{crd['spec']['group']}/{crd['spec']['versions'][0]['name']}"
            assert ("namespace" in obj["metadata"]) == (crd["spec"]["scope"] == "Namespaced")
            jsonschema.Draft4Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]).validate(obj)
        elif obj["kind"] not in PROMETHEUS_OPERATOR:
            kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def test_object_names_are_unique_per_kind(render: Any, value_set: tuple[dict[str, Any], list[str]]) -> None:
    objects = render(*value_set)
    keys = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    assert len(keys) == len(set(keys))


def test_namespaced_objects_go_to_the_release_namespace(render: Any, value_set: tuple[dict[str, Any], list[str]]) -> None:
    """...but for kopf's KopfPeerings and the operator's RoleBindings (its grants with
    ``operator.watchNamespaces``), which go to the namespaces the operator watches."""
    cluster_scoped = {"CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"}
    watched = value_set[0].get("operator", {}).get("watchNamespaces", [])
    for obj in render(*value_set):
        if obj["kind"] in ("KopfPeering", "RoleBinding"):
            assert obj["metadata"]["namespace"] in watched
        else:
            assert (obj["metadata"].get("namespace") == "lp") != (obj["kind"] in cluster_scoped), obj["metadata"]["name"]


def test_lint_is_clean_with_every_value_set(value_set: tuple[dict[str, Any], list[str]]) -> None:
    report = helm.lint(CHART, value_set[0], strict=True, namespace="lp")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 1 is info ("icon is recommended")
    assert problems == [] and report["errors"] == []


def test_images_default_to_the_chart_app_version(chart: helm.Chart, render: Any) -> None:
    version = chart.metadata["appVersion"]
    objects = render({"baseModel": {"enabled": True}})
    operator = objects.one("Deployment", "loraplane-operator")["spec"]["template"]["spec"]["containers"][0]
    assert operator["image"] == f"ghcr.io/loraplane/operator:{version}"
    # The operator runs the BaseModel's serving replicas and router from this image.
    assert objects.one("BaseModel")["spec"]["resources"]["image"] == f"ghcr.io/loraplane/serving:{version}"
    pinned = render({"operator": {"image": {"tag": "0.0.9"}}}).one("Deployment", "loraplane-operator")
    assert pinned["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/loraplane/operator:0.0.9"


def test_every_container_runs_unprivileged(render: Any) -> None:
    objects = render({"baseModel": {"enabled": True}, "objectStore": {"enabled": True}})
    pods = [w["spec"]["template"]["spec"] for w in objects.kind("Deployment") + objects.kind("Job")]
    assert len(pods) == 3  # the operator, MinIO, the bucket Job
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_every_scratch_volume_has_a_size_limit(render: Any) -> None:
    """An emptyDir without a sizeLimit lets one pod fill the node's disk (the kubelet then evicts
    every pod on it); with one, the kubelet evicts only the pod that overran."""
    objects = render({"baseModel": {"enabled": True}, "objectStore": {"enabled": True, "persistence": {"enabled": False}}})
    pods = [w["spec"]["template"]["spec"] for w in objects.kind("Deployment") + objects.kind("Job")]
    scratch = [v for pod in pods for v in pod.get("volumes", []) if "emptyDir" in v]
    assert len(scratch) >= 3 and all(v["emptyDir"].get("sizeLimit") for v in scratch), scratch
    operator = objects.one("Deployment", "loraplane-operator")["spec"]["template"]["spec"]
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "10Gi"}} in operator["volumes"]
    assert render({"operator": {"scratchSize": "3Gi"}}).one("Deployment", "loraplane-operator")["spec"]["template"]["spec"][
        "volumes"
    ] == [{"name": "tmp", "emptyDir": {"sizeLimit": "3Gi"}}]
