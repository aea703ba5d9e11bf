"""A BaseModel's periodic sync with its serving replicas.

Every ``sync_interval`` seconds, per BaseModel:
1. each ready replica gets every Ready adapter of the base it does not know (a new or restarted
   replica is re-staged without anyone acting);
2. the replicas' per-adapter counters become each LoraAdapter's ``status.metrics`` — written only
   when a figure moved and at most once per ``metrics_interval`` per adapter;
3. auto-pinning pins the hot set that fits the device slots (minus headroom), with hysteresis;
4. with ``nodeCache.enabled``, every node agent is told what to hold and read back
   (``node_cache_sync``): per-node state and the ``NodeCachesReady`` condition on the BaseModel,
   ``nodesCached`` on each LoraAdapter;
5. with ``dedicated.mode`` on, the adapter that dominates the base's traffic is told so
   (``dedicated_sync``), and with ``auto`` served by a merged dedicated deployment carved from
   the pool (``dedicated_deploy``); a dedicated replica's requests count as its adapter's;
6. the BaseModel's own status: replicas, fingerprint, Ready adapters, pins, and the replicas'
   per-tenant usage of the last day (refreshed at most once per ``metrics_interval``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from loraplane.admin_api import AdapterState, AdminClient, ReplicaError
from loraplane.operator.api import GROUP
from loraplane.operator.api.basemodel import MAX_STATUS_TENANTS, BaseModelSpec, TenantUsage, UsageStatus
from loraplane.operator.api.loraadapter import LoraAdapterSpec
from loraplane.operator.runtime import cluster, decisions
from loraplane.operator.runtime.adapter_flow import parse_status, serving_source, stage, unfinished
from loraplane.operator.runtime.conditions import Status, now_rfc3339
from loraplane.operator.runtime.dedicated_deploy import Candidate, DeployMemory, sync_deployments
from loraplane.operator.runtime.dedicated_sync import DedicatedMemory, Event, sync_dedicated
from loraplane.operator.runtime.node_cache_sync import sync_node_caches
from loraplane.operator.runtime.readiness_gate import open_if_complete
from loraplane.operator.runtime.settings import OperatorSettings
from loraplane.usage.rollup import merge

ReplicaAdapters = dict[str, dict[str, AdapterState]]  # replica -> served name -> its state there

LOG = logging.getLogger(__name__)


@dataclass
class BaseMemory:
    """What one BaseModel's sync remembers between runs (in the operator's memory: a restart only
    costs one interval of rate history)."""

    samples: dict[str, decisions.Sample] = field(default_factory=dict)
    last_write: dict[str, float] = field(default_factory=dict)
    auto_pinned: set[str] = field(default_factory=set)
    last_status: dict[str, Any] = field(default_factory=dict)
    node_condition: tuple[Status, str, str] | None = None  # NodeCachesReady, with nodeCache.enabled
    usage: dict[str, Any] | None = None
    usage_at: float = -1e9
    unfinished: dict[str, tuple[str, float]] = field(default_factory=dict)  # adapter -> (resourceVersion, seen since)
    dedicated: DedicatedMemory = field(default_factory=DedicatedMemory)
    deploy: DeployMemory = field(default_factory=DeployMemory)
    events: list[Event] = field(default_factory=list)  # for the handler to post (kopf.event)


@dataclass
class AdapterView:
    name: str  # the LoraAdapter object's name
    served: str
    spec: LoraAdapterSpec
    status: Any
    raw: dict[str, Any] = field(default_factory=dict)  # the object as listed


def _adapters_of(base: str, objects: list[dict[str, Any]]) -> list[AdapterView]:
    views = []
    for obj in objects:
        if obj.get("spec", {}).get("baseModel") != base or obj["metadata"].get("deletionTimestamp"):
            continue
        try:
            spec = LoraAdapterSpec.model_validate(obj["spec"])
        except ValueError:
            continue  # its own reconcile reports the bad spec
        views.append(
            AdapterView(
                obj["metadata"]["name"], spec.served_name or obj["metadata"]["name"], spec, parse_status(obj.get("status")), obj
            )
        )
    return views


async def sync_base(
    name: str, namespace: str, spec_raw: Mapping[str, Any], memory: BaseMemory, settings: OperatorSettings
) -> dict[str, Any]:
    """One sync; returns the BaseModel's status patch (and leaves the node caches' condition in
    ``memory.node_condition`` for the caller to set among the object's current conditions)."""
    base = BaseModelSpec.model_validate(dict(spec_raw))
    token = await cluster.admin_token(namespace, name)
    # Without the Secret no real replica can have started; every answer read below is signed by
    # the token's holder (admin_api.auth), so a pod with the labels alone is never believed.
    replicas = await cluster.ready_replicas(namespace, name) if token else []
    clients = {r.name: AdminClient(r.url, token) for r in replicas}
    fingerprint = None
    stats: ReplicaAdapters = {}  # the shared pool's replicas: what they serve is the operator's to stage
    dedicated_stats: ReplicaAdapters = {}  # dedicated replicas (one merged adapter each): counted, never staged
    for replica, client in clients.items():
        try:
            answer = await client.stats()
            if answer.dedicated_model is not None:
                dedicated_stats[replica] = answer.adapters
                continue
            stats[replica] = answer.adapters
            if fingerprint is None:
                fingerprint = (await client.base()).fingerprint
        except ReplicaError:
            continue  # unreachable now; the next sync tries again
    counted = {**stats, **dedicated_stats}  # an adapter's traffic, wherever it is served
    # Listed after the stats: a name the operator registered had its LoraAdapter before, so every
    # name a replica reported that no LoraAdapter claims here is one nobody wants any more.
    objects = await cluster.list_custom(namespace, "loraadapters")
    adapters = _adapters_of(name, objects)
    await _resync_stalled(name, namespace, objects, memory, settings)
    ready = {a.served: a for a in adapters if a.status.phase == "Ready"}
    await _unregister_unclaimed(name, objects, stats, clients)
    now = time.monotonic()
    rates = {served: rate for served in ready
             if (rate := decisions.request_rate(memory.samples.get(served), decisions.sample(now, _entries(counted, served))))
             is not None}  # fmt: skip
    # An adapter its dedicated pods serve (one answered this sync) takes no device slot from the tail on the shared pool.
    dedicated_served = {served for known in dedicated_stats.values() for served in known}
    pins = _pins(base, ready, stats, memory, {s: r for s, r in rates.items() if s not in dedicated_served})
    by_name = {r.name: r for r in replicas}
    for replica, known in stats.items():
        holds = set(known)
        for served in decisions.missing(known, ready):
            try:
                view = ready[served]
                quotas = view.spec.quotas or base.tenancy.default_quotas
                source = serving_source(view.spec, view.status)
                await stage(clients[replica], served, view.spec, source, pinned=served in pins, quotas=quotas)
                holds.add(served)
            except ReplicaError:
                continue
        await open_if_complete(namespace, by_name[replica], holds, ready)
    await _apply_pins(pins, ready, stats, clients)
    node_caches = None
    if base.node_cache.enabled:
        node_token = await cluster.node_cache_token(namespace, name)
        # The merged models the dedicated deployments serve, copied to the nodes as a base is: those
        # of the adapters whose status gives them dedicated replicas (written when their Deployment
        # is; read back after an operator's restart, whose memory of what dominates starts empty).
        merged = [
            v.status.merged_model
            for v in ready.values()
            if v.status.dedicated_replicas is not None and v.status.merged_model is not None
        ]
        node_caches = await sync_node_caches(name, namespace, base, adapters, pins, rates, node_token, merged)
    memory.node_condition = node_caches.condition if node_caches else None
    ready_objects = {served: view.raw for served, view in ready.items()}
    memory.events += await sync_dedicated(namespace, base, ready_objects, rates, memory.dedicated, now)
    carved = await _sync_dedicated_deployments(name, namespace, base, ready, adapters, memory)
    await _write_metrics(namespace, ready, counted, memory, settings, node_caches.nodes_cached if node_caches else None)
    if time.monotonic() - memory.usage_at >= settings.metrics_interval:
        memory.usage, memory.usage_at = await _usage(list(clients.values())), time.monotonic()
    patch: dict[str, Any] = {
        "phase": "Ready" if replicas else "Progressing",
        "replicas": base.replicas,
        "readyReplicas": len(replicas),
        "readyAdapters": len(ready),
        "fingerprint": fingerprint,
        "pinnedAdapters": sorted(pins),
        "dominantAdapters": sorted(memory.dedicated.dominant) if base.dedicated.mode != "off" else None,
        "dedicatedReplicas": carved if base.dedicated.mode == "auto" else None,
        "usage": memory.usage,
        "observedGeneration": None,
    }
    if node_caches is not None:
        patch["nodeCache"] = node_caches.status.body()
    return patch


