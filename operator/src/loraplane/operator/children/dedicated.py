"""A dedicated deployment: the serving pods of one adapter merged into its base (the lesson's
decision chart: a dominant adapter gets a merged deployment, the long tail stays on the shared
base). Its ConfigMap, Deployment and Service, owned by the LoraAdapter, built from the base's own
serving manifests so that everything but the model (image, resources, tokens, tenants, node
cache, Pod Security) is what the shared pool runs.

Its pods carry the base's serving labels, so the base's serving Service (whose EndpointSlices
the router watches) takes them in: the router tells them apart by the model their stats say they
serve and sends them that adapter's requests, and only those. One label more
(:data:`DEDICATED_LABEL`) is their Deployment's own selector. No readiness gate: nothing is staged
on them; they are ready when the merged model is loaded.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import yaml

from loraplane.operator.api.basemodel import BaseModelSpec
from loraplane.operator.api.common import Quotas
from loraplane.operator.children.base_model import CONFIG_HASH, config_hash, deployment, engine_config, labels, service

DEDICATED_LABEL = "loraplane.dev/dedicated-adapter"  # the LoraAdapter's name
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def dedicated_name(adapter: str) -> str:
    """``<adapter>-dedicated`` where that is a DNS label (a Service's name must be), otherwise a
    digest of the adapter's name in its place."""
    name = f"{adapter}-dedicated"
    if len(name) <= 63 and _LABEL.match(name):
        return name
    return f"lora-{hashlib.sha256(adapter.encode()).hexdigest()[:16]}-dedicated"


def dedicated_labels(base: str, adapter: str) -> dict[str, str]:
    return {**labels(base), DEDICATED_LABEL: adapter}


def dedicated_engine_config(
    base: str, namespace: str, spec: BaseModelSpec, served: str, source: str, digest: str | None, tenant: str | None,
    quotas: Quotas | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The base's engine config with the adapter to merge at start, the name to serve it as and
    its quotas. The adapter slots stay as the base sizes them (the engine needs one at least);
    none is used."""
    config = engine_config(spec, base, namespace)
    limits = quotas.model_dump(exclude_none=True, by_alias=False) if quotas is not None else None
    merged = {"merged_lora": source, "merged_lora_digest": digest, "merged_lora_tenant": tenant, "served_model_name": served,
              "merged_lora_quotas": limits or None}  # fmt: skip
    return {**config, **{k: v for k, v in merged.items() if v is not None}}


def dedicated_objects(
    base: str, namespace: str, spec: BaseModelSpec, adapter: str, served: str, source: str, digest: str | None,
    tenant: str | None, replicas: int, quotas: Quotas | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """The ConfigMap, Deployment and Service of ``adapter``'s dedicated deployment. A promotion
    (a new ``digest``) changes the config's hash on the pod template: the pods roll, one at a time,
    each merging the new version before it is ready."""
    name = dedicated_name(adapter)
    pod_labels = dedicated_labels(base, adapter)
    config = dedicated_engine_config(base, namespace, spec, served, source, digest, tenant, quotas)
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-engine", "namespace": namespace, "labels": pod_labels},
        "data": {"engine.yaml": yaml.safe_dump(config, sort_keys=True)},
    }
    manifest = deployment(base, namespace, spec, replicas)  # a new dict each call: changed in place below
    manifest["metadata"] = {"name": name, "namespace": namespace, "labels": pod_labels}
    manifest["spec"]["selector"] = {"matchLabels": pod_labels}
    # A pod replaced before its successor starts: on a fixed GPU budget a surge pod has no GPU to
    # run on, and while none is ready the adapter's requests go to the shared pool, so a promotion's
    # roll fails no request either way.
    manifest["spec"]["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
    template = manifest["spec"]["template"]
    template["metadata"] = {"labels": pod_labels, "annotations": {CONFIG_HASH: config_hash(base, namespace, spec, config)}}
    pod = template["spec"]
    pod.pop("readinessGates", None)
    for volume in pod["volumes"]:
        if volume["name"] == "engine":
            volume["configMap"] = {"name": f"{name}-engine"}
    own_service = service(base, namespace)
    own_service["metadata"] = {"name": name, "namespace": namespace, "labels": pod_labels}
    own_service["spec"]["selector"] = pod_labels
    return [config_map, manifest, own_service]
