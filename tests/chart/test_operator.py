"""The operator as the chart runs it: flags the real CLI accepts, the settings it reads, the
admin token Secret, the least-privilege role of crds/rbac.yaml, and one standalone replica by
default (peered replicas: test_peering.py)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import click
import pytest
import yaml
from crd_schema import ROOT

from loraplane.cli import main
from loraplane.operator.runtime.settings import OperatorSettings

WEBHOOK = {"operator": {"webhook": {"enabled": True}}}


def container(objects: Any) -> dict[str, Any]:
    return objects.one("Deployment", "loraplane-operator")["spec"]["template"]["spec"]["containers"][0]


def cli_params(args: list[str]) -> dict[str, Any]:
    """Parse ``args`` with the real `loraplane` command, without running it."""
    command = main.get_command(click.Context(main), args[0])
    assert command is not None
    return dict(command.make_context(args[0], args[1:]).params)


def grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


REFERENCE = grants(yaml.safe_load((ROOT / "crds" / "rbac.yaml").read_text())["rules"])


def test_the_role_is_crds_rbac_less_peering_and_admission_without_the_webhook(render: Any) -> None:
    default = grants(render().one("ClusterRole")["rules"])
    assert default == {g for g in REFERENCE if g[0] not in ("kopf.dev", "admissionregistration.k8s.io")}
    with_webhook = grants(render(WEBHOOK).one("ClusterRole")["rules"])
    assert with_webhook == {g for g in REFERENCE if g[0] != "kopf.dev"}


def test_the_role_never_writes_spec_lists_secrets_or_deletes_beyond_dedicated_deployments_and_merge_jobs(
    render: Any,
) -> None:
    role = grants(render(WEBHOOK).one("ClusterRole")["rules"])
    assert ("", "secrets", "get") in role and ("", "secrets", "list") not in role
    assert not {v for _, r, v in role if r in ("basemodels", "loraadapters")} & {"update", "create", "delete"}
    assert not any(v in ("deletecollection", "*") for _, _, v in role)
    # The objects of a dedicated deployment (dedicated.mode auto), when its adapter returns to the
    # shared pool, and an older version's merge Job: nothing else; what a BaseModel or a LoraAdapter
    # owns goes with it by its owner reference.
    deletes = {(g, r) for g, r, v in role if v == "delete"}
    assert deletes == {("apps", "deployments"), ("", "services"), ("", "configmaps"), ("batch", "jobs")}
    assert {v for g, r, v in role if r == "jobs"} == {"get", "list", "create", "delete"}  # never patched: one per version


def test_the_role_is_bound_to_the_pods_service_account(render: Any) -> None:
    objects = render()
    binding = objects.one("ClusterRoleBinding")
    account = objects.one("ServiceAccount")["metadata"]["name"]
    assert binding["roleRef"]["name"] == objects.one("ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "lp"}]
    pod = objects.one("Deployment", "loraplane-operator")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account


def test_it_runs_standalone_with_the_liveness_endpoint_its_probe_reads(render: Any) -> None:
    c = container(render())
    params = cli_params(c["args"])
    assert params["standalone"] is True and params["namespaces"] == ()
    url = urlsplit(params["liveness_endpoint"])
    probe = c["livenessProbe"]["httpGet"]
    port = next(p["containerPort"] for p in c["ports"] if p["name"] == probe["port"])
    assert (url.path, url.port) == (probe["path"], port) == ("/healthz", 8080)


def test_watch_namespaces_become_namespace_flags(render: Any) -> None:
    c = container(render({"operator": {"watchNamespaces": ["team-a", "team-b"]}}))
    assert cli_params(c["args"])["namespaces"] == ("team-a", "team-b")


def test_the_settings_it_reads_are_the_values(render: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    objects = render({"operator": {"syncInterval": 20, "retryDelay": 2.5, "resyncInterval": 45}})
    known = {f"LORAPLANE_{name.upper()}" for name in OperatorSettings.model_fields}
    for var in container(objects)["env"]:
        assert var["name"] in known, f"{var['name']} is not an operator setting"
        if "fieldRef" in var.get("valueFrom", {}):  # the downward API: the release's namespace
            assert var["valueFrom"]["fieldRef"] == {"fieldPath": "metadata.namespace"}
            monkeypatch.setenv(var["name"], "loraplane-system")
        else:
            monkeypatch.setenv(var["name"], var["value"])
    settings = OperatorSettings()
    assert (settings.sync_interval, settings.retry_delay, settings.metrics_interval) == (20, 2.5, 30)
    assert settings.resync_interval == 45
    assert settings.operator_namespace == "loraplane-system"


def test_the_allow_lists_and_policies_reach_the_operators_settings(render: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    lists = {"allowedSources": ["s3://adapters/", "s3://shared/base/"], "allowedEndpoints": ["http://minio.store:9000"]}
    values = {**lists, "tenantPerNamespace": True, "metricsNamespaces": ["monitoring"]}
    env = {v["name"]: v for v in container(render({"operator": values}))["env"]}
    names = (
        "LORAPLANE_ALLOWED_SOURCES", "LORAPLANE_ALLOWED_ENDPOINTS", "LORAPLANE_TENANT_PER_NAMESPACE",
        "LORAPLANE_METRICS_NAMESPACES",
    )  # fmt: skip
    for var in names:
        monkeypatch.setenv(var, env[var]["value"])
    settings = OperatorSettings()
    assert (settings.allowed_sources, settings.allowed_endpoints) == (lists["allowedSources"], lists["allowedEndpoints"])
    assert settings.tenant_per_namespace is True and settings.metrics_namespaces == ["monitoring"]
    assert settings.policy("team-a").namespace_tenant == "team-a"  # what the webhook and reconcile check
    bare = {v["name"] for v in container(render())["env"]}
    assert not bare & set(names)  # unset: any source, any endpoint, any tenant


def test_the_operator_holds_no_admin_token_and_the_chart_creates_none(render: Any) -> None:
    """Each BaseModel's token is its own Secret, created by the operator in the BaseModel's namespace:
    a chart-wide token would open every namespace's replicas to whoever can read it in one."""
    objects = render()
    assert objects.kind("Secret") == []
    assert not [v for v in container(objects)["env"] if "secretKeyRef" in v.get("valueFrom", {})]