async def _sync_dedicated_deployments(
    name: str, namespace: str, base: BaseModelSpec, ready: dict[str, AdapterView], adapters: list[AdapterView],
    memory: BaseMemory,
) -> int:  # fmt: skip
    """``dedicated.mode: auto``'s deployments for the dominant Ready adapters (``dedicated_deploy``),
    and where each adapter is served written into its status at the edges. Run in every mode, so
    that a policy turned from auto leaves no dedicated deployment behind. Returns the replicas
    they take from the pool."""
    tracker = memory.dedicated.tracker
    candidates = []
    for served, view in sorted(ready.items()):
        if tracker is not None and served in memory.dedicated.dominant:
            source, quotas = serving_source(view.spec, view.status), view.spec.quotas or base.tenancy.default_quotas
            candidates.append(
                Candidate(
                    view.raw,
                    served,
                    tracker.share(served),
                    source.uri,
                    source.digest,
                    view.spec.tenant,
                    quotas,
                    view.status.merged_model,
                )
            )
    existing, wanted = await sync_deployments(namespace, name, base, candidates, memory.deploy, memory.events)
    for view in adapters:
        deployment = existing.get(view.name)
        replicas = wanted.get(view.served)
        served_from = "dedicated" if deployment is not None and deployment.ready else "shared"
        shown = (view.status.served_from, view.status.dedicated_replicas, view.status.dedicated_ready_replicas)
        if replicas is None:  # none wanted (one being deleted serves no more than the pool does)
            want: tuple[str | None, int | None, int | None] = ("shared", None, None) if shown[0] else (None, None, None)
        else:
            want = (served_from, replicas, deployment.ready if deployment is not None else 0)
        if want != shown:
            patch = {"servedFrom": want[0], "dedicatedReplicas": want[1], "dedicatedReadyReplicas": want[2]}
            try:
                await cluster.patch_status(namespace, "loraadapters", view.name, patch)
            except ApiException as err:
                if err.status != 404:  # deleted since the list
                    raise
    return sum(wanted.values())


