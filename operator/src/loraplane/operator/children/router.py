"""The router a BaseModel owns: its Deployment and Service (the endpoint clients call), and the
ServiceAccount with a Role that lets it watch the serving Service's EndpointSlices, nothing more.

The router runs from the serving image (`loraplane router`), finds the replicas through the
EndpointSlices of ``<base>-serving``, and reads their stats with the stack's admin token.
``routing.replicas: 0`` scales it away and clients call the serving Service directly.
"""

from __future__ import annotations

from typing import Any

from loraplane.operator.api.basemodel import BaseModelSpec
from loraplane.operator.children.names import BASE_LABEL, COMPONENT_LABEL, METRICS_PORT, SERVING_PORT, stats_token_env
from loraplane.operator.children.pod_security import CONTAINER_SECURITY, HOME_ENV, POD_SECURITY, TMP_MOUNT, TMP_VOLUME
from loraplane.operator.children.usage_wiring import USAGE_DIR, USAGE_VOLUME, usage_wiring

ROUTER_PORT = 8000


def router_labels(base: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "loraplane", COMPONENT_LABEL: "router", BASE_LABEL: base}


def _meta(name: str, namespace: str, base: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": router_labels(base)}


def router_access(base: str, namespace: str) -> list[dict[str, Any]]:
    who = f"{base}-router"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(who, namespace, base)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(who, namespace, base),
            "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _meta(who, namespace, base),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": who},
            "subjects": [{"kind": "ServiceAccount", "name": who, "namespace": namespace}],
        },
    ]  # fmt: skip


def router_deployment(base: str, namespace: str, spec: BaseModelSpec) -> dict[str, Any]:
    routing = spec.routing
    args = [
        "router", "--service", f"{base}-serving", "--namespace", namespace, "--host", "0.0.0.0", "--port", str(ROUTER_PORT),
        "--metrics-port", str(METRICS_PORT),
        "--policy", "affinity" if routing.affinity else "round-robin", "--epsilon", f"{routing.load_bound - 1:g}",
    ]  # fmt: skip
    usage_args, usage_env = usage_wiring(spec)  # its edge refusals are billing records too
    args += usage_args
    mounts: list[dict[str, Any]] = [{"name": "usage", "mountPath": USAGE_DIR}]
    volumes: list[dict[str, Any]] = [USAGE_VOLUME]
    secret = spec.adapter_store.credentials_secret
    env_from = [{"secretRef": {"name": secret.name}}] if secret is not None else []
    if spec.tenancy.api_keys_secret is not None:  # the servers' own tenants file: one config
        args += ["--tenants", "/etc/loraplane-tenants/tenants.yaml"]
        mounts.append({"name": "tenants", "mountPath": "/etc/loraplane-tenants", "readOnly": True})
        volumes.append({"name": "tenants", "secret": {"secretName": spec.tenancy.api_keys_secret.name}})
    probe = {"httpGet": {"path": "/health", "port": ROUTER_PORT}, "periodSeconds": 10}
    container = {
        "name": "router",
        "image": spec.resources.image,
        "args": args,
        "ports": [{"name": "http", "containerPort": ROUTER_PORT}, {"name": "metrics", "containerPort": METRICS_PORT}],
        "env": [
            stats_token_env(base, "LORAPLANE_ADMIN_TOKEN"),
            HOME_ENV,
            *usage_env,
        ],
        "envFrom": env_from if spec.usage.bucket else [],
        "readinessProbe": {**probe, "httpGet": {"path": "/ready", "port": ROUTER_PORT}, "periodSeconds": 5},
        "livenessProbe": probe,
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}},
        "volumeMounts": [*mounts, TMP_MOUNT],
        "securityContext": CONTAINER_SECURITY,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(f"{base}-router", namespace, base),
        "spec": {
            "replicas": routing.replicas,
            "selector": {"matchLabels": router_labels(base)},
            "template": {
                "metadata": {"labels": router_labels(base)},
                "spec": {
                    "serviceAccountName": f"{base}-router",
                    "securityContext": POD_SECURITY,
                    "containers": [container],
                    "volumes": [*volumes, TMP_VOLUME],
                },
            },
        },
    }


def router_service(base: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(f"{base}-router", namespace, base),
        "spec": {
            "selector": router_labels(base),
            "ports": [
                {"name": "http", "port": SERVING_PORT, "targetPort": "http"},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"},
            ],
        },
    }


def router_objects(base: str, namespace: str, spec: BaseModelSpec) -> list[dict[str, Any]]:
    deployment = router_deployment(base, namespace, spec)
    return [*router_access(base, namespace), deployment, router_service(base, namespace)]
