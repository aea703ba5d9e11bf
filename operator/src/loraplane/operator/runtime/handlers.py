"""The kopf handlers: thin. Each parses its object, calls the flow that decides and acts, writes the
status and posts Events. `loraplane operator` runs them."""

from __future__ import annotations

import logging
from typing import Any, cast

import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from loraplane.operator.api import GROUP, VERSION, Condition
from loraplane.operator.api.basemodel import BaseModelSpec
from loraplane.operator.children.base_model import children
from loraplane.operator.runtime import cluster, dedicated_deploy
from loraplane.operator.runtime.adapter_flow import reconcile, unregister_everywhere, waits
from loraplane.operator.runtime.base_sync import BaseMemory, sync_base
from loraplane.operator.runtime.conditions import Status, set_condition
from loraplane.operator.runtime.settings import OperatorSettings

SETTINGS = OperatorSettings()
MEMORY: dict[tuple[str, str], BaseMemory] = {}


@kopf.index(GROUP, VERSION, "loraadapters")
def served_names(name: str, namespace: str | None, spec: kopf.Spec, meta: kopf.Meta, **_: Any) -> dict[Any, Any]:
    """(namespace, base, served name) -> (created, adapter): who holds a served name, kept by kopf
    from the watch it runs anyway, so a reconcile finds a collision without listing adapters."""
    served = spec.get("servedName") or name
    return {(namespace, spec.get("baseModel"), served): (str(meta.get("creationTimestamp", "")), name)}


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Progress and diff-base in annotations: status stays exactly what the CRD schema describes.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # Events for the transitions a person wants to see are posted explicitly (kopf.event); handler
    # chatter stays in the log: a fleet of thousands must not write an Event per handler run.
    settings.posting.level = logging.WARNING


BASE_SYNC_FIELDS = frozenset({"servedFrom", "dedicatedReplicas", "dedicatedReadyReplicas", "mergedModel"})


@kopf.on.resume(GROUP, VERSION, "loraadapters")
@kopf.on.create(GROUP, VERSION, "loraadapters")
@kopf.on.update(GROUP, VERSION, "loraadapters", field="spec")
async def adapter_changed(
    body: kopf.Body, name: str, namespace: str | None, meta: kopf.Meta, spec: kopf.Spec, status: kopf.Status, **kwargs: Any
) -> None:
    namespace = namespace or "default"  # both kinds are namespaced; kopf's type allows cluster scope
    # The first created of the adapters claiming a served name holds it; the others wait for it.
    holder = served_name_holder(kwargs["served_names"], namespace, name, spec)
    out = await reconcile(name, namespace, meta.get("generation"), spec, status, SETTINGS, served_by=holder)
    # A merge patch keeps what it does not mention: promotingDigest is cleared with an explicit null.
    # The fields the base's sync owns are left out: written back as read when this handler began,
    # they could undo a newer write of the sync's (a merged model's record, where it is served).
    written = {k: v for k, v in out.status.body().items() if k not in BASE_SYNC_FIELDS}
    await cluster.patch_status(namespace, "loraadapters", name, {**written, "promotingDigest": out.status.promoting_digest})
    for type_, reason, message in out.events:
        kopf.event(body, type=type_, reason=reason, message=message)
    waiting = [c for c in out.status.conditions if waits(c.status, c.reason)]
    if waiting:
        raise kopf.TemporaryError(f"{waiting[0].reason}: {waiting[0].message}", delay=SETTINGS.retry_delay)


@kopf.on.delete(GROUP, VERSION, "loraadapters")
async def adapter_deleted(name: str, namespace: str | None, spec: kopf.Spec, **kwargs: Any) -> None:
    """Unregistered from every replica before the finalizer is removed; an adapter that was only
    waiting for a served name another one holds leaves that one serving."""
    namespace = namespace or "default"
    if served_name_holder(kwargs["served_names"], namespace, name, spec) in (name, None):
        await unregister_everywhere(name, namespace, spec, SETTINGS)


def served_name_holder(index: kopf.Index[Any, tuple[str, str]], namespace: str, name: str, spec: kopf.Spec) -> str | None:
    """The first created of the adapters claiming this one's served name (kopf passes the index
    by its function's name)."""
    claims: list[tuple[str, str]] = list(index.get((namespace, spec.get("baseModel"), spec.get("servedName") or name), []))
    return min(claims)[1] if claims else None


