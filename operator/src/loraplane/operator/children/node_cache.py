"""The node cache a BaseModel owns when ``nodeCache.enabled``: the agent's DaemonSet, a Service that
keeps each pod's calls on its own node (``internalTrafficPolicy: Local``), and a NetworkPolicy.

Per BaseModel, not one chart-wide DaemonSet: the agent must run exactly where this base's pods run
(the BaseModel's node selector and tolerations), hold this base's admin token and object-store
credentials and no other's, and keep this base's files in a folder of their own
(``<hostPath>/<namespace>/<name>``), so two namespaces' BaseModels on one node share nothing.

The agent runs as the images' non-root user; a hostPath folder the kubelet creates belongs to root,
so a short init container (root, with CHOWN alone) hands it over first. The serving pods mount the
same folder read-only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubernetes.utils import parse_quantity

from loraplane.node_cache.base_copy import published_path
from loraplane.operator.api.basemodel import BaseModelSpec
from loraplane.operator.children.names import BASE_LABEL, COMPONENT_LABEL, METRICS_PORT, admin_token_env, node_cache_token_env
from loraplane.operator.children.pod_security import CONTAINER_SECURITY, HOME_ENV, POD_SECURITY, TMP_MOUNT, TMP_VOLUME

AGENT_PORT = 8090
NODE_CACHE_MOUNT = "/var/lib/loraplane-node"  # where the agent and the serving pods see the node's folder
IMAGE_USER = 10001  # the images' user (docker/*.Dockerfile)


def node_cache_labels(base: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "loraplane", COMPONENT_LABEL: "node-cache", BASE_LABEL: base}


def host_folder(name: str, namespace: str, spec: BaseModelSpec) -> str:
    return f"{spec.node_cache.host_path.rstrip('/')}/{namespace}/{name}"


def service_host(name: str, namespace: str) -> str:
    return f"{name}-node-cache.{namespace}.svc"


def agent_url(name: str, namespace: str) -> str:
    """The agent on the calling pod's own node: the Service routes to local endpoints only."""
    return f"http://{service_host(name, namespace)}:{AGENT_PORT}"


def base_path(spec: BaseModelSpec) -> str:
    """Where a serving pod opens an s3:// base: its verified copy as the agent publishes it."""
    return str(published_path(Path(NODE_CACHE_MOUNT), spec.source.uri))


def serving_volume(name: str, namespace: str, spec: BaseModelSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """The serving pods' (volume, read-only mount) of the node's folder."""
    volume = {"name": "node-cache", "hostPath": {"path": host_folder(name, namespace, spec), "type": "DirectoryOrCreate"}}
    return volume, {"name": "node-cache", "mountPath": NODE_CACHE_MOUNT, "readOnly": True}


def wait_for_base(image: str, source: str, digest: str | None) -> dict[str, Any]:
    """The serving pods' init container: it returns once the verified copy of ``source`` (the
    base's, or a dedicated deployment's merged model) is published on the node."""
    return {
        "name": "wait-for-base",
        "image": image,
        "args": ["node-agent", "--cache-dir", NODE_CACHE_MOUNT, "wait-base", "--source", source]
        + (["--digest", digest] if digest else []),
        "volumeMounts": [{"name": "node-cache", "mountPath": NODE_CACHE_MOUNT, "readOnly": True}],
        "securityContext": CONTAINER_SECURITY,
    }


def _scheduling(spec: BaseModelSpec) -> dict[str, Any]:
    r = spec.resources
    out: dict[str, Any] = {}
    if r.node_selector:
        out["nodeSelector"] = r.node_selector
    if r.tolerations:
        out["tolerations"] = [t.body() for t in r.tolerations]
    return out


def daemon_set(name: str, namespace: str, spec: BaseModelSpec) -> dict[str, Any]:
    cache = spec.node_cache
    image = cache.image or spec.resources.image
    args = [
        "node-agent", "--cache-dir", NODE_CACHE_MOUNT, "--host", "0.0.0.0", "--port", str(AGENT_PORT),
        "--metrics-port", str(METRICS_PORT), "--max-bytes", str(int(parse_quantity(cache.size))),  # type: ignore[no-untyped-call]
    ]  # fmt: skip
    if spec.source.uri.startswith("s3://"):
        args += ["--base-source", spec.source.uri]
        if spec.source.digest:
            args += ["--base-digest", spec.source.digest]
    for tenant in spec.tenancy.tenants or []:  # pods may have fetched only what the tenants may publish
        for prefix in tenant.sources:
            args += ["--allowed-source", prefix]
    env: list[dict[str, Any]] = [
        admin_token_env(name),
        node_cache_token_env(name),
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        # Signed calls (admin_api.auth) must name the agent: the operator dials the pod's IP, the
        # serving pods the Service; a signature captured by a pod posing as either is refused.
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "LORAPLANE_ADMIN_HOSTS", "value": f"$(POD_IP) {service_host(name, namespace)}"},
        HOME_ENV,
    ]
    store = spec.adapter_store
    env += [{"name": k, "value": v} for k, v in (("AWS_ENDPOINT_URL", store.endpoint), ("AWS_REGION", store.region)) if v]
    env_from = [{"secretRef": {"name": store.credentials_secret.name}}] if store.credentials_secret else []
    mount = {"name": "node-cache", "mountPath": NODE_CACHE_MOUNT}
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10}
    prepare = {
        "name": "own-cache-folder",
        "image": image,
        "command": ["chown", f"{IMAGE_USER}:{IMAGE_USER}", NODE_CACHE_MOUNT],
        "volumeMounts": [mount],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
        "securityContext": {
            **CONTAINER_SECURITY,
            "runAsNonRoot": False,
            "runAsUser": 0,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
        },
    }
    agent = {
        "name": "node-cache",
        "image": image,
        "args": args,
        "ports": [{"name": "http", "containerPort": AGENT_PORT}, {"name": "metrics", "containerPort": METRICS_PORT}],
        "env": env,
        "envFrom": env_from,
        "readinessProbe": probe,
        "livenessProbe": probe,
        "volumeMounts": [mount, TMP_MOUNT],
        "securityContext": {**CONTAINER_SECURITY, "runAsNonRoot": True, "runAsUser": IMAGE_USER},
        # One on every serving node: bounded, so a bug or a hostile caller costs this pod alone.
        "resources": {"requests": {"cpu": "50m", "memory": cache.memory}, "limits": {"memory": cache.memory}},
    }
    volume = {"name": "node-cache", "hostPath": {"path": host_folder(name, namespace, spec), "type": "DirectoryOrCreate"}}
    pod_spec = {
        "securityContext": {"seccompProfile": POD_SECURITY["seccompProfile"]},  # runAsNonRoot per container: see prepare
        "initContainers": [prepare],
        "containers": [agent],
        "volumes": [volume, TMP_VOLUME],
        "automountServiceAccountToken": False,  # the agent calls no Kubernetes API
        **_scheduling(spec),
    }
    labels = node_cache_labels(name)
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": f"{name}-node-cache", "namespace": namespace, "labels": labels},
        "spec": {
            "selector": {"matchLabels": labels},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def service(name: str, namespace: str) -> dict[str, Any]:
    labels = node_cache_labels(name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{name}-node-cache", "namespace": namespace, "labels": labels},
        "spec": {
            "selector": labels,
            "internalTrafficPolicy": "Local",  # a pod reaches its own node's agent, never another node's
            "ports": [
                {"name": "http", "port": AGENT_PORT, "targetPort": "http"},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"},
            ],
        },
    }
