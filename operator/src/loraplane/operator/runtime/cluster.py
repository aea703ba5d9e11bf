"""Reads and writes of Kubernetes objects other than the one a handler was called for.

kopf hands each handler its own object and patches its status; everything else (the BaseModel an
adapter names, the serving Pods, Secrets, other adapters' statuses from a BaseModel's timer) goes
through the official ``kubernetes`` client. It is synchronous, so every call runs in a thread.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from loraplane.operator.api import GROUP, VERSION
from loraplane.operator.children.names import (
    ADMIN_TOKEN_KEY,
    BASE_LABEL,
    COMPONENT_LABEL,
    NODE_CACHE_TOKEN_KEY,
    SERVING_PORT,
    STAGED_CONDITION,
    STATS_TOKEN_KEY,
    admin_secret_name,
    node_cache_secret_name,
    stats_secret_name,
)  # fmt: skip
from loraplane.operator.runtime.conditions import now_rfc3339

FIELD_MANAGER = "loraplane-operator"  # server-side apply's owner of what the operator sets on its children
RETIRE_MANAGER = "loraplane-operator-retire"  # the node-selector key that parks a node cache's DaemonSet
# The Python client's name, under which operators before server-side apply wrote their children.
LEGACY_MANAGER = "OpenAPI-Generator"
ADMIN_TOKEN_TTL = 60.0  # seconds a token read from its Secret is reused before it is read again


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


async def patch_status(
    namespace: str, plural: str, name: str, status: dict[str, Any], resource_version: str | None = None
) -> None:
    """``resource_version``: write only over that version of the object (else 409), for a patch
    that replaces a list read from it."""
    body: dict[str, Any] = {"status": status}
    if resource_version is not None:
        body["metadata"] = {"resourceVersion": resource_version}

    def write() -> None:
        _custom().patch_namespaced_custom_object_status(GROUP, VERSION, namespace, plural, name, body)

    await asyncio.to_thread(write)


async def annotate(namespace: str, plural: str, name: str, annotations: dict[str, str]) -> None:
    """Merge ``annotations`` into the object's metadata (a change every watcher sees)."""

    def write() -> None:
        body = {"metadata": {"annotations": annotations}}
        _custom().patch_namespaced_custom_object(GROUP, VERSION, namespace, plural, name, body)

    await asyncio.to_thread(write)


async def ensure_admin_secret(namespace: str, base: str, owner: Mapping[str, Any]) -> None:
    """Create the BaseModel's admin-token and stats-token Secrets with random tokens, owned by the
    BaseModel, unless they exist. An existing one is never rewritten: its replicas already hold
    that token (and a user may bring their own, from External Secrets or GitOps)."""
    for name, key, component in (
        (admin_secret_name(base), ADMIN_TOKEN_KEY, "admin-token"),
        (stats_secret_name(base), STATS_TOKEN_KEY, "stats-token"),
        (node_cache_secret_name(base), NODE_CACHE_TOKEN_KEY, "node-cache-token"),
    ):
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {BASE_LABEL: base, COMPONENT_LABEL: component, "app.kubernetes.io/managed-by": "loraplane"},
                "ownerReferences": [dict(owner)],
            },
            "stringData": {key: secrets.token_urlsafe(36)},
        }
        await asyncio.to_thread(_create_unless_present, namespace, body)


def _create_unless_present(namespace: str, body: dict[str, Any]) -> None:
    try:
        _core().create_namespaced_secret(namespace, body)  # type: ignore[arg-type]  # it serialises dicts as they are
    except ApiException as err:
        if err.status != 409:
            raise


_TOKENS: dict[tuple[str, str], tuple[float, str | None]] = {}


async def admin_token(namespace: str, base: str) -> str | None:
    """The bearer token of ``base``'s replicas, from its Secret (None until the operator created it),
    cached for ``ADMIN_TOKEN_TTL`` so that a sync of many adapters reads it once."""
    return await _token(namespace, admin_secret_name(base), ADMIN_TOKEN_KEY)


async def node_cache_token(namespace: str, base: str) -> str | None:
    """The token ``base``'s node agents take for staging and state (cached as the admin token)."""
    return await _token(namespace, node_cache_secret_name(base), NODE_CACHE_TOKEN_KEY)


