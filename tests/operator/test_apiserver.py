"""What only a real API server can show about our CRDs (envtest.py): the examples pass its
validation, a broken manifest is refused with its own message, its defaults land on the stored
object, and every status field the operator's typed models can write survives its pruning."""

from __future__ import annotations

import copy
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_schema import examples
from envtest import Kube, control_plane
from pydantic import BaseModel

from loraplane.operator.api.basemodel import BaseModelSpec, BaseModelStatus
from loraplane.operator.api.loraadapter import LoraAdapterStatus
from loraplane.operator.children.base_model import children

pytestmark = pytest.mark.slow
NS = "crd-checks"


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    with control_plane(tmp_path_factory.mktemp("apiserver")) as k:
        k.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        yield k


def example(kind: str) -> dict[str, Any]:
    manifest = copy.deepcopy(next(d for d in examples() if d["kind"] == kind))
    manifest["metadata"] = {"name": manifest["metadata"]["name"], "namespace": NS}
    return manifest


def test_every_example_manifest_passes_server_side_dry_run(kube: Kube) -> None:
    docs = examples()
    namespaces = sorted({d["metadata"].get("namespace", "default") for d in docs})  # kustomize sets the gitops ones
    for namespace in namespaces:
        kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    r = kube.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(docs), check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("(server dry run)") == len(docs) > 500
    assert all(kube.list("LoraAdapter", ns) == [] for ns in namespaces)  # a dry run stores nothing


def test_everything_the_operator_creates_for_a_base_passes_server_side_dry_run(kube: Kube) -> None:
    """With every option that adds objects (GPUs, tenants, metrics namespaces): the server, not
    our reading of the API, decides whether they are valid."""
    base = example("BaseModel")
    spec = BaseModelSpec.model_validate(base["spec"])
    built = children(base["metadata"]["name"], NS, spec, "loraplane", ["monitoring"])
    # And a base from object storage through the node cache, under another name.
    s3 = {**base["spec"], "source": {"uri": "s3://models/smollm2", "name": "HuggingFaceTB/SmolLM2-135M-Instruct"},
          "nodeCache": {"enabled": True},
          "resources": {**base["spec"].get("resources", {}), "nodeSelector": {"pool": "a"}}}  # fmt: skip
    built += children("from-s3", NS, BaseModelSpec.model_validate(s3), "loraplane", ["monitoring"])
    assert {"NetworkPolicy", "DaemonSet"} <= {m["kind"] for m in built}
    r = kube.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(built), check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("(server dry run)") == len(built)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("rank", 0, "spec.rank: Invalid value: 0: spec.rank in body should be greater than or equal to 1"),
        ("tenant", None, "spec.tenant: Required value"),
        ("pinned", "yes", 'spec.pinned: Invalid value: "string": spec.pinned in body must be of type boolean'),
    ],
)
def test_a_manifest_that_breaks_the_schema_is_refused_with_the_servers_message(
    kube: Kube, field: str, value: Any, message: str
) -> None:
    manifest = example("LoraAdapter")
    manifest["metadata"]["name"] = f"broken-{field}"
    if value is None:
        del manifest["spec"][field]
    else:
        manifest["spec"][field] = value
    r = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest), check=False)
    assert r.returncode != 0 and message in r.stderr, r.stderr
    assert kube.get("LoraAdapter", NS, f"broken-{field}") is None


def test_the_schemas_defaults_appear_on_the_stored_object(kube: Kube) -> None:
    """The server fills what the typed model would: a BaseModel that sets only its source is
    stored with every default of BaseModelSpec."""
    manifest = {"apiVersion": "loraplane.dev/v1alpha1", "kind": "BaseModel", "metadata": {"name": "defaults", "namespace": NS},
                "spec": {"source": {"uri": "embedded"}}}  # fmt: skip
    stored = kube.apply(manifest)["spec"]
    expected = BaseModelSpec.model_validate(manifest["spec"]).body()
    assert stored == expected
    assert stored["engine"]["maxLoras"] == 8 and stored["autoPinning"]["enabled"] is True


def filled(model: type[BaseModel]) -> dict[str, Any]:
    """An instance of ``model`` with every field set (lists with one element), as JSON."""

    def value(annotation: Any, name: str, extra: Any) -> Any:
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if origin in (typing.Union, types.UnionType):
            return value(next(a for a in args if a is not type(None)), name, extra)
        if origin is typing.Literal:
            return args[-1]
        if origin is list:
            return [value(args[0], name, extra)]
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return filled(annotation)
        if (extra or {}).get("format") == "date-time":
            return "2026-12-01T00:00:00Z"
        return {str: "Observed", bool: True, int: 3, float: 0.5}[annotation]

    hints = typing.get_type_hints(model)
    data = {name: value(hints[name], name, field.json_schema_extra) for name, field in model.model_fields.items()}
    return model.model_validate(data).body()


@pytest.mark.parametrize(("kind", "status_model"), [("LoraAdapter", LoraAdapterStatus), ("BaseModel", BaseModelStatus)])
def test_every_status_field_the_operator_can_write_is_kept_and_others_are_pruned(
    kube: Kube, kind: str, status_model: type[BaseModel]
) -> None:
    """Undeclared fields are pruned without an error, so a status field our models write and the
    CRD did not declare would vanish silently: write one of each field and read it back."""
    manifest = example(kind)
    manifest["metadata"]["name"] = f"status-{kind.lower()}"
    status = filled(status_model)
    kube.apply(manifest)
    stored = kube.merge_patch(kind, NS, manifest["metadata"]["name"], {"status": {**status, "undeclared": "x"}}, "status")
    assert stored["status"] == status


