"""The names the operator's children and its runtime agree on: labels, ports, and the Secrets (and
the environment variables that read them) holding each BaseModel's tokens."""

from __future__ import annotations

from typing import Any

BASE_LABEL = "loraplane.dev/base-model"
COMPONENT_LABEL = "app.kubernetes.io/component"
SERVING_PORT = 8000  # the serving container's port named "http" unless its pod spec names another
ADMIN_TOKEN_KEY = "admin-token"
STATS_TOKEN_KEY = "stats-token"
NODE_CACHE_TOKEN_KEY = "node-cache-token"
METRICS_PORT = 9090  # /metrics alone (`--metrics-port`): what Prometheus scrapes, not the API
# A serving pod's readiness gate: its containers being ready says the base is loaded; the pod is
# Ready (in the Service, counted by a rollout) only once the operator has staged every Ready
# adapter on it, so a new replica never answers 404 for an adapter the old one served.
STAGED_CONDITION = "loraplane.dev/adapters-staged"


def admin_secret_name(base: str) -> str:
    """Each BaseModel's own admin token lives in ``<base>-admin`` in its namespace: a token read in
    one namespace opens no other namespace's replicas."""
    return f"{base}-admin"


def stats_secret_name(base: str) -> str:
    """The router's token, ``<base>-stats``: it reads ``/admin/stats`` and can change nothing. A
    Secret of its own, not a second key of ``<base>-admin``, so that the router's pod never
    mounts anything that holds the admin token, and a user who brings ``<base>-admin`` need not
    know about it."""
    return f"{base}-stats"


def node_cache_secret_name(base: str) -> str:
    """The node agents' operator token, ``<base>-node-cache``: staging and state. The serving pods
    never hold it, so one cannot rewrite what its node keeps."""
    return f"{base}-node-cache"


def node_cache_token_env(base: str) -> dict[str, Any]:
    ref = {"name": node_cache_secret_name(base), "key": NODE_CACHE_TOKEN_KEY}
    return {"name": "LORAPLANE_NODE_CACHE_TOKEN", "valueFrom": {"secretKeyRef": ref}}


def admin_token_env(base: str) -> dict[str, Any]:
    """The environment variable a serving container reads its base's admin token from."""
    return {
        "name": "LORAPLANE_ADMIN_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": admin_secret_name(base), "key": ADMIN_TOKEN_KEY}},
    }


def stats_token_env(base: str, variable: str = "LORAPLANE_STATS_TOKEN") -> dict[str, Any]:
    """The stats token, as ``variable``: the serving container's ``--stats-token``, and the
    router's ``--admin-token`` (the only token it sends, and what guards its own view)."""
    return {"name": variable, "valueFrom": {"secretKeyRef": {"name": stats_secret_name(base), "key": STATS_TOKEN_KEY}}}
