"""What the cluster would hold for a serving replica that runs on this machine: its Pod (as the
kubelet would report it, Ready at an address and port of ours) and the BaseModel's admin-token
Secret with the token the replica was started with. No kubelet runs beside the test API server."""

from __future__ import annotations

import base64
from typing import Any
from urllib.parse import urlsplit

from loraplane.operator.children.names import ADMIN_TOKEN_KEY, BASE_LABEL, COMPONENT_LABEL, STAGED_CONDITION, admin_secret_name


def serving_pod(name: str, namespace: str, base: str, url: str, **metadata: Any) -> dict[str, Any]:
    """A serving Pod whose IP and ``http`` port are the replica's ``url`` (the only address the
    operator sends the admin token to), as the kubelet reports it once its container passes its
    probes: ContainersReady, and not Ready while its readiness gate waits for the operator."""
    where = urlsplit(url)
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {BASE_LABEL: base, COMPONENT_LABEL: "serving"},
                     **metadata},
        "spec": {"containers": [{"name": "serving", "image": "loraplane/serving",
                                 "ports": [{"name": "http", "containerPort": where.port}]}],
                 "readinessGates": [{"conditionType": STAGED_CONDITION}]},
        "status": {"phase": "Running", "podIP": where.hostname,
                   "conditions": [{"type": "ContainersReady", "status": "True"}, {"type": "Ready", "status": "False"}]},
    }  # fmt: skip


def admin_secret(namespace: str, base: str, token: str) -> dict[str, Any]:
    """The BaseModel's admin-token Secret, brought by the user before the BaseModel (the operator
    creates one with a random token only where none exists)."""
    return {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": admin_secret_name(base), "namespace": namespace},
        "data": {ADMIN_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }  # fmt: skip