async def _token(namespace: str, secret: str, key: str) -> str | None:
    now = time.monotonic()
    cached = _TOKENS.get((namespace, secret))
    if cached is not None and now - cached[0] < ADMIN_TOKEN_TTL:
        return cached[1]
    try:
        token = (await read_secret(namespace, secret)).get(key) or None
    except ApiException as err:
        if err.status != 404:
            raise
        return None  # not created yet: not remembered, so the token is read as soon as it exists
    _TOKENS[(namespace, secret)] = (now, token)
    return token


async def read_secret(namespace: str, name: str) -> dict[str, str]:
    def read() -> dict[str, str]:
        secret = _core().read_namespaced_secret(name, namespace)
        return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}

    return await asyncio.to_thread(read)


RETIRED_LABEL = "loraplane.dev/retired"  # no node carries it: a DaemonSet that selects it runs nowhere


async def retire_daemon_set(namespace: str, name: str, retired: bool = True) -> None:
    """Stop a DaemonSet's pods without deleting it (the operator holds no delete verb: what a
    BaseModel owns goes with it, by its owner reference): its pods must also run on nodes labelled
    ``RETIRED_LABEL``, which none is. ``retired`` False takes the label off again (a strategic
    merge of the full manifest keeps a map key it does not name). Absent, or already so, is fine."""

    def write() -> None:
        apps = client.AppsV1Api(_api())
        try:
            current: Any = apps.read_namespaced_daemon_set(name, namespace)
        except ApiException as err:
            if err.status == 404:
                return
            raise
        if (RETIRED_LABEL in (current.spec.template.spec.node_selector or {})) == retired:
            return
        patch = {"spec": {"template": {"spec": {"nodeSelector": {RETIRED_LABEL: "true" if retired else None}}}}}
        apps.patch_namespaced_daemon_set(name, namespace, patch, field_manager=RETIRE_MANAGER)

    await asyncio.to_thread(write)


@dataclass(frozen=True)
class DedicatedDeployment:
    """A dedicated deployment as its Deployment says: whose, how many pods wanted and ready."""

    name: str
    adapter: str
    replicas: int
    ready: int


async def dedicated_deployments(namespace: str, base: str, label: str) -> list[DedicatedDeployment]:
    """``base``'s Deployments that carry ``label`` (the adapter each serves merged)."""

    def read() -> list[DedicatedDeployment]:
        selector = f"{BASE_LABEL}={base},{label}"
        items: list[Any] = client.AppsV1Api(_api()).list_namespaced_deployment(namespace, label_selector=selector).items
        out = []
        for d in items:
            labels = d.metadata.labels or {}
            if labels.get(BASE_LABEL) != base or not labels.get(label):
                continue  # filtered here too, as ready_pods does
            ready = (d.status.ready_replicas if d.status else None) or 0
            out.append(DedicatedDeployment(d.metadata.name, labels[label], d.spec.replicas or 0, ready))
        return sorted(out, key=lambda d: d.name)

    return await asyncio.to_thread(read)


async def scale_deployment(namespace: str, name: str, replicas: int, field_manager: str) -> None:
    """``spec.replicas`` of a Deployment, unless it is so already."""

    def write() -> None:
        apps = client.AppsV1Api(_api())
        current: Any = apps.read_namespaced_deployment(name, namespace)
        if current.spec.replicas != replicas:
            apps.patch_namespaced_deployment(name, namespace, {"spec": {"replicas": replicas}}, field_manager=field_manager)

    await asyncio.to_thread(write)


async def delete_children(namespace: str, deployment: str, service: str, config_map: str) -> None:
    """A dedicated deployment's objects, deleted (absent is fine). The Deployment goes first: its
    pods end gracefully, finishing what they hold, while the router sends new requests to the
    shared pool as each leaves the Service."""

    def write() -> None:
        apps: Any = client.AppsV1Api(_api())  # the client is untyped
        core: Any = _core()
        calls = [
            (apps.delete_namespaced_deployment, deployment),
            (core.delete_namespaced_service, service),
            (core.delete_namespaced_config_map, config_map),
        ]
        for call, name in calls:
            try:
                call(name, namespace)
            except ApiException as err:
                if err.status != 404:
                    raise

    await asyncio.to_thread(write)


@dataclass(frozen=True)
class JobOutcome:
    """A Job as the operator reads it: ``running`` (or pending), ``succeeded`` with its pod's
    termination message, or ``failed`` with the reason Kubernetes gives."""

    state: str
    message: str = ""


