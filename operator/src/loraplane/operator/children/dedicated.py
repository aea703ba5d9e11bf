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
from pathlib import Path
from typing import Any

import yaml

from loraplane.node_cache.base_copy import published_path
from loraplane.operator.api.basemodel import BaseModelSpec
from loraplane.operator.api.common import Quotas
from loraplane.operator.api.loraadapter import MergedModel
from loraplane.operator.children import node_cache
from loraplane.operator.children.base_model import CONFIG_HASH, config_hash, deployment, engine_config, labels, service
from loraplane.operator.children.names import COMPONENT_LABEL, admin_token_env, stats_token_env

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


def merged_uri(namespace: str, base: str, spec: BaseModelSpec, adapter: str, digest: str) -> str:
    """Where ``adapter``'s version ``digest`` merged into ``base`` is written once: under
    ``dedicated.mergedStore``, named by the base's source and the adapter version, so a promotion
    (or a new base) writes beside what running pods were copied from, never over it."""
    assert spec.dedicated.merged_store is not None
    key = hashlib.sha256(f"{spec.source.uri}|{spec.source.digest}|{digest}".encode()).hexdigest()[:16]
    return f"{spec.dedicated.merged_store.rstrip('/')}/{namespace}/{base}/{adapter}/{key}"


def merge_job_name(adapter: str, uri: str) -> str:
    """One Job per merged checkpoint (its name says which), so a finished one is not run again."""
    return f"{dedicated_name(adapter).removesuffix('-dedicated')[:40]}-merge-{hashlib.sha256(uri.encode()).hexdigest()[:8]}"


def merge_job(
    base: str, namespace: str, spec: BaseModelSpec, adapter: str, source: str, digest: str, uri: str
) -> dict[str, Any]:  # fmt: skip
    """The Job that merges ``adapter``'s version into the base once and writes it to ``uri``
    (``loraplane merge --publish``). Its pod is a serving pod's (image, node selector, the node
    cache and the wait for an s3:// base, the cache volume as scratch) without the GPU, the
    probes or the ports: the merge is a pass over the weights on the CPU. It writes the folder's
    digest as its termination message, which the operator reads and keeps in the adapter's status."""
    template = deployment(base, namespace, spec, 1)["spec"]["template"]
    pod = template["spec"]
    pod.pop("readinessGates", None)
    pod["restartPolicy"] = "Never"
    (container,) = pod["containers"]
    model = engine_config(spec, base, namespace)["model"]
    container["args"] = ["merge", source, "--digest", digest, "--base", model, "--publish", uri,
                         "--digest-file", "/dev/termination-log", "--cache-dir", "/var/cache/loraplane"]  # fmt: skip
    container["name"] = "merge"
    for key in ("ports", "readinessProbe", "startupProbe", "livenessProbe"):
        container.pop(key, None)
    for part in ("limits", "requests"):
        container["resources"][part].pop("nvidia.com/gpu", None)
    for volume in pod["volumes"]:
        if volume["name"] == "cache":  # scratch for one checkpoint the base's size, which the operator does not know
            volume["emptyDir"] = {}
    store = spec.adapter_store  # the merge fetches the adapter and writes the checkpoint itself
    # Not the replica's tokens: the merge answers no call and makes none to a replica or the agent.
    own = [e for e in container["env"] if e["name"] not in {admin_token_env(base)["name"], stats_token_env(base)["name"]}]
    container["env"] = [*own, {"name": "LORAPLANE_CACHE", "value": "/var/cache/loraplane"}] + [
        {"name": k, "value": v} for k, v in (("AWS_ENDPOINT_URL", store.endpoint), ("AWS_REGION", store.region)) if v
    ]
    container["envFrom"] = [{"secretRef": {"name": store.credentials_secret.name}}] if store.credentials_secret else []
    # Not the serving labels: the serving Service (and the router, and the operator's replica list)
    # must never take a merge Job's pod for a replica.
    job_labels = {**dedicated_labels(base, adapter), COMPONENT_LABEL: "merge"}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": merge_job_name(adapter, uri), "namespace": namespace, "labels": job_labels},
        "spec": {
            "backoffLimit": 2,
            "activeDeadlineSeconds": 3 * 3600,  # an 8B merge takes minutes; a stuck one is failed, and reported
            "template": {"metadata": {"labels": job_labels}, "spec": pod},
        },
    }


def dedicated_engine_config(
    base: str, namespace: str, spec: BaseModelSpec, served: str, source: str, digest: str | None, tenant: str | None,
    quotas: Quotas | None = None, merged: MergedModel | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The base's engine config with the adapter to merge at start (or, with ``merged``, the
    merged checkpoint as the node cache publishes it), the name to serve it as and its quotas.
    One adapter slot, the engine's least (none is used): the device memory the base's slots
    would take goes to the KV cache."""
    config = {**engine_config(spec, base, namespace), "max_loras": 1}
    config.pop("max_cpu_loras", None)
    limits = quotas.model_dump(exclude_none=True, by_alias=False) if quotas is not None else None
    own = {
        "merged_lora_digest": digest,
        "merged_lora_tenant": tenant,
        "served_model_name": served,
        "merged_lora_quotas": limits or None,
    }
    if merged is not None:
        config["model"] = str(published_path(Path(node_cache.NODE_CACHE_MOUNT), merged.uri))
    else:
        own["merged_lora"] = source
    return {**config, **{k: v for k, v in own.items() if v is not None}}


def dedicated_objects(
    base: str, namespace: str, spec: BaseModelSpec, adapter: str, served: str, source: str, digest: str | None,
    tenant: str | None, replicas: int, quotas: Quotas | None = None, merged: MergedModel | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """The ConfigMap, Deployment and Service of ``adapter``'s dedicated deployment. A promotion
    (a new ``digest``, or with ``merged`` a new checkpoint) changes the config's hash on the pod
    template: the pods roll, one at a time, each loading the new version before it is ready."""
    name = dedicated_name(adapter)
    pod_labels = dedicated_labels(base, adapter)
    config = dedicated_engine_config(base, namespace, spec, served, source, digest, tenant, quotas, merged)
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
    if merged is not None:  # the merged checkpoint's copy on the node, waited for as an s3:// base's is
        pod["initContainers"] = [node_cache.wait_for_base(spec.resources.image, merged.uri, merged.digest)]
    for volume in pod["volumes"]:
        if volume["name"] == "engine":
            volume["configMap"] = {"name": f"{name}-engine"}
    own_service = service(base, namespace)
    own_service["metadata"] = {"name": name, "namespace": namespace, "labels": pod_labels}
    own_service["spec"]["selector"] = pod_labels
    return [config_map, manifest, own_service]
