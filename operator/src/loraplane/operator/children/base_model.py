"""The objects a BaseModel owns, built as plain manifests: the engine config (ConfigMap), the serving
Deployment and its Service, and the router in front of them (``router_objects``). Pure functions
of the BaseModel, so tests check them against the Kubernetes schemas and the engine's own config
model without a cluster.

The engine config uses the server's setting names (vLLM's where the idea is the same); the test
`tests/operator/test_children.py` loads it with the real ``EngineConfig``, so the two cannot drift
apart silently.
"""

from __future__ import annotations

import hashlib
from typing import Any

import yaml
from kubernetes.utils import parse_quantity

from loraplane.admin_api import engine_sizing
from loraplane.operator.api.basemodel import BaseModelSpec
from loraplane.operator.children import node_cache
from loraplane.operator.children.names import (
    BASE_LABEL,
    COMPONENT_LABEL,
    METRICS_PORT,
    SERVING_PORT,
    STAGED_CONDITION,
    admin_token_env,
    stats_token_env,
)
from loraplane.operator.children.pod_security import CONTAINER_SECURITY, HOME_ENV, POD_SECURITY, TMP_MOUNT, TMP_VOLUME
from loraplane.operator.children.router import router_labels, router_objects
from loraplane.operator.children.usage_wiring import USAGE_DIR, USAGE_VOLUME, usage_wiring

CONFIG_HASH = "loraplane.dev/engine-config-sha256"


DEFAULT_DISK_CACHE_SIZE = "20Gi"  # the engine's own default (disk_cache_max_bytes)
CACHE_MARGIN_BYTES = 3 * 2**30  # one more adapter's largest files (2 GiB of weights), with margin


def labels(base: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "loraplane", COMPONENT_LABEL: "serving", BASE_LABEL: base}


def engine_config(spec: BaseModelSpec, name: str = "", namespace: str = "") -> dict[str, Any]:
    """``name`` and ``namespace`` (the BaseModel's) locate its node agent when the node cache is on."""
    uri = spec.source.uri  # an s3:// one comes with the node cache (the model's rule)
    e = spec.engine
    config: dict[str, Any] = {
        "model": node_cache.base_path(spec) if uri.startswith("s3://") else uri.removeprefix("file://"),
        "base_name": spec.source.name,
        "base_revision": spec.source.revision,
        "dtype": spec.source.dtype,
        "quantization": spec.source.quantization,
        # A pod that requests GPUs runs the engine on one, or fails at start if none is visible:
        # never silently on its CPU (what "auto" would do). Without GPUs it is a CPU pod.
        "device": "cuda" if spec.resources.gpus else "cpu",
        # The sizing knobs carry the engine's own names (one model, admin_api.engine_sizing).
        **e.model_dump(include=set(engine_sizing.EngineSizing.model_fields)),
        "disk_cache_max_bytes": disk_cache_bytes(spec),
        "s3_endpoint": spec.adapter_store.endpoint,
        "s3_region": spec.adapter_store.region,
        "cache_dir": "/var/cache/loraplane",
    }
    if spec.node_cache.enabled:
        config["node_cache_url"] = node_cache.agent_url(name, namespace)
        config["node_cache_dir"] = node_cache.NODE_CACHE_MOUNT
        config["s3_endpoint"] = config["s3_region"] = None  # the agent fetches; the pod holds no store settings
    return {k: v for k, v in config.items() if v is not None}


def config_hash(name: str, namespace: str, spec: BaseModelSpec, config: dict[str, Any] | None = None) -> str:
    """Of the engine config (``config``, by default the base's own) and the base's digest: a new
    digest for the same s3:// source is a new base, and the pods roll onto it (each waiting for its
    copy on its node)."""
    hashed = {"engine": config or engine_config(spec, name, namespace), "base_digest": spec.source.digest}
    return hashlib.sha256(yaml.safe_dump(hashed, sort_keys=True).encode()).hexdigest()


def disk_cache_bytes(spec: BaseModelSpec) -> int:
    """The engine's bound on its adapter cache. ``diskCacheSize: null`` gets the default: the
    cache's volume is bounded whatever it says (every scratch volume is, so the kubelet evicts the
    pod that overruns it and not every pod on a full node), and an engine bounded by less than its
    volume evicts files where one bounded by nothing would have its pod evicted."""
    return int(parse_quantity(spec.engine.disk_cache_size or DEFAULT_DISK_CACHE_SIZE))  # type: ignore[no-untyped-call]


def cache_size_limit(spec: BaseModelSpec) -> str:
    """The sizeLimit of a replica's cache volume: the adapter cache's bound (the engine counts a
    fetch's bytes against it as they land) and room for one more adapter's files beside it."""
    return str(disk_cache_bytes(spec) + CACHE_MARGIN_BYTES)


def config_map(name: str, namespace: str, spec: BaseModelSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-engine", "namespace": namespace, "labels": labels(name)},
        "data": {"engine.yaml": yaml.safe_dump(engine_config(spec, name, namespace), sort_keys=True)},
    }