def test_the_webhook_is_reachable_at_the_host_kopf_registers(render: Any) -> None:
    objects = render({"operator": {"webhook": {"enabled": True, "port": 8443}}})
    c = container(objects)
    service = objects.one("Service", "loraplane-webhook")
    env = {v["name"]: v.get("value") for v in c["env"]}
    assert cli_params(c["args"])["webhook_port"] == 8443
    assert env["LORAPLANE_WEBHOOK_SERVICE"] == "lp/loraplane-webhook"
    # The operator registers the Service with its own port, so the Service must listen on that same port.
    assert service["spec"]["ports"] == [{"name": "webhook", "port": 8443, "targetPort": "webhook"}]
    assert {"name": "webhook", "containerPort": 8443} in c["ports"]
    pod_labels = objects.one("Deployment", "loraplane-operator")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_the_old_pod_is_gone_before_the_new_one_starts(render: Any) -> None:
    deployment = render().one("Deployment", "loraplane-operator")
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert render({"operator": {"replicas": 0}}).one("Deployment", "loraplane-operator")["spec"]["replicas"] == 0


@pytest.mark.parametrize(
    ("operator", "pdb"),
    [
        ({}, False),  # one replica: a PDB could only stall a drain
        ({"replicas": 0}, False),
        ({"podDisruptionBudget": {"enabled": True}}, True),  # ...unless asked for
        ({"replicas": 2}, True),  # peered: a drain evicts one at a time, a standby takes over
        ({"replicas": 3, "podDisruptionBudget": {"enabled": False}}, False),
    ],
)
def test_a_pdb_by_default_with_two_or_more_replicas_else_on_request(render: Any, operator: dict[str, Any], pdb: bool) -> None:
    assert len(render({"operator": operator}).kind("PodDisruptionBudget")) == int(pdb)


def test_the_pdb_selects_the_operator(render: Any) -> None:
    objects = render({"operator": {"replicas": 3, "podDisruptionBudget": {"minAvailable": 2}}})
    pdb = objects.one("PodDisruptionBudget")
    labels = objects.one("Deployment", "loraplane-operator")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["minAvailable"] == 2
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