@kopf.on.resume(GROUP, VERSION, "basemodels")
@kopf.on.create(GROUP, VERSION, "basemodels")
@kopf.on.update(GROUP, VERSION, "basemodels", field="spec")
async def base_changed(
    body: kopf.Body, name: str, namespace: str | None, meta: kopf.Meta, spec: kopf.Spec, status: kopf.Status, **_: Any
) -> None:
    """The serving ConfigMap, Deployment and Service, owned by the BaseModel (deleted with it)."""
    namespace = namespace or "default"
    generation = meta.get("generation")
    conditions = [Condition.model_validate(c) for c in status.get("conditions", [])]
    try:
        # The API server checks the same rules (the CRD's schema and CEL); an object stored before
        # a rule existed (an s3:// base without a node cache) is reported, not retried forever.
        base = BaseModelSpec.model_validate(dict(spec))
    except ValidationError as err:
        message = "; ".join(e["msg"] for e in err.errors())[:1024]
        conditions = set_condition(conditions, "Applied", "False", "InvalidSpec", message, generation)
        patch = {"phase": "Degraded", "conditions": [c.body() for c in conditions]}
        await cluster.patch_status(namespace, "basemodels", name, patch)
        kopf.event(body, type="Warning", reason="InvalidSpec", message=message)
        return
    # The shared pool's replicas are spec.replicas less what dedicated deployments take, as the sync writes them.
    taken = await dedicated_deploy.carved(namespace, name) if base.dedicated.mode == "auto" else 0
    manifests = children(name, namespace, base, SETTINGS.operator_namespace, SETTINGS.metrics_namespaces, taken)
    if not base.node_cache.enabled:  # turned off (or never on): its agents stop, and the credentials they hold with them
        await cluster.retire_daemon_set(namespace, f"{name}-node-cache")
    await cluster.ensure_admin_secret(namespace, name, kopf.build_owner_reference(body))
    for manifest in manifests:
        kopf.adopt(manifest, owner=body)
        await cluster.apply_child(manifest)
    if base.node_cache.enabled:  # turned back on: the agents run again
        await cluster.retire_daemon_set(namespace, f"{name}-node-cache", retired=False)
    message = f"{name}-serving with {base.replicas} replicas"
    conditions = set_condition(conditions, "Applied", "True", "Applied", message, generation)
    await cluster.patch_status(
        namespace, "basemodels", name, {"conditions": [c.body() for c in conditions], "observedGeneration": generation}
    )


async def _node_cache_status(
    namespace: str, name: str, condition: tuple[Status, str, str] | None
) -> tuple[dict[str, Any], str | None]:
    """``NodeCachesReady`` set among the object's conditions as they are now (read fresh: the
    timer's copy may predate an ``Applied`` written since), or, with the node cache turned off,
    its condition and ``status.nodeCache`` removed. With the object's resourceVersion, so the
    write replaces only the conditions it read."""
    obj = await cluster.get_custom(namespace, "basemodels", name) or {}
    fresh, version = obj.get("status") or {}, (obj.get("metadata") or {}).get("resourceVersion")
    conditions = [Condition.model_validate(c) for c in fresh.get("conditions", [])]
    if condition is not None:
        return {"conditions": [c.body() for c in set_condition(conditions, "NodeCachesReady", *condition)]}, version
    kept = [c.body() for c in conditions if c.type != "NodeCachesReady"]
    return {"conditions": kept, "nodeCache": None}, version


@kopf.timer(GROUP, VERSION, "basemodels", interval=SETTINGS.sync_interval, initial_delay=1.0)
async def base_sync(name: str, namespace: str | None, spec: kopf.Spec, status: kopf.Status, **_: Any) -> None:
    namespace = namespace or "default"
    memory = MEMORY.setdefault((namespace, name), BaseMemory())
    patch = await sync_base(name, namespace, spec, memory, SETTINGS)
    for obj, type_, reason, message in memory.events:
        kopf.event(kopf.Body(cast(kopf.RawBody, obj)), type=type_, reason=reason, message=message)
    memory.events.clear()
    written = {k: v for k, v in patch.items() if v is not None}
    for key in ("dominantAdapters", "dedicatedReplicas"):
        if patch.get(key) is None and key in status:
            written[key] = None  # dedicated.mode turned off (or from auto): a merge patch's removal
    version = None
    if memory.node_condition is not None or "nodeCache" in status:
        fields, version = await _node_cache_status(namespace, name, memory.node_condition)
        written.update(fields)
    if written != memory.last_status:  # an idle fleet costs no writes
        try:
            await cluster.patch_status(namespace, "basemodels", name, written, version)
        except ApiException as err:
            if err.status != 409:
                raise
            return  # the conditions changed since they were read: the next sync writes over the new ones
        memory.last_status = written
