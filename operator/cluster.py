"""Reads and writes of Kubernetes objects other than the one a handler was called for.

kopf hands each handler its own object and patches its status; everything else (the BaseModel an
adapter names, the serving Pods, Secrets, other adapters' statuses from a BaseModel's timer) goes
through the official ``kubernetes`` client. It is synchronous, so every call runs in a thread.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from functools import cache
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from loraplane.operator.api import GROUP, VERSION

BASE_LABEL = "loraplane.dev/base-model"
COMPONENT_LABEL = "app.kubernetes.io/component"
ADMIN_URL_ANNOTATION = "loraplane.dev/admin-url"  # overrides http://<podIP>:<port>; tests point it at loopback
SERVING_PORT = 8000
METRICS_PORT = 9090  # /metrics alone (`--metrics-port`): what Prometheus scrapes, not the API


@cache
def _api() -> client.ApiClient:
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    return client.ApiClient()


def _custom() -> client.CustomObjectsApi:
    return client.CustomObjectsApi(_api())


def _core() -> client.CoreV1Api:
    return client.CoreV1Api(_api())


async def get_custom(namespace: str, plural: str, name: str) -> dict[str, Any] | None:
    def read() -> dict[str, Any] | None:
        try:
            obj: Any = _custom().get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return dict(obj)

    return await asyncio.to_thread(read)


async def list_custom(namespace: str, plural: str) -> list[dict[str, Any]]:
    def read() -> list[dict[str, Any]]:
        found: Any = _custom().list_namespaced_custom_object(GROUP, VERSION, namespace, plural)
        return list(found["items"])

    return await asyncio.to_thread(read)


async def patch_status(namespace: str, plural: str, name: str, status: dict[str, Any]) -> None:
    def write() -> None:
        _custom().patch_namespaced_custom_object_status(GROUP, VERSION, namespace, plural, name, {"status": status})

    await asyncio.to_thread(write)


async def read_secret(namespace: str, name: str) -> dict[str, str]:
    def read() -> dict[str, str]:
        secret = _core().read_namespaced_secret(name, namespace)
        return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}

    return await asyncio.to_thread(read)


async def apply_child(manifest: dict[str, Any]) -> None:
    """Create the object, or patch it to the manifest when it exists (a spec change rolls out)."""

    def write() -> None:
        kind, ns, name = manifest["kind"], manifest["metadata"]["namespace"], manifest["metadata"]["name"]
        apps, core, rbac, policy, networking = (
            client.AppsV1Api(_api()),
            _core(),
            client.RbacAuthorizationV1Api(_api()),
            client.PolicyV1Api(_api()),
            client.NetworkingV1Api(_api()),
        )
        create: Any
        patch: Any
        create, patch = {
            "Deployment": (apps.create_namespaced_deployment, apps.patch_namespaced_deployment),
            "Service": (core.create_namespaced_service, core.patch_namespaced_service),
            "ConfigMap": (core.create_namespaced_config_map, core.patch_namespaced_config_map),
            "ServiceAccount": (core.create_namespaced_service_account, core.patch_namespaced_service_account),
            "Role": (rbac.create_namespaced_role, rbac.patch_namespaced_role),
            "RoleBinding": (rbac.create_namespaced_role_binding, rbac.patch_namespaced_role_binding),
            "PodDisruptionBudget": (
                policy.create_namespaced_pod_disruption_budget,
                policy.patch_namespaced_pod_disruption_budget,
            ),
            "NetworkPolicy": (networking.create_namespaced_network_policy, networking.patch_namespaced_network_policy),
        }[kind]
        try:
            create(ns, manifest)
        except ApiException as err:
            if err.status != 409:
                raise
            patch(name, ns, manifest)

    await asyncio.to_thread(write)


@dataclass(frozen=True)
class Replica:
    name: str
    url: str


def _ready(pod: Any) -> bool:
    conditions = (pod.status.conditions if pod.status else None) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


async def ready_replicas(namespace: str, base: str) -> list[Replica]:
    """The serving Pods of ``base`` that report Ready, with their admin URLs, by name."""

    def read() -> list[Replica]:
        selector = f"{BASE_LABEL}={base},{COMPONENT_LABEL}=serving"
        pods: list[Any] = _core().list_namespaced_pod(namespace, label_selector=selector).items
        out = []
        for pod in pods:
            labels = pod.metadata.labels or {}
            if labels.get(BASE_LABEL) != base or labels.get(COMPONENT_LABEL) != "serving" or not _ready(pod):
                continue  # filtered here too: not every API emulator honours label selectors
            url = (pod.metadata.annotations or {}).get(ADMIN_URL_ANNOTATION)
            if url is None and pod.status and pod.status.pod_ip:
                url = f"http://{pod.status.pod_ip}:{SERVING_PORT}"
            if url:
                out.append(Replica(pod.metadata.name, url))
        return sorted(out, key=lambda r: r.name)

    return await asyncio.to_thread(read)
