"""The serving pods' readiness gate (``children.names.STAGED_CONDITION``): a pod whose containers
are ready has loaded its base, but it joins the Service (and counts for a rollout) only once every
Ready adapter of its base is staged on it. Without the gate a replacement pod took requests for
adapters it did not have yet and answered 404 until the next sync staged them (found on a real
cluster: half the requests of a deleted pod's adapter failed while its replacement started).

The gate opens at the base's sync, which stages what a new replica lacks, and right after an
adapter is staged, so that an adapter reported Ready on a new deployment is one the Service can
already reach. It never closes again: a replica that loses an adapter later is restaged by the
sync, and the router sends an adapter's requests to the replicas that list it first."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from loraplane.admin_api import AdminClient, ReplicaError
from loraplane.operator.runtime import cluster, decisions


def ready_served_names(base: str, objects: list[dict[str, Any]]) -> set[str]:
    """The served names of ``base``'s LoraAdapters that are Ready (and not being deleted)."""
    names = set()
    for obj in objects:
        spec, meta = obj.get("spec") or {}, obj["metadata"]
        if (
            spec.get("baseModel") == base
            and not meta.get("deletionTimestamp")
            and (obj.get("status") or {}).get("phase") == "Ready"
        ):
            names.add(spec.get("servedName") or meta["name"])
    return names


async def open_if_complete(namespace: str, replica: cluster.Replica, known: Iterable[str], ready: Iterable[str]) -> None:
    """Open ``replica``'s gate when it lists every name in ``ready`` (nothing to do once open)."""
    if not replica.staged and not decisions.missing(known, ready):
        await cluster.mark_staged(namespace, replica.name)


async def open_after_staging(
    namespace: str, base: str, served: str, replicas: list[cluster.Replica], clients: list[AdminClient]
) -> None:
    """After ``served`` was staged on every replica: open the gates of those that now hold every
    Ready adapter of ``base`` (``served`` counts, about to be Ready itself)."""
    closed = [(r, c) for r, c in zip(replicas, clients, strict=True) if not r.staged]
    if not closed:
        return
    ready = ready_served_names(base, await cluster.list_custom(namespace, "loraadapters")) | {served}
    for replica, client in closed:
        try:
            known = (await client.stats()).adapters
        except ReplicaError:
            continue  # the base's next sync tries again
        await open_if_complete(namespace, replica, known, ready)