async def job_outcome(namespace: str, name: str) -> JobOutcome | None:
    """The Job's outcome; None when there is no such Job."""

    def read() -> JobOutcome | None:
        batch: Any = client.BatchV1Api(_api())
        try:
            job = batch.read_namespaced_job(name, namespace)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        for c in (job.status.conditions if job.status else None) or []:
            if c.status != "True":
                continue
            if c.type == "Complete":
                pods: Any = _core().list_namespaced_pod(namespace, label_selector=f"job-name={name}").items
                for pod in pods:
                    for status in (pod.status.container_statuses if pod.status else None) or []:
                        done = status.state.terminated if status.state else None
                        if done is not None and done.exit_code == 0:
                            return JobOutcome("succeeded", (done.message or "").strip())
                return JobOutcome("succeeded")  # its pod is gone (garbage-collected): no message to read
            if c.type == "Failed":
                return JobOutcome("failed", f"{c.reason or 'Failed'}: {c.message or ''}".strip())
        return JobOutcome("running")

    return await asyncio.to_thread(read)


async def create_job(manifest: dict[str, Any]) -> None:
    """A Job, created unless one of its name exists (a Job's pod template cannot be changed)."""

    def write() -> None:
        batch: Any = client.BatchV1Api(_api())
        try:
            batch.create_namespaced_job(manifest["metadata"]["namespace"], manifest, field_manager=FIELD_MANAGER)
        except ApiException as err:
            if err.status != 409:
                raise

    await asyncio.to_thread(write)


async def delete_jobs(namespace: str, selector: str, keep: set[str]) -> None:
    """The Jobs matching ``selector`` but ``keep``'s, deleted with their pods."""

    def write() -> None:
        batch: Any = client.BatchV1Api(_api())
        for job in batch.list_namespaced_job(namespace, label_selector=selector).items:
            if job.metadata.name in keep:
                continue
            try:
                batch.delete_namespaced_job(job.metadata.name, namespace, propagation_policy="Background")
            except ApiException as err:
                if err.status != 404:
                    raise

    await asyncio.to_thread(write)


async def apply_child(manifest: dict[str, Any]) -> None:
    """The manifest, server-side applied as :data:`FIELD_MANAGER`: created when absent; when it
    exists, set to the manifest, and every field the operator set before and sets no more is
    removed. The strategic-merge patch this replaced kept them: a BaseModel's node cache turned off
    left its volume and node selector in the serving Deployment, whose pods then stayed Pending on
    nodes without the label (found on the one-node cluster). Fields others own (the API server's
    defaults, a label someone added) stay theirs; ``force``, because what the operator sets is its
    own to say. A child an operator before this one wrote is first made the applier's
    (:func:`_adopt_legacy_fields`), or what it set would stay for good."""

    def write() -> None:
        kind, ns, name = manifest["kind"], manifest["metadata"]["namespace"], manifest["metadata"]["name"]
        apps, core, rbac, policy, networking = (
            client.AppsV1Api(_api()),
            _core(),
            client.RbacAuthorizationV1Api(_api()),
            client.PolicyV1Api(_api()),
            client.NetworkingV1Api(_api()),
        )
        patch: Any = {
            "Deployment": apps.patch_namespaced_deployment,
            "DaemonSet": apps.patch_namespaced_daemon_set,
            "Service": core.patch_namespaced_service,
            "ConfigMap": core.patch_namespaced_config_map,
            "ServiceAccount": core.patch_namespaced_service_account,
            "Role": rbac.patch_namespaced_role,
            "RoleBinding": rbac.patch_namespaced_role_binding,
            "PodDisruptionBudget": policy.patch_namespaced_pod_disruption_budget,
            "NetworkPolicy": networking.patch_namespaced_network_policy,
        }[kind]

        def apply() -> Any:
            return patch(name, ns, manifest, field_manager=FIELD_MANAGER, force=True,
                         _content_type="application/apply-patch+yaml")  # fmt: skip

        if _adopt_legacy_fields(apply(), patch, name, ns):
            apply()  # now the applier's, what it no longer sets goes

    await asyncio.to_thread(write)


