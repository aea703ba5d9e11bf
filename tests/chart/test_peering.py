"""Peered operators (operator.replicas >= 2): the flags the real CLI parses, the peering CRD and
object kopf itself would look for in that watch mode, the kopf.dev rules, a rollout that keeps a
standby up; and with one replica none of it. tests/operator/test_peering.py shows the handover."""

from __future__ import annotations

import importlib.util
from typing import Any

import click
import helm_python as helm
import kopf
import kubernetes_validate
import pytest
import yaml
from crd_schema import ROOT
from kopf._cogs.structs import references
from kopf._core.engines import peering

from loraplane.cli import main

KOPF_PEERING = ["kopf.dev/v1", "kopf.dev/v1/ClusterKopfPeering", "kopf.dev/v1/KopfPeering"]
PEERED = {"operator": {"replicas": 2}}
NAMESPACED = {"operator": {"replicas": 2, "watchNamespaces": ["team-a", "team-b"]}}
PEERING_KINDS = ("ClusterKopfPeering", "KopfPeering")


def deployment(objects: Any) -> Any:
    return objects.one("Deployment", "loraplane-operator")


def cli_params(objects: Any) -> dict[str, Any]:
    """The operator container's args, parsed by the real `loraplane operator` without running it."""
    args = deployment(objects)["spec"]["template"]["spec"]["containers"][0]["args"]
    command = main.get_command(click.Context(main), args[0])
    assert command is not None
    return dict(command.make_context(args[0], args[1:]).params)


def kopf_selectors(objects: Any) -> list[references.Selector]:
    """The peering resources kopf looks for, given the settings `loraplane operator` passes kopf.run."""
    params = cli_params(objects)
    settings = kopf.OperatorSettings()
    settings.peering.standalone = params["standalone"]
    settings.peering.clusterwide = not params["namespaces"]
    return list(peering.guess_selectors(settings=settings))


def as_kopf_resource(crd: dict[str, Any]) -> references.Resource:
    spec = crd["spec"]
    names = spec["names"]
    version = spec["versions"][0]["name"]
    namespaced = spec["scope"] == "Namespaced"
    return references.Resource(spec["group"], version, names["plural"], kind=names["kind"], namespaced=namespaced)


def peering_crds(objects: Any) -> list[dict[str, Any]]:
    return [c for c in objects.kind("CustomResourceDefinition") if c["spec"]["group"] == "kopf.dev"]


def peering_objects(objects: Any) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in PEERING_KINDS]


def grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def structural_problems(schema: dict[str, Any]) -> list[str]:
    """The structural-schema rules tests/operator/test_crds.py holds the generated CRDs to."""
    spec = importlib.util.spec_from_file_location("operator_test_crds", ROOT / "tests" / "operator" / "test_crds.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    problems: list[str] = module._walk(schema)
    return problems


def test_peered_replicas_run_the_real_cli_with_peering_and_a_random_priority(render: Any) -> None:
    objects = render(PEERED, KOPF_PEERING)
    params = cli_params(objects)
    assert params["standalone"] is False
    assert params["priority"] is None  # the CLI draws a random one per process
    (obj,) = peering_objects(objects)
    assert params["peering_name"] == obj["metadata"]["name"] == "loraplane"


@pytest.mark.parametrize(
    ("values", "kind", "scope", "namespaces"),
    [(PEERED, "ClusterKopfPeering", "Cluster", [None]), (NAMESPACED, "KopfPeering", "Namespaced", ["team-a", "team-b"])],
    ids=["cluster-wide", "namespaced"],
)
def test_the_peering_crd_and_objects_are_what_kopf_looks_for(
    render: Any, values: dict[str, Any], kind: str, scope: str, namespaces: list[str | None]
) -> None:
    objects = render(values, KOPF_PEERING)
    (crd,) = peering_crds(objects)
    assert (crd["metadata"]["name"], crd["spec"]["names"]["kind"], crd["spec"]["scope"]) == (
        f"{kind.lower()}s.kopf.dev",
        kind,
        scope,
    )
    assert any(s.check(as_kopf_resource(crd)) for s in kopf_selectors(objects))
    found = peering_objects(objects)
    assert [(o["apiVersion"], o["kind"]) for o in found] == [("kopf.dev/v1", kind)] * len(namespaces)
    assert [o["metadata"].get("namespace") for o in found] == namespaces  # kopf peers in each watched one
    assert {o["metadata"]["name"] for o in found} == {cli_params(objects)["peering_name"]}


@pytest.mark.parametrize("values", [PEERED, NAMESPACED], ids=["cluster-wide", "namespaced"])
def test_the_peering_crd_is_a_valid_structural_crd_keeping_what_kopf_writes(render: Any, values: dict[str, Any]) -> None:
    (crd,) = peering_crds(render(values))
    kubernetes_validate.validate(crd, kubernetes_validate.latest_version(), strict=True)
    (version,) = crd["spec"]["versions"]
    assert version["served"] and version["storage"]
    schema = version["schema"]["openAPIV3Schema"]
    assert structural_problems(schema) == []
    # kopf merge-patches status.<peer identity> = {priority, lifetime, lastseen} on the object itself.
    assert schema["properties"]["status"] == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    assert "subresources" not in version


def test_the_peering_object_renders_only_once_the_cluster_serves_its_kind(render: Any, notes: Any) -> None:
    """Helm cannot build an object whose CRD the same release creates: the first render brings the
    CRD, and NOTES.txt says to upgrade again; the next renders the object."""
    first = render(PEERED)
    assert peering_crds(first) and peering_objects(first) == []
    assert "Run `helm upgrade` again" in notes(PEERED)
    assert peering_objects(render(PEERED, KOPF_PEERING))
    assert "helm upgrade" not in notes(PEERED, KOPF_PEERING)


def test_the_peering_crd_follows_crds_enabled_and_keep(render: Any) -> None:
    (kept,) = peering_crds(render(PEERED))
    assert kept["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    (released,) = peering_crds(render({**PEERED, "crds": {"keep": False}}))
    assert "annotations" not in released["metadata"]
    applied_elsewhere = render({**PEERED, "crds": {"enabled": False}}, KOPF_PEERING)
    assert peering_crds(applied_elsewhere) == [] and len(peering_objects(applied_elsewhere)) == 1


def test_peered_operators_keep_kopfs_peering_rules(render: Any) -> None:
    reference = grants(yaml.safe_load((ROOT / "crds" / "rbac.yaml").read_text())["rules"])
    role = grants(render(PEERED).one("ClusterRole")["rules"])
    assert role == {g for g in reference if g[0] != "admissionregistration.k8s.io"}
    for plural in ("clusterkopfpeerings", "kopfpeerings"):  # kopf watches and patches its peering
        assert {("kopf.dev", plural, v) for v in ("get", "list", "watch", "patch")} <= role


def test_a_new_pod_joins_before_an_old_one_leaves_and_replicas_prefer_distinct_nodes(render: Any) -> None:
    spec = deployment(render(PEERED))["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    (term,) = spec["template"]["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    own: dict[str, Any] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}
    mine = deployment(render({"operator": {"replicas": 2, "affinity": own}}))["spec"]["template"]["spec"]["affinity"]
    assert mine == own


@pytest.mark.parametrize("replicas", [0, 1])
def test_one_replica_renders_none_of_it(render: Any, replicas: int) -> None:
    for values in ({"operator": {"replicas": replicas}}, {"operator": {"replicas": replicas, "watchNamespaces": ["team-a"]}}):
        objects = render(values, KOPF_PEERING)
        assert peering_crds(objects) == [] and peering_objects(objects) == []
        assert cli_params(objects)["standalone"] is True
        assert deployment(objects)["spec"]["strategy"] == {"type": "Recreate"}
        assert "affinity" not in deployment(objects)["spec"]["template"]["spec"]
        assert not any(g == "kopf.dev" for g, _, _ in grants(objects.one("ClusterRole", "loraplane-operator")["rules"]))


def test_the_webhook_with_peered_replicas_is_refused_with_the_reason(chart: helm.Chart) -> None:
    values = {"operator": {"replicas": 2, "webhook": {"enabled": True}}}
    reason = r"operator\.webhook\.enabled needs operator\.replicas 0 or 1: .* own self-signed CA"
    with pytest.raises(helm.HelmRenderError, match=reason):
        chart.render(values, name="loraplane")


@pytest.mark.parametrize(
    ("values", "line"),
    [
        (PEERED, "kubectl get clusterkopfpeerings.kopf.dev loraplane -o yaml"),
        (NAMESPACED, "kubectl get kopfpeerings.kopf.dev loraplane -n team-a -o yaml"),
    ],
)
def test_the_notes_name_the_peering_to_inspect(notes: Any, values: dict[str, Any], line: str) -> None:
    text = notes(values, KOPF_PEERING)
    assert "2 replicas peer through" in text and line in text
    assert "peer through" not in notes()