async def _resync_stalled(
    base: str, namespace: str, objects: list[dict[str, Any]], memory: BaseMemory, settings: OperatorSettings
) -> None:
    """kopf handles a change once and records the outcome on the object; when that record cannot
    be written (the API server went away in the middle of it), the object is left with no change
    to react to once the server is back, and the adapter would wait for its next edit. An
    adapter of this base that is unfinished and has not changed for ``resync_interval`` seconds
    is touched (an annotation), which kopf sees as a change and handles as it would have. kopf's
    retries of a waiting adapter (every ``retry_delay``) change the object, so those are not
    touched; a handler that raised waits kopf's own backoff (60 s), and may be touched before it,
    which only brings its retry forward. A settled adapter costs no write. (An adapter whose
    BaseModel is missing is kopf's to retry.)"""
    now, seen = time.monotonic(), {}
    for obj in objects:
        meta = obj["metadata"]
        if obj.get("spec", {}).get("baseModel") != base or meta.get("deletionTimestamp") or not unfinished(obj):
            continue
        version, since = meta.get("resourceVersion", ""), now
        earlier = memory.unfinished.get(meta["name"])
        if earlier is not None and earlier[0] == version:
            since = earlier[1]
        if now - since >= settings.resync_interval:  # the annotation changes its version: timed again from there
            LOG.info("%s/%s is unfinished and unchanged for %.0f s: handled again", namespace, meta["name"], now - since)
            try:
                await cluster.annotate(namespace, "loraadapters", meta["name"], {f"{GROUP}/resync-requested": now_rfc3339()})
            except ApiException as err:
                if err.status != 404:  # deleted since the list: nothing to resync
                    raise
        seen[meta["name"]] = (version, since)
    memory.unfinished = seen


async def _unregister_unclaimed(
    base: str, objects: list[dict[str, Any]], stats: ReplicaAdapters, clients: dict[str, AdminClient]
) -> None:
    """Names a replica serves that no LoraAdapter of this base claims (in any phase, valid or not):
    one deleted, or whose servedName changed, while this replica was down or unreachable. The
    operator owns its replicas' served names, as a controller owns what it created."""
    claimed = {(o.get("spec") or {}).get("servedName") or o["metadata"]["name"] for o in objects
               if (o.get("spec") or {}).get("baseModel") == base}  # fmt: skip
    for replica, known in stats.items():
        for served in decisions.unclaimed(known, claimed):
            try:
                await clients[replica].unregister(served)
            except ReplicaError:
                continue  # the next sync tries again
            del known[served]