def _adopt_legacy_fields(written: Any, patch: Any, name: str, namespace: str) -> bool:
    """What :data:`LEGACY_MANAGER` set on a child (as ``written`` by the apply just made) becomes
    :data:`FIELD_MANAGER`'s, as client-go's ``csaupgrade`` does for kubectl: its managed-fields
    entries merged into the applier's, in a JSON patch conditioned on the object's resourceVersion.
    True when there was something to adopt (the caller applies again, which then removes what the
    operator no longer sets); after that, the apply's own answer shows nothing legacy, so the
    steady state costs no extra call."""
    entries: list[dict[str, Any]] = _api().sanitize_for_serialization(written.metadata.managed_fields or [])  # type: ignore[no-untyped-call]
    legacy = [e for e in entries if e.get("manager") == LEGACY_MANAGER and e.get("operation") == "Update"
              and not e.get("subresource")]  # fmt: skip
    ours = [e for e in entries if e.get("manager") == FIELD_MANAGER and e.get("operation") == "Apply"]
    if not legacy or not ours:
        return False
    adopted = dict(ours[0])
    for other in legacy:  # one per API version written; the fields are the object's either way
        adopted["fieldsV1"] = _union(adopted.get("fieldsV1") or {}, other.get("fieldsV1") or {})
    kept = [e for e in entries if e not in legacy and e is not ours[0]] + [adopted]
    ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": written.metadata.resource_version},
           {"op": "replace", "path": "/metadata/managedFields", "value": kept}]  # fmt: skip
    patch(name, namespace, ops, _content_type="application/json-patch+json")
    return True


def _union(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two managed-field sets (``fieldsV1``: nested objects of ``f:``/``k:``/``v:`` keys) as one."""
    return {k: _union(a.get(k) or {}, b.get(k) or {}) for k in a.keys() | b.keys()}


def _http_port(pod: Any, container_name: str, default: int) -> int:
    """The ``http`` port the pod's container declares (the manifests say 8000 for serving, 8090
    for the node agent; tests that stand in for the kubelet run each process on its own loopback
    port)."""
    for container in pod.spec.containers if pod.spec else []:
        if container.name == container_name:
            for port in container.ports or []:
                if port.name == "http":
                    return int(port.container_port)
    return default


@dataclass(frozen=True)
class Replica:
    name: str
    url: str
    node: str | None = None
    uid: str | None = None  # the pod's: a new pod at a reused name and address proves itself again
    staged: bool = False  # its STAGED_CONDITION readiness gate is True


def _condition(pod: Any, kind: str) -> bool:
    conditions = (pod.status.conditions if pod.status else None) or []
    return any(c.type == kind and c.status == "True" for c in conditions)


def _ready(pod: Any) -> bool:
    """Its containers pass their probes. Not the pod's Ready: a serving pod's readiness gate waits
    for the operator, which must therefore see the pod before it is Ready."""
    return _condition(pod, "ContainersReady") or _condition(pod, "Ready")


async def mark_staged(namespace: str, pod: str) -> None:
    """Open the pod's readiness gate (STAGED_CONDITION): every Ready adapter is on it."""
    body = {"status": {"conditions": [{"type": STAGED_CONDITION, "status": "True", "reason": "AdaptersStaged",
                                       "lastTransitionTime": now_rfc3339()}]}}  # fmt: skip

    def write() -> None:
        try:
            _core().patch_namespaced_pod_status(pod, namespace, body)
        except ApiException as err:
            if err.status != 404:  # the pod went away since it was listed
                raise

    await asyncio.to_thread(write)


async def ready_replicas(namespace: str, base: str) -> list[Replica]:
    """The serving Pods of ``base`` that report Ready, with their admin URLs, by name."""
    return await ready_pods(namespace, base, "serving", "serving", SERVING_PORT)


async def ready_pods(namespace: str, base: str, component: str, container: str, default_port: int) -> list[Replica]:
    """``base``'s Ready pods of one component (serving replicas, node agents), by name.

    The URL is always the pod's own IP and its container's ``http`` port: nothing a namespace user
    can write on a pod (an annotation, a label) sends the admin token elsewhere."""

    def read() -> list[Replica]:
        selector = f"{BASE_LABEL}={base},{COMPONENT_LABEL}={component}"
        pods: list[Any] = _core().list_namespaced_pod(namespace, label_selector=selector).items
        out = []
        for pod in pods:
            labels = pod.metadata.labels or {}
            if labels.get(BASE_LABEL) != base or labels.get(COMPONENT_LABEL) != component or not _ready(pod):
                continue  # filtered here too: not every API emulator honours label selectors
            ip = pod.status.pod_ip if pod.status else None
            if ip:
                host = f"[{ip}]" if ":" in ip else ip
                node = pod.spec.node_name if pod.spec else None
                url = f"http://{host}:{_http_port(pod, container, default_port)}"
                out.append(Replica(pod.metadata.name, url, node, pod.metadata.uid, _condition(pod, STAGED_CONDITION)))
        return sorted(out, key=lambda r: r.name)

    return await asyncio.to_thread(read)
