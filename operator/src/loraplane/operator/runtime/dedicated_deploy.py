"""``dedicated.mode: auto``, each sync: a merged dedicated deployment for every dominant adapter the
shared pool can spare replicas for, none for the rest, and the shared pool shrunk by what they take.

The budget is ``spec.replicas``, fixed: a dedicated deployment's pods come out of the shared
pool's, never on top, and the pool always keeps one (``placements``). A switch either way loses
no request: the adapter stays registered on the shared replicas throughout, and the router sends
its requests to dedicated pods only while one is ready, to the shared pool otherwise. So a
dedicated deployment and the pool's shrink are written in one sync (on a full GPU budget the new
pods could not be scheduled before the pool gave its replicas back), and so are a return's
deletion and the pool's growth: the leaving pods finish what they hold (their graceful
shutdown), new requests go to the shared replicas as each pod leaves the Service, and a new
shared replica takes traffic only once its adapters are staged (its readiness gate).

In auto, what exists is read back each sync (the Deployments by their labels), so a restarted
operator, a deleted Deployment or a hand edit converges to the decision without memory of its
own; what is applied is remembered only to skip an apply that would change nothing. In the other
modes one sync after a start or a change of mode removes what auto left, and the next ones read
nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import kopf
from kubernetes.client.exceptions import ApiException

from loraplane.operator.api.basemodel import BaseModelSpec, DedicatedPolicy
from loraplane.operator.api.common import Quotas
from loraplane.operator.api.loraadapter import MergedModel
from loraplane.operator.children.dedicated import (
    DEDICATED_LABEL,
    dedicated_name,
    dedicated_objects,
    merge_job,
    merge_job_name,
    merged_uri,
)
from loraplane.operator.children.names import COMPONENT_LABEL
from loraplane.operator.runtime import cluster
from loraplane.operator.runtime.dedicated_sync import Event
from loraplane.routing.dominance import dedicated_replicas

SHARE_MANAGER = "loraplane-operator-dedicated"  # the field manager of the shared pool's shrunk replicas


@dataclass(frozen=True)
class Candidate:
    """A dominant adapter, with what its dedicated pods merge: the version the shared pool serves."""

    obj: dict[str, Any]  # the LoraAdapter as listed: the owner of its dedicated deployment
    served: str
    share: float
    source: str
    digest: str | None
    tenant: str
    quotas: Quotas | None = None  # the adapter's, or its base's default
    merged: MergedModel | None = None  # the last version merged once (status.mergedModel), with dedicated.mergedStore


@dataclass
class DeployMemory:
    applied: dict[str, str] = field(default_factory=dict)  # adapter -> hash of the manifests last applied
    merge_said: dict[str, str] = field(default_factory=dict)  # adapter -> the merge Job whose outcome was said (Event)
    # Outside auto, once a sync has found (or left) no dedicated deployment, later syncs read
    # nothing: the default mode costs no call. Cleared when the mode changes.
    settled: str | None = None


def placements(policy: DedicatedPolicy, pool: int, shares: Mapping[str, float]) -> dict[str, int]:
    """Replicas per dominant adapter (served name), largest share first, each the planner's rule
    (``dedicated_replicas``) and all of them leaving the shared pool one replica at least."""
    left, out = pool - 1, {}
    for served, share in sorted(shares.items(), key=lambda kv: (-kv[1], kv[0])):
        n = min(dedicated_replicas(share, pool, policy.max_replicas), left)
        if n > 0:
            out[served], left = n, left - n
    return out


async def carved(namespace: str, base: str) -> int:
    """What the dedicated deployments of ``base`` take from its pool now (the handler that applies
    the shared Deployment writes the same figure the sync does)."""
    return sum(d.replicas for d in await cluster.dedicated_deployments(namespace, base, DEDICATED_LABEL))


def _digest_of(message: str) -> str | None:
    text = message.strip()
    return text if re.fullmatch(r"sha256:[0-9a-f]{64}", text) else None


async def merged_model(
    namespace: str, base: str, spec: BaseModelSpec, c: Candidate, memory: DeployMemory, events: list[Event]
) -> MergedModel | None:
    """With ``dedicated.mergedStore``: the merged checkpoint ``c``'s dedicated pods serve. The
    version the shared pool serves (on the base it serves) is merged once by a Job (created here,
    owned by the adapter), whose digest goes into the adapter's status. Until it is written, None:
    the adapter is served by the shared pool, which has its replicas back, and never by pods of
    another version (a promotion, a rollback, a new base) or of a merge that failed."""
    assert c.digest is not None
    adapter = c.obj["metadata"]["name"]
    uri = merged_uri(namespace, base, spec, adapter, c.digest)
    if c.merged is not None and c.merged.uri == uri:
        return c.merged
    job = merge_job_name(adapter, uri)
    outcome = await cluster.job_outcome(namespace, job)
    if outcome is None:
        manifest = merge_job(base, namespace, spec, adapter, c.source, c.digest, uri)
        kopf.adopt(manifest, owner=kopf.Body(cast(kopf.RawBody, c.obj)))
        await cluster.create_job(manifest)
        await cluster.delete_jobs(namespace, f"{DEDICATED_LABEL}={adapter},{COMPONENT_LABEL}=merge", keep={job})
        events.append((c.obj, "Normal", "Merging", f"merging {c.digest} into the base once (Job {job}), to {uri}"))
        return None
    digest = _digest_of(outcome.message) if outcome.state == "succeeded" else None
    if digest is None:
        if outcome.state != "running" and memory.merge_said.get(adapter) != job:
            memory.merge_said[adapter] = job
            why = outcome.message if outcome.state == "failed" else "its pod left no digest"
            events.append((c.obj, "Warning", "MergeFailed", f"Job {job}: {why}; delete the Job to merge again"))
        return None
    merged = MergedModel(uri=uri, digest=digest, adapter_digest=c.digest)
    try:
        await cluster.patch_status(namespace, "loraadapters", adapter, {"mergedModel": merged.body()})
    except ApiException as err:
        if err.status != 404:  # deleted since the list: its Job goes with it
            raise
        return None
    events.append((c.obj, "Normal", "Merged", f"{c.digest} merged into the base: {uri} ({digest})"))
    return merged


async def sync_deployments(
    namespace: str, base: str, spec: BaseModelSpec, candidates: list[Candidate], memory: DeployMemory,
    events: list[Event] | None = None,
) -> tuple[dict[str, cluster.DedicatedDeployment], dict[str, int]]:  # fmt: skip
    """Apply the dedicated deployments the candidates get, delete the others, size the shared pool
    (read and written only when it differs). Returns what existed by adapter name (before this
    sync's changes take effect) and the replicas wanted by served name (an adapter whose first
    merge is still running takes none yet). ``events``: what to post on the adapters."""
    events = [] if events is None else events
    mode = spec.dedicated.mode
    if memory.settled is not None and memory.settled == mode:
        return {}, {}
    memory.settled = None
    wanted = placements(spec.dedicated, spec.replicas, {c.served: c.share for c in candidates}) if mode == "auto" else {}
    existing = {d.adapter: d for d in await cluster.dedicated_deployments(namespace, base, DEDICATED_LABEL)}
    keep: set[str] = set()
    for c in candidates:
        replicas = wanted.get(c.served)
        if replicas is None:
            continue
        adapter = c.obj["metadata"]["name"]
        merged = None
        if spec.dedicated.merged_store is not None and c.digest is not None:
            merged = await merged_model(namespace, base, spec, c, memory, events)
            if merged is None:
                del wanted[c.served]
                continue
        keep.add(adapter)
        manifests = dedicated_objects(
            base, namespace, spec, adapter, c.served, c.source, c.digest, c.tenant, replicas, c.quotas, merged
        )
        for manifest in manifests:
            kopf.adopt(manifest, owner=kopf.Body(cast(kopf.RawBody, c.obj)))  # deleted with the adapter, by the GC
        digest = hashlib.sha256(json.dumps(manifests, sort_keys=True).encode()).hexdigest()
        if memory.applied.get(adapter) != digest or adapter not in existing:
            for manifest in manifests:
                await cluster.apply_child(manifest)
            memory.applied[adapter] = digest
    for adapter, deployment in existing.items():
        if adapter not in keep:
            name = dedicated_name(adapter)
            await cluster.delete_children(namespace, deployment.name, name, f"{name}-engine")
            memory.applied.pop(adapter, None)
    await _scale_shared(namespace, base, spec.replicas - sum(wanted.values()))
    if mode != "auto":
        memory.settled = mode
    return existing, wanted


async def _scale_shared(namespace: str, base: str, replicas: int) -> None:
    try:
        await cluster.scale_deployment(namespace, f"{base}-serving", replicas, SHARE_MANAGER)
    except ApiException as err:
        if err.status != 404:  # not created yet: the handler that creates it reads the same figure
            raise