def deployment(name: str, namespace: str, spec: BaseModelSpec, replicas: int | None = None) -> dict[str, Any]:
    """The serving Deployment. One manifest literal, as long as a Deployment is: read whole, it
    compares line by line with the Kubernetes schema it is tested against. ``replicas``: the
    shared pool's, when dedicated deployments take some of ``spec.replicas`` (default: all)."""
    r = spec.resources
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    if r.gpus:
        limits["nvidia.com/gpu"] = str(r.gpus)
    if r.cpu:
        requests["cpu"] = r.cpu
    if r.memory:
        requests["memory"] = limits["memory"] = r.memory
    args = ["serve", "--config", "/etc/loraplane/engine.yaml", "--host", "0.0.0.0", "--port", str(SERVING_PORT),
            "--metrics-port", str(METRICS_PORT)]  # fmt: skip
    usage_args, usage_env = usage_wiring(spec)
    args += usage_args
    mounts = [
        {"name": "engine", "mountPath": "/etc/loraplane", "readOnly": True},
        {"name": "cache", "mountPath": "/var/cache/loraplane"},
        {"name": "usage", "mountPath": USAGE_DIR},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "engine", "configMap": {"name": f"{name}-engine"}},
        {"name": "cache", "emptyDir": {"sizeLimit": cache_size_limit(spec)}},
        USAGE_VOLUME,
    ]
    if spec.tenancy.api_keys_secret is not None:
        args += ["--tenants", "/etc/loraplane-tenants/tenants.yaml"]
        mounts.append({"name": "tenants", "mountPath": "/etc/loraplane-tenants", "readOnly": True})
        volumes.append({"name": "tenants", "secret": {"secretName": spec.tenancy.api_keys_secret.name}})
    env: list[dict[str, Any]] = [
        admin_token_env(name),
        stats_token_env(name),
        # The operator and the router sign their admin calls for the pod's IP (admin_api.auth):
        # the replica refuses a signature made for any other address.
        {"name": "LORAPLANE_ADMIN_HOSTS", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        HOME_ENV,
        *usage_env,
    ]
    mounts.append(TMP_MOUNT)
    volumes.append(TMP_VOLUME)
    env_from = []
    # With a node cache the agent fetches adapters and the base: the pods need the store's
    # credentials only to export usage records.
    needs_store = not spec.node_cache.enabled or spec.usage.bucket is not None
    if spec.adapter_store.credentials_secret is not None and needs_store:
        env_from.append({"secretRef": {"name": spec.adapter_store.credentials_secret.name}})
    init_containers = []
    if spec.node_cache.enabled:
        volume, mount = node_cache.serving_volume(name, namespace, spec)
        volumes.append(volume)
        mounts.append(mount)
        if spec.source.uri.startswith("s3://"):
            init_containers.append(node_cache.wait_for_base(r.image, spec.source.uri, spec.source.digest))
    probe = {"httpGet": {"path": "/ready", "port": SERVING_PORT}, "periodSeconds": 5}
    container: dict[str, Any] = {
        "name": "serving",
        "image": r.image,
        "args": args,
        "ports": [{"name": "http", "containerPort": SERVING_PORT}, {"name": "metrics", "containerPort": METRICS_PORT}],
        "env": env,
        "envFrom": env_from,
        "readinessProbe": probe,
        "startupProbe": {**probe, "failureThreshold": 120},  # a first start converts the base
        "livenessProbe": {"httpGet": {"path": "/health", "port": SERVING_PORT}, "periodSeconds": 10},
        "resources": {"limits": limits, "requests": requests},
        "volumeMounts": mounts,
        "securityContext": CONTAINER_SECURITY,
    }
    pod_spec: dict[str, Any] = {
        "securityContext": POD_SECURITY,
        **({"initContainers": init_containers} if init_containers else {}),
        "containers": [container],
        "volumes": volumes,
        "readinessGates": [{"conditionType": STAGED_CONDITION}],
        "terminationGracePeriodSeconds": 60,  # graceful shutdown finishes in-flight requests
    }
    if r.node_selector:
        pod_spec["nodeSelector"] = r.node_selector
    if r.tolerations:
        pod_spec["tolerations"] = [t.body() for t in r.tolerations]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"{name}-serving", "namespace": namespace, "labels": labels(name)},
        "spec": {
            "replicas": spec.replicas if replicas is None else replicas,
            "selector": {"matchLabels": labels(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            # The config's hash on the pod template: a changed engine config rolls the pods, which
            # would otherwise keep running with the settings they started with.
            "template": {
                "metadata": {"labels": labels(name), "annotations": {CONFIG_HASH: config_hash(name, namespace, spec)}},
                "spec": pod_spec,
            },
        },
    }


def service(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{name}-serving", "namespace": namespace, "labels": labels(name)},
        "spec": {
            "selector": labels(name),
            "ports": [
                {"name": "http", "port": SERVING_PORT, "targetPort": "http"},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"},
            ],
        },
    }


def disruption_budget(name: str, namespace: str, selector: dict[str, str]) -> dict[str, Any]:
    """At most one pod of the set down at a time for voluntary disruptions (node drains): the
    others keep serving, and the router moves their adapters' traffic to them."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": namespace, "labels": selector},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
    }


def metrics_ingress(metrics_namespaces: list[str] | None) -> dict[str, Any]:
    """The metrics port's ingress rule: from the namespaces Prometheus runs in when they are named
    (the series name adapters and tenants), from anywhere otherwise."""
    rule: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": "metrics"}]}
    if metrics_namespaces:
        names = {"key": "kubernetes.io/metadata.name", "operator": "In", "values": sorted(metrics_namespaces)}
        rule["from"] = [{"namespaceSelector": {"matchExpressions": [names]}}]
    return rule


def network_policy(
    name: str, namespace: str, operator_namespace: str | None, metrics_namespaces: list[str] | None = None
) -> dict[str, Any]:
    """Who reaches the serving pods: the API port (completions and the admin calls) only from this
    base's routers and from the operator, the metrics port from ``metrics_ingress``. Clients
    reach the adapters through the router, which checks keys and quotas at the edge; the admin
    token stays needed all the same. Without ``operator_namespace`` (an operator run outside the
    chart) the operator's pods are admitted from any namespace. Enforced where the cluster's
    network plugin implements NetworkPolicy."""
    operator: dict[str, Any] = {"podSelector": {"matchLabels": {COMPONENT_LABEL: "operator"}}}
    operator["namespaceSelector"] = (
        {"matchLabels": {"kubernetes.io/metadata.name": operator_namespace}} if operator_namespace else {}
    )
    api = {
        "from": [{"podSelector": {"matchLabels": router_labels(name)}}, operator],
        "ports": [{"protocol": "TCP", "port": "http"}],
    }
    return _ingress_policy(f"{name}-serving", namespace, labels(name), [api, metrics_ingress(metrics_namespaces)])


def node_cache_network_policy(
    name: str, namespace: str, operator_namespace: str | None, metrics_namespaces: list[str] | None = None
) -> dict[str, Any]:
    """Who reaches the node agents: this base's serving pods and the operator, on the API port."""
    operator: dict[str, Any] = {"podSelector": {"matchLabels": {COMPONENT_LABEL: "operator"}}}
    operator["namespaceSelector"] = (
        {"matchLabels": {"kubernetes.io/metadata.name": operator_namespace}} if operator_namespace else {}
    )
    api = {"from": [{"podSelector": {"matchLabels": labels(name)}}, operator], "ports": [{"protocol": "TCP", "port": "http"}]}
    pods = node_cache.node_cache_labels(name)
    return _ingress_policy(f"{name}-node-cache", namespace, pods, [api, metrics_ingress(metrics_namespaces)])


def router_network_policy(name: str, namespace: str, metrics_namespaces: list[str]) -> dict[str, Any]:
    """The routers' API port is the base's front door, open to every client; their metrics port
    only from the named namespaces."""
    api = {"ports": [{"protocol": "TCP", "port": "http"}]}
    return _ingress_policy(f"{name}-router", namespace, router_labels(name), [api, metrics_ingress(metrics_namespaces)])


def _ingress_policy(name: str, namespace: str, pods: dict[str, str], ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace, "labels": pods},
        "spec": {"podSelector": {"matchLabels": pods}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def children(
    name: str,
    namespace: str,
    spec: BaseModelSpec,
    operator_namespace: str | None = None,
    metrics_namespaces: list[str] | None = None,
    dedicated_replicas: int = 0,
) -> list[dict[str, Any]]:
    """Everything a BaseModel owns. ``metrics_namespaces``: where Prometheus may scrape from (the
    routers get a NetworkPolicy of their own only then: without it theirs would admit everyone).
    ``dedicated_replicas``: what the dedicated deployments of its adapters take out of the pool."""
    shared = deployment(name, namespace, spec, max(spec.replicas - dedicated_replicas, min(spec.replicas, 1)))
    serving = [config_map(name, namespace, spec), shared, service(name, namespace)]
    serving.append(disruption_budget(f"{name}-serving", namespace, labels(name)))
    serving.append(network_policy(name, namespace, operator_namespace, metrics_namespaces))
    if spec.node_cache.enabled:
        serving += [node_cache.daemon_set(name, namespace, spec), node_cache.service(name, namespace)]
        serving.append(node_cache_network_policy(name, namespace, operator_namespace, metrics_namespaces))
    router = router_objects(name, namespace, spec)
    router.append(disruption_budget(f"{name}-router", namespace, router_labels(name)))
    if metrics_namespaces:
        router.append(router_network_policy(name, namespace, metrics_namespaces))
    return serving + router
