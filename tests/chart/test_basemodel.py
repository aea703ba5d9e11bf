"""The optional BaseModel: valid for the CRD and the operator's model, and, in a self-contained
install, everything the operator then creates from it finds the Secrets and store the chart made."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_schema import errors

from loraplane.operator.api import BaseModelResource
from loraplane.operator.children.base_model import children
from loraplane.operator.children.names import ADMIN_TOKEN_KEY, STATS_TOKEN_KEY, admin_secret_name, stats_secret_name
from loraplane.serving.config import EngineConfig

CHART = Path(__file__).resolve().parents[2] / "charts" / "loraplane"
SELF_CONTAINED = {"baseModel": {"enabled": True}, "objectStore": {"enabled": True}}


def test_no_base_model_unless_enabled(render: Any) -> None:
    assert render().kind("BaseModel") == []


@pytest.mark.parametrize(
    "values",
    [
        {"baseModel": {"enabled": True}},
        SELF_CONTAINED,
        {"baseModel": {"enabled": True, "name": "qwen", "spec": {"source": {"uri": "/models/qwen2.5-7b"}, "replicas": 3}}},
    ],
    ids=["defaults", "self-contained", "own-spec"],
)
def test_the_base_model_is_valid_for_the_crd_and_the_operator(render: Any, values: dict[str, Any]) -> None:
    base = render(values).one("BaseModel")
    assert errors(base) == []
    BaseModelResource.model_validate(base)  # also the rules the CRD states in CEL


def test_spec_values_merge_over_the_defaults(render: Any) -> None:
    spec = render({"baseModel": {"enabled": True, "spec": {"resources": {"gpus": 1}}}}).one("BaseModel")["spec"]
    assert spec["resources"]["gpus"] == 1 and spec["resources"]["memory"] == "4Gi"
    assert spec["source"] == {"uri": "embedded"}


def test_a_self_contained_install_exports_usage_records_to_its_own_bucket(render: Any) -> None:
    rendered = render(SELF_CONTAINED)
    spec = rendered.one("BaseModel")["spec"]
    assert spec["usage"] == {"bucket": "usage"}
    job = next(o for o in rendered.kind("Job") if o["metadata"]["name"].endswith("-buckets"))
    assert spec["usage"]["bucket"] in job["spec"]["template"]["spec"]["containers"][0]["command"][3:]  # the Job creates it
    pods = children("smollm2", "default", BaseModelResource.model_validate(rendered.one("BaseModel")).spec)
    serving = next(o for o in pods if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-serving"))
    env = {e["name"]: e.get("value") for e in serving["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LORAPLANE_USAGE_EXPORT"] == "s3://usage/usage"
    assert env["AWS_ENDPOINT_URL"] == spec["adapterStore"]["endpoint"]


def test_a_given_image_and_adapter_store_are_kept(render: Any) -> None:
    store = {"endpoint": "https://s3.example.com", "credentialsSecret": {"name": "mine"}}
    values = {**SELF_CONTAINED, "baseModel": {"enabled": True, "spec": {"resources": {"image": "r/s:1"}, "adapterStore": store}}}
    spec = render(values).one("BaseModel")["spec"]
    assert spec["resources"]["image"] == "r/s:1" and spec["adapterStore"] == store


def secrets_used(manifests: list[dict[str, Any]]) -> set[tuple[str, str | None]]:
    """(Secret, key) pairs the pods of ``manifests`` read; key None for a whole Secret."""
    used: set[tuple[str, str | None]] = set()
    for m in manifests:
        if m["kind"] != "Deployment":
            continue
        pod = m["spec"]["template"]["spec"]
        used |= {(v["secret"]["secretName"], None) for v in pod.get("volumes", []) if "secret" in v}
        for c in pod["containers"]:
            used |= {(e["secretRef"]["name"], None) for e in c.get("envFrom", [])}
            refs = [e["valueFrom"]["secretKeyRef"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]
            used |= {(r["name"], r["key"]) for r in refs}
    return used


def test_what_the_operator_creates_from_it_finds_the_charts_secrets_and_store(render: Any) -> None:
    objects = render(SELF_CONTAINED)
    base = BaseModelResource.model_validate(objects.one("BaseModel"))
    owned = children(base.metadata.name, "lp", base.spec)
    secrets = {s["metadata"]["name"]: s["data"] for s in objects.kind("Secret")}
    used = secrets_used(owned)
    # The store's keys from the chart, nothing missing; the tokens are the operator's to create.
    tokens = {admin_secret_name(base.metadata.name): ADMIN_TOKEN_KEY, stats_secret_name(base.metadata.name): STATS_TOKEN_KEY}
    assert {name for name, _ in used} == {*secrets, *tokens}
    for name, key in used:
        assert key is None or key in secrets.get(name, {tokens.get(name): None}), (name, key)
    # The adapter store the replicas read: the names the S3 sources read, at the chart's Service.
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(secrets["loraplane-object-store"])
    engine = yaml.safe_load(next(m for m in owned if m["kind"] == "ConfigMap")["data"]["engine.yaml"])
    service = objects.one("Service", "loraplane-object-store")
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "s3")
    assert engine["s3_endpoint"] == f"http://loraplane-object-store.lp.svc:{port}"
    assert all(base64.b64decode(v) for data in secrets.values() for v in data.values())


def test_the_gpu_base_model_runs_its_engine_on_the_gpu_it_requests(render: Any) -> None:
    """The chart's GPU value set: the operator's serving pod requests the GPU and its engine
    config says cuda (no silent fallback to the CPU) with the chart's memory utilization."""
    values = yaml.safe_load((CHART / "ci" / "base-model-values.yaml").read_text())
    spec = BaseModelResource.model_validate(render(values).one("BaseModel")).spec
    objects = {f"{o['kind']}/{o['metadata']['name']}": o for o in children("llama", "ml", spec)}
    container = objects["Deployment/llama-serving"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    engine = EngineConfig.model_validate(yaml.safe_load(objects["ConfigMap/llama-engine"]["data"]["engine.yaml"]))
    assert engine.device == "cuda" and engine.gpu_memory_utilization == 0.92 and engine.dtype == "bfloat16"


def test_a_node_cache_from_values_gives_each_node_an_agent_and_its_volume(render: Any) -> None:
    """The chart's BaseModel with ``nodeCache``: the operator builds the agents' DaemonSet from it
    (per BaseModel: docs/node-cache.md says why), with the node's folder as a hostPath volume the
    serving pods mount read-only, against the chart's self-contained object store."""
    values = {
        **SELF_CONTAINED,
        "baseModel": {
            "enabled": True,
            "spec": {"nodeCache": {"enabled": True, "size": "40Gi"}, "resources": {"nodeSelector": {"pool": "serving"}}},
        },
    }
    base = render(values).one("BaseModel")
    assert errors(base) == []
    spec = BaseModelResource.model_validate(base).spec
    objects = {f"{o['kind']}/{o['metadata']['name']}": o for o in children("smollm2", "default", spec)}
    agents = objects["DaemonSet/smollm2-node-cache"]["spec"]["template"]["spec"]
    volume = next(v for v in agents["volumes"] if v["name"] == "node-cache")
    assert volume["hostPath"] == {"path": "/var/lib/loraplane/default/smollm2", "type": "DirectoryOrCreate"}
    assert agents["containers"][0]["envFrom"] == [{"secretRef": {"name": spec.adapter_store.credentials_secret.name}}]
    serving = objects["Deployment/smollm2-serving"]["spec"]["template"]["spec"]
    mount = next(m for m in serving["containers"][0]["volumeMounts"] if m["name"] == "node-cache")
    assert mount["readOnly"] is True
