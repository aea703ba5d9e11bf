"""What a BaseModel creates: valid Kubernetes objects, and an engine config the real server accepts."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from crd_schema import examples

from loraplane.operator.api.basemodel import BaseModelSpec
from loraplane.operator.children.base_model import CONFIG_HASH, children
from loraplane.serving.config import EngineConfig

BASE = next(d for d in examples() if d["kind"] == "BaseModel")


def built(spec: dict | None = None) -> dict[str, dict]:
    model = BaseModelSpec.model_validate(spec or BASE["spec"])
    return {f"{m['kind']}/{m['metadata']['name']}": m for m in children("smollm2", "loraplane-demo", model)}


def test_every_child_is_a_valid_kubernetes_object() -> None:
    for manifest in built().values():
        kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)


def test_the_engine_config_is_what_the_server_reads() -> None:
    config = EngineConfig.model_validate(yaml.safe_load(built()["ConfigMap/smollm2-engine"]["data"]["engine.yaml"]))
    engine = BASE["spec"]["engine"]
    assert (config.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras, config.max_num_seqs) == (
        "embedded", engine["maxLoras"], engine["maxLoraRank"], engine["maxCpuLoras"], engine["maxNumSeqs"],
    )  # fmt: skip
    assert config.s3_endpoint == BASE["spec"]["adapterStore"]["endpoint"]
    assert config.disk_cache_max_bytes == 20 * 2**30  # the BaseModel's default diskCacheSize, 20Gi
    sized = copy.deepcopy(BASE["spec"])
    sized["engine"]["diskCacheSize"] = "1.5G"
    config = EngineConfig.model_validate(yaml.safe_load(built(sized)["ConfigMap/smollm2-engine"]["data"]["engine.yaml"]))
    assert config.disk_cache_max_bytes == 1_500_000_000
    with pytest.raises(ValueError, match=r"diskCacheSize|disk_cache_size"):
        BaseModelSpec.model_validate({**sized, "engine": {**sized["engine"], "diskCacheSize": "20 gigs"}})
    assert config.base_name is None  # the checkpoint's own name
    named = copy.deepcopy(BASE["spec"])
    named["source"]["name"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    config = EngineConfig.model_validate(yaml.safe_load(built(named)["ConfigMap/smollm2-engine"]["data"]["engine.yaml"]))
    assert config.base_name == "HuggingFaceTB/SmolLM2-135M-Instruct"  # what adapters are checked against


def test_metrics_have_a_port_of_their_own_on_replicas_and_routers() -> None:
    """What the chart's ServiceMonitor scrapes; the API port's /metrics needs the admin token."""
    objects = built()
    for who in ("serving", "router"):
        container = objects[f"Deployment/smollm2-{who}"]["spec"]["template"]["spec"]["containers"][0]
        args = container["args"]
        assert args[args.index("--metrics-port") + 1] == "9090"
        assert {"name": "metrics", "containerPort": 9090} in container["ports"]
        ports = objects[f"Service/smollm2-{who}"]["spec"]["ports"]
        assert {"name": "metrics", "port": 9090, "targetPort": "metrics"} in ports


def test_only_the_routers_and_the_operator_reach_the_serving_api_port() -> None:
    model = BaseModelSpec.model_validate(BASE["spec"])
    objects = {f"{m['kind']}/{m['metadata']['name']}": m for m in children("smollm2", "team-a", model, "loraplane")}
    policy = objects["NetworkPolicy/smollm2-serving"]["spec"]
    serving = objects["Deployment/smollm2-serving"]["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"] == serving and policy["policyTypes"] == ["Ingress"]
    api, metrics = policy["ingress"]
    assert api["ports"] == [{"protocol": "TCP", "port": "http"}]
    router_pods = objects["Deployment/smollm2-router"]["spec"]["template"]["metadata"]["labels"]
    router_rule, operator_rule = api["from"]
    assert router_rule == {"podSelector": {"matchLabels": router_pods}}
    assert operator_rule["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "loraplane"}}
    assert operator_rule["podSelector"] == {"matchLabels": {"app.kubernetes.io/component": "operator"}}
    assert metrics == {"ports": [{"protocol": "TCP", "port": "metrics"}]}  # Prometheus, from anywhere
    assert "NetworkPolicy/smollm2-router" not in objects  # it would admit everyone anyway


def test_named_metrics_namespaces_alone_reach_the_metrics_ports_and_the_routers_api_stays_open() -> None:
    model = BaseModelSpec.model_validate(BASE["spec"])
    built = children("smollm2", "team-a", model, "loraplane", ["monitoring"])
    objects = {f"{m['kind']}/{m['metadata']['name']}": m for m in built}
    prometheus = [{"namespaceSelector": {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring"]},
    ]}}]  # fmt: skip
    _, metrics = objects["NetworkPolicy/smollm2-serving"]["spec"]["ingress"]
    assert metrics == {"ports": [{"protocol": "TCP", "port": "metrics"}], "from": prometheus}
    router = objects["NetworkPolicy/smollm2-router"]["spec"]
    assert router["podSelector"]["matchLabels"] == objects["Deployment/smollm2-router"]["spec"]["template"]["metadata"]["labels"]
    api, metrics = router["ingress"]
    assert api == {"ports": [{"protocol": "TCP", "port": "http"}]}  # the front door, for every client
    assert metrics["from"] == prometheus


def test_serving_and_router_pods_run_unprivileged_on_a_read_only_root() -> None:
    objects = built()
    for who in ("serving", "router"):
        pod = objects[f"Deployment/smollm2-{who}"]["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        (container,) = pod["containers"]
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True
        assert context["capabilities"] == {"drop": ["ALL"]}
        # What the process writes has a volume: /tmp (also HOME, for library caches) and its spools.
        mounted = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
        assert "/tmp" in mounted and {"name": "HOME", "value": "/tmp"} in container["env"]
        volumes = {v["name"] for v in pod["volumes"]}
        assert {m["name"] for m in container["volumeMounts"]} <= volumes
    serving = objects["Deployment/smollm2-serving"]["spec"]["template"]["spec"]["containers"][0]
    assert {"/var/cache/loraplane", "/tmp"} <= {m["mountPath"] for m in serving["volumeMounts"]}


def test_every_scratch_volume_has_a_size_limit_and_the_cache_holds_its_bound() -> None:
    """Each emptyDir of every pod the operator creates is bounded (the kubelet evicts the pod that
    overruns it, not every pod on a full node); a replica's cache volume holds the adapter cache's
    bound and one more adapter beside it."""
    for spec in (BASE["spec"], {**BASE["spec"], "engine": {**BASE["spec"].get("engine", {}), "diskCacheSize": "5Gi"}}):
        objects = built(spec)
        pods = [o["spec"]["template"]["spec"] for o in objects.values() if o["kind"] in ("Deployment", "DaemonSet")]
        scratch = [v for pod in pods for v in pod["volumes"] if "emptyDir" in v]
        assert len(scratch) >= 4 and all(v["emptyDir"].get("sizeLimit") for v in scratch), scratch
    serving = objects["Deployment/smollm2-serving"]["spec"]["template"]["spec"]
    (cache,) = [v for v in serving["volumes"] if v["name"] == "cache"]
    assert int(cache["emptyDir"]["sizeLimit"]) == 5 * 2**30 + 3 * 2**30
    # "null" bounds the engine as the volume is bounded: the engine evicts files before the kubelet
    # would evict the pod.
    unbounded = built({**BASE["spec"], "engine": {**BASE["spec"]["engine"], "diskCacheSize": None}})
    config = EngineConfig.model_validate(yaml.safe_load(unbounded["ConfigMap/smollm2-engine"]["data"]["engine.yaml"]))
    (cache,) = [v for v in unbounded["Deployment/smollm2-serving"]["spec"]["template"]["spec"]["volumes"] if v["name"] == "cache"]
    assert config.disk_cache_max_bytes is not None
    assert config.disk_cache_max_bytes + 3 * 2**30 == int(cache["emptyDir"]["sizeLimit"])


def test_the_deployment_carries_secrets_by_reference_and_the_sizing() -> None:
    pod = built()["Deployment/smollm2-serving"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert "--tenants" in container["args"]
    assert {"secretRef": {"name": "adapter-store"}} in container["envFrom"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs["LORAPLANE_ADMIN_TOKEN"] == {"name": "smollm2-admin", "key": "admin-token"}
    assert refs["LORAPLANE_STATS_TOKEN"] == {"name": "smollm2-stats", "key": "stats-token"}
    # The replica knows its own address, so a signed admin call made for another pod is refused.
    fields = {e["name"]: e["valueFrom"]["fieldRef"] for e in container["env"] if "fieldRef" in e.get("valueFrom", {})}
    assert fields["LORAPLANE_ADMIN_HOSTS"] == {"fieldPath": "status.podIP"}
    assert "nvidia.com/gpu" not in container["resources"]["limits"]  # gpus: 0 in the embedded example
    gpu = copy.deepcopy(BASE["spec"])
    gpu["resources"] = {"gpus": 2, "nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]}
    pod = built(gpu)["Deployment/smollm2-serving"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2" and pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    # The engine runs on the GPU the pod requests (never falling back to its CPU), and a pod
    # without one runs on its CPU; both read by the engine's own settings model.
    for spec, device in ((gpu, "cuda"), (BASE["spec"], "cpu")):
        engine_yaml = yaml.safe_load(built(spec)["ConfigMap/smollm2-engine"]["data"]["engine.yaml"])
        assert EngineConfig.model_validate(engine_yaml).device == device
    serving = built()
    selector = serving["Deployment/smollm2-serving"]["spec"]["selector"]["matchLabels"]
    assert serving["Service/smollm2-serving"]["spec"]["selector"] == selector


def test_a_base_in_object_storage_needs_the_node_cache_and_a_model_id() -> None:
    spec = copy.deepcopy(BASE["spec"])
    spec["source"] = {"uri": "s3://models/llama-8b"}
    with pytest.raises(ValueError, match=r"nodeCache\.enabled"):
        BaseModelSpec.model_validate(spec)
    spec["nodeCache"] = {"enabled": True}
    with pytest.raises(ValueError, match=r"source\.name"):
        BaseModelSpec.model_validate(spec)


S3_BASE = {
    **BASE["spec"],
    "source": {"uri": "s3://models/llama-8b", "name": "meta-llama/Llama-3.1-8B-Instruct", "digest": "sha256:" + "ab" * 32},
    "nodeCache": {"enabled": True, "size": "80Gi"},
    "adapterStore": {"endpoint": "http://minio.storage:9000", "credentialsSecret": {"name": "store-creds"}},
    "resources": {**BASE["spec"].get("resources", {}), "nodeSelector": {"gpu": "h200"},
                  "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
}  # fmt: skip


def test_the_node_cache_objects_are_valid_and_wire_the_pods_to_their_own_nodes_agent() -> None:
    objects = built(S3_BASE)
    for manifest in objects.values():
        kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)
    agents = objects["DaemonSet/smollm2-node-cache"]["spec"]["template"]["spec"]
    assert agents["nodeSelector"] == {"gpu": "h200"} and agents["tolerations"][0]["key"] == "nvidia.com/gpu"
    (agent,) = agents["containers"]
    assert agent["securityContext"]["runAsUser"] == 10001 and not agent["securityContext"]["allowPrivilegeEscalation"]
    assert agent["args"][agent["args"].index("--max-bytes") + 1] == str(80 * 2**30)
    assert agent["args"][agent["args"].index("--base-digest") + 1] == S3_BASE["source"]["digest"]
    assert agent["envFrom"] == [{"secretRef": {"name": "store-creds"}}]  # the agent holds the store's credentials
    (chown,) = agents["initContainers"]
    assert chown["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    host = {v["name"]: v for v in agents["volumes"]}["node-cache"]["hostPath"]["path"]
    assert host == "/var/lib/loraplane/loraplane-demo/smollm2"  # per namespace and BaseModel
    assert objects["Service/smollm2-node-cache"]["spec"]["internalTrafficPolicy"] == "Local"
    serving = objects["Deployment/smollm2-serving"]["spec"]["template"]["spec"]
    (container,) = serving["containers"]
    assert not container["envFrom"]  # serving pods no longer need the store's credentials
    mount = next(m for m in container["volumeMounts"] if m["name"] == "node-cache")
    assert mount["readOnly"] is True
    assert {v["name"]: v for v in serving["volumes"]}["node-cache"]["hostPath"]["path"] == host
    (wait,) = serving["initContainers"]
    assert wait["args"][-4:] == ["--source", "s3://models/llama-8b", "--digest", S3_BASE["source"]["digest"]]
    config = EngineConfig.model_validate(yaml.safe_load(objects["ConfigMap/smollm2-engine"]["data"]["engine.yaml"]))
    assert config.node_cache_url == "http://smollm2-node-cache.loraplane-demo.svc:8090"
    assert str(config.model).startswith(str(config.node_cache_dir)) and config.base_name == S3_BASE["source"]["name"]
    who = objects["NetworkPolicy/smollm2-node-cache"]["spec"]["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": objects["Deployment/smollm2-serving"]["spec"]["selector"]["matchLabels"]}} in who


def test_without_the_node_cache_nothing_mounts_the_host() -> None:
    objects = built()
    assert not [k for k in objects if k.startswith("DaemonSet/")]
    serving = objects["Deployment/smollm2-serving"]["spec"]["template"]["spec"]
    assert not [v for v in serving["volumes"] if "hostPath" in v]


def test_the_router_holds_the_stats_token_and_nothing_that_can_change_a_replica() -> None:
    router = built()["Deployment/smollm2-router"]["spec"]["template"]["spec"]
    refs = [
        (e["name"], e["valueFrom"]["secretKeyRef"]) for c in router["containers"] for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    ]  # fmt: skip
    assert ("LORAPLANE_ADMIN_TOKEN", {"name": "smollm2-stats", "key": "stats-token"}) in refs
    assert not [r for _, r in refs if r["name"] == "smollm2-admin"]
    mounted = {v.get("secret", {}).get("secretName") for v in router.get("volumes", [])}
    assert "smollm2-admin" not in mounted


def test_the_router_watches_only_endpointslices_and_calls_the_serving_service() -> None:
    objects = built()
    role = objects["Role/smollm2-router"]
    watch = {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
    assert role["rules"] == [watch]
    pod = objects["Deployment/smollm2-router"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "smollm2-router"
    args = pod["containers"][0]["args"]
    assert args[:5] == ["router", "--service", "smollm2-serving", "--namespace", "loraplane-demo"]
    assert "--tenants" in args  # the same tenants file as the servers: keys and quotas checked at the edge
    selector = objects["Deployment/smollm2-router"]["spec"]["selector"]["matchLabels"]
    assert objects["Service/smollm2-router"]["spec"]["selector"] == selector
    no_router = copy.deepcopy(BASE["spec"])
    no_router["routing"] = {"replicas": 0, "affinity": False, "loadBound": 1.5}
    router = built(no_router)["Deployment/smollm2-router"]
    assert router["spec"]["replicas"] == 0
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--policy") :][:4] == ["--policy", "round-robin", "--epsilon", "0.5"]


def test_the_operators_cluster_role_covers_everything_it_creates_and_grants() -> None:
    rbac = yaml.safe_load((Path(__file__).parents[2] / "crds" / "rbac.yaml").read_text())
    rules = rbac["rules"]

    def allowed(group: str, resource: str, verb: str) -> bool:
        return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)

    plural = {"ConfigMap": "configmaps", "Deployment": "deployments", "Service": "services",
              "ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings",
              "PodDisruptionBudget": "poddisruptionbudgets", "NetworkPolicy": "networkpolicies"}  # fmt: skip
    for manifest in built().values():
        group = manifest["apiVersion"].rpartition("/")[0]
        assert allowed(group, plural[manifest["kind"]], "create") and allowed(group, plural[manifest["kind"]], "patch")
    for rule in built()["Role/smollm2-router"]["rules"]:  # Kubernetes refuses to let it grant more than it holds
        assert all(allowed(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"])


def test_a_changed_engine_config_rolls_the_serving_pods_and_an_unchanged_one_does_not() -> None:
    def template_hash(spec: dict) -> str:
        return built(spec)["Deployment/smollm2-serving"]["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH]

    bigger = copy.deepcopy(BASE["spec"])
    bigger["engine"]["maxLoras"] += 1
    assert template_hash(BASE["spec"]) == template_hash(copy.deepcopy(BASE["spec"]))
    assert template_hash(bigger) != template_hash(BASE["spec"])


def test_drains_take_down_one_serving_pod_and_one_router_at_a_time() -> None:
    objects = built()
    for name, deployment in (("smollm2-serving", "Deployment/smollm2-serving"), ("smollm2-router", "Deployment/smollm2-router")):
        budget = objects[f"PodDisruptionBudget/{name}"]["spec"]
        assert budget["maxUnavailable"] == 1
        assert budget["selector"]["matchLabels"] == objects[deployment]["spec"]["selector"]["matchLabels"]


def test_serving_and_router_pods_spool_usage_and_export_it_to_the_bucket() -> None:
    from loraplane.cli import main

    spec = copy.deepcopy(BASE["spec"])
    spec["usage"] = {"bucket": "billing", "prefix": "usage/prod", "segmentAgeSeconds": 30}
    objects = built(spec)
    for name in ("Deployment/smollm2-serving", "Deployment/smollm2-router"):
        pod = objects[name]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        assert env["LORAPLANE_USAGE_EXPORT"]["value"] == "s3://billing/usage/prod"
        assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["AWS_ENDPOINT_URL"]["value"] == BASE["spec"]["adapterStore"]["endpoint"]
        assert {"secretRef": {"name": "adapter-store"}} in container["envFrom"]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "usage")
        assert container["args"][container["args"].index("--usage-dir") + 1] == mount["mountPath"]
        assert {"name": "usage", "emptyDir": {"sizeLimit": "2Gi"}} in pod["volumes"]
        # The real command line accepts what the operator writes (less the files only a pod has).
        args = container["args"]
        files = {i + d for i, a in enumerate(args) if a in ("--config", "--tenants") for d in (0, 1)}
        command = main.get_command(None, args[0])  # type: ignore[arg-type]
        ctx = command.make_context(args[0], [a for i, a in enumerate(args[1:], 1) if i not in files])
        assert ctx.params["usage_dir"] == Path(mount["mountPath"]) and ctx.params["usage_segment_age"] == 30
    # Without a bucket the records still go to each pod's spool.
    container = built()["Deployment/smollm2-serving"]["spec"]["template"]["spec"]["containers"][0]
    assert "--usage-dir" in container["args"]
    assert "LORAPLANE_USAGE_EXPORT" not in {e["name"] for e in container["env"]}