def test_kubectl_get_prints_the_printer_columns(kube: Kube, tmp_path: Path) -> None:
    manifest = example("LoraAdapter")
    manifest["metadata"]["name"] = "columns"
    status = filled(LoraAdapterStatus)
    dedicated = {**status["conditions"][0], "type": "DedicatedRecommended", "reason": "Dominant"}
    status["conditions"] = [status["conditions"][0], dedicated]
    kube.apply({**manifest, "status": status})
    out = kube.kubectl("get", "loraadapters", "columns", "-n", NS).stdout.splitlines()
    assert out[0].split() == ["NAME", "BASE", "TENANT", "RANK", "PHASE", "PINNED", "HIT", "RATE", "REQ/S", "AGE"]
    row = out[1].split()
    spec = manifest["spec"]
    assert row[:7] == ["columns", spec["baseModel"], spec["tenant"], "3", status["phase"], "true", "0.5"], out
    wide = kube.kubectl("get", "loraadapters", "columns", "-n", NS, "-o", "wide").stdout.splitlines()
    assert wide[0].split()[-3:] == ["NODES", "DEDICATED", "SERVED"]  # -o wide only
    assert wide[1].split()[-3] == str(status["nodesCached"])
    assert wide[1].split()[-2] == "Dominant"  # the reason of the one condition of its type
    assert wide[1].split()[-1] == status["servedFrom"]


def test_a_cel_rule_is_evaluated_by_the_server(kube: Kube) -> None:
    manifest = example("BaseModel")
    manifest["metadata"]["name"] = "cel"
    manifest["spec"]["engine"] = {"maxLoras": 8, "maxCpuLoras": 4}
    r = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest), check=False)
    assert r.returncode != 0 and "spec.engine: Invalid value" in r.stderr, r.stderr
    assert "maxCpuLoras must be at least maxLoras" in r.stderr
    assert kube.get("BaseModel", NS, "cel") is None


def test_the_server_refuses_a_return_share_above_the_dominance_share_even_from_its_default(kube: Kube) -> None:
    manifest = example("BaseModel")
    manifest["metadata"]["name"] = "hysteresis"
    manifest["spec"]["dedicated"] = {"mode": "recommend", "share": 0.1}  # returnShare's default, 0.15, is above it
    r = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest), check=False)
    assert r.returncode != 0 and "dedicated.returnShare must be at most dedicated.share" in r.stderr, r.stderr
    manifest["spec"]["dedicated"]["returnShare"] = 0.05
    kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))
    stored = kube.get("BaseModel", NS, "hysteresis")
    assert stored is not None and stored["spec"]["dedicated"]["holdSeconds"] == 600  # the schema's default filled in
    kube.delete("BaseModel", NS, "hysteresis")


def test_the_server_refuses_an_s3_base_without_the_node_cache(kube: Kube) -> None:
    manifest = example("BaseModel")
    manifest["metadata"]["name"] = "s3-base"
    manifest["spec"]["source"] = {"uri": "s3://models/smollm2", "name": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    r = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest), check=False)
    assert r.returncode != 0 and "nodeCache.enabled" in r.stderr, r.stderr
    manifest["spec"]["nodeCache"] = {"enabled": True}
    r = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest), check=False)
    assert r.returncode != 0 and "nodeCache.enabled needs resources.nodeSelector" in r.stderr, r.stderr
    manifest["spec"]["resources"] = {**manifest["spec"].get("resources", {}), "nodeSelector": {"pool": "serving"}}
    r = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest), check=False)
    assert r.returncode == 0, r.stderr
    kube.kubectl("delete", "basemodel", "-n", NS, "s3-base")


def test_the_server_refuses_a_source_with_dot_segments(kube: Kube) -> None:
    manifest = example("LoraAdapter")
    manifest["metadata"]["name"] = "dots"
    manifest["spec"]["source"]["uri"] = "s3://adapters/acme/../globex/support/v1"
    r = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest), check=False)
    assert r.returncode != 0 and "may not contain . or .. path segments" in r.stderr, r.stderr
    assert kube.get("LoraAdapter", manifest["metadata"]["namespace"], "dots") is None


def test_a_child_an_earlier_operator_wrote_loses_what_the_operator_no_longer_sets(
    kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Operators before server-side apply created and merge-patched their children under the
    Python client's name. The first apply adopts those fields, so turning the node cache off
    removes its volume and node selector from a serving Deployment written the old way (an apply
    alone would leave them, still owned by the old writer, and the pods Pending)."""
    import asyncio

    from kubernetes import client, config

    from loraplane.operator.children.base_model import deployment
    from loraplane.operator.runtime import cluster

    api = config.new_client_from_config(str(kube.kubeconfig))
    monkeypatch.setattr(cluster, "_api", lambda: api)  # the operator's client, on this API server
    spec = example("BaseModel")["spec"]
    resources = {**spec.get("resources", {}), "nodeSelector": {"pool": "serving"}}
    cached = BaseModelSpec.model_validate({**spec, "nodeCache": {"enabled": True}, "resources": resources})
    apps = client.AppsV1Api(api)
    apps.create_namespaced_deployment(NS, deployment("legacy", NS, cached))  # as operators before wrote it
    asyncio.run(cluster.apply_child(deployment("legacy", NS, BaseModelSpec.model_validate(spec))))
    written = apps.read_namespaced_deployment("legacy-serving", NS)
    pod = written.spec.template.spec
    assert "node-cache" not in [v.name for v in pod.volumes or []]
    assert "pool" not in (pod.node_selector or {})
    managers = {(m.manager, m.operation) for m in written.metadata.managed_fields}
    assert ("loraplane-operator", "Apply") in managers and ("OpenAPI-Generator", "Update") not in managers