def _pins(
    base: BaseModelSpec, ready: dict[str, AdapterView], stats: ReplicaAdapters, memory: BaseMemory, rates: dict[str, float]
) -> set[str]:
    """Adapters pinned by their manifest, plus the auto-pinned hot set."""
    pinned = {served for served, a in ready.items() if a.spec.pinned}
    auto = base.auto_pinning
    if auto.enabled and stats:
        slots = auto.hot_set_size if auto.hot_set_size is not None else base.engine.max_loras - auto.headroom_slots
        slots = min(slots, base.engine.max_loras - 1)  # a replica refuses the pin that takes its last slot
        if rates:
            memory.auto_pinned = decisions.hot_set(rates, slots - len(pinned), memory.auto_pinned, auto.hysteresis)
    return pinned | (memory.auto_pinned & set(ready))


def _entries(stats: ReplicaAdapters, served: str) -> list[AdapterState]:
    """One adapter's state on every replica that lists it."""
    return [s[served] for s in stats.values() if served in s]


async def _apply_pins(
    pins: set[str], ready: dict[str, AdapterView], stats: ReplicaAdapters, clients: dict[str, AdminClient]
) -> None:
    """Pin ``pins`` and unpin the rest on every replica; each answer replaces the adapter's entry
    in ``stats``, so what this sync writes afterwards is the state the pins left."""
    for replica, known in stats.items():
        for served in ready:
            entry = known.get(served)
            if entry is None or entry.pinned == (served in pins):
                continue
            try:
                known[served] = await clients[replica].action(served, "pin" if served in pins else "unpin")
            except ReplicaError:
                continue


async def _write_metrics(
    namespace: str, ready: dict[str, AdapterView], stats: ReplicaAdapters, memory: BaseMemory,
    settings: OperatorSettings, nodes_cached: dict[str, int] | None,
) -> None:  # fmt: skip
    """``nodes_cached``: per served name, the nodes holding its serving version; None with the node
    cache off (a figure left from when it was on is removed)."""
    now = time.monotonic()
    for served, view in ready.items():
        entries = _entries(stats, served)
        if not entries:
            # No replica listed it when the stats were read, before the adapters were listed: it
            # was staged since, and its status (pinned, say) is newer than anything known here.
            # Writing from nothing flipped a new pinned adapter's `pinned` to false. (With no replica
            # answering at all, the last figures written stand.)
            continue
        current = decisions.sample(now, entries)
        previous = memory.samples.get(served)
        new = decisions.metrics(previous, current, now_rfc3339())
        memory.samples[served] = current
        if now - memory.last_write.get(served, -1e9) < settings.metrics_interval:
            continue
        placements = [{"replica": r, "tier": s[served].tier.value} for r, s in sorted(stats.items()) if served in s]
        # What the replicas report, not what was asked: a replica refuses a pin that would take
        # its last unpinned slot (the adapter's Pinned condition says so).
        pinned = all(e.pinned for e in entries)
        cached_on = (nodes_cached or {}).get(served)
        stale = nodes_cached is None and view.status.nodes_cached is not None
        placement_changed = (
            view.status.pinned != pinned or stale or (cached_on is not None and view.status.nodes_cached != cached_on)
        )
        refresh_due = now - memory.last_write.get(served, -1e9) >= settings.metrics_refresh
        if not decisions.worth_writing(view.status.metrics, new, refresh_due=refresh_due) and not placement_changed:
            continue
        patch: dict[str, Any] = {"metrics": new.body(), "replicas": placements, "pinned": pinned}
        if cached_on is not None or stale:
            patch["nodesCached"] = cached_on  # None: a merge patch's removal
        await cluster.patch_status(namespace, "loraadapters", view.name, patch)
        memory.last_write[served] = now


async def _usage(clients: list[AdminClient]) -> dict[str, Any] | None:
    """The replicas' rollups summed per tenant and bounded in size; None when no replica answered."""
    rollups = []
    for client in clients:
        try:
            rollups.append(await client.usage())
        except ReplicaError:
            continue
    if not rollups:
        return None
    tenants = [TenantUsage(tenant=t.tenant, requests=t.requests, refused=t.refused, prompt_tokens=t.prompt_tokens,
                           completion_tokens=t.completion_tokens) for t in merge(rollups, MAX_STATUS_TENANTS)]  # fmt: skip
    errors = sorted({r.export_error for r in rollups if r.export_error})
    status = UsageStatus(
        tenants=tenants,
        pending_segments=sum(r.pending_segments for r in rollups),
        export_error="; ".join(errors)[:1024] or None,
    )
    return status.body()
