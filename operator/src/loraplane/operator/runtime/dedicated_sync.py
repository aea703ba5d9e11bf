"""A BaseModel's dedicated-deployment policy, applied each sync: which adapter dominates the base's
traffic, said on that adapter (its ``DedicatedRecommended`` condition and an Event).

The rule is ``loraplane.routing.dominance``, the one ``loraplane plan`` applies to a traffic
table, fed here with the request rates the replicas report. Only the decision's edges cost a
write: an adapter gets the condition when it becomes dominant (True) and keeps it, False, when it
stops; one that never dominated carries none, so a fleet of hundreds costs nothing while its mix
is stable. A condition lost to a concurrent write (the adapter's own reconcile replacing its
conditions from an older read) is written again at the next sync, without a second Event: Events
follow the tracker's decisions, which live in the operator's memory (a restart re-learns them over
one hold).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from loraplane.operator.api.basemodel import BaseModelSpec, DedicatedPolicy
from loraplane.operator.api.common import Condition
from loraplane.operator.runtime import cluster
from loraplane.operator.runtime.conditions import Status, set_condition
from loraplane.routing.dominance import DominanceTracker, dedicated_replicas

CONDITION = "DedicatedRecommended"
Event = tuple[dict[str, Any], str, str, str]  # (object, type, reason, message)


@dataclass
class DedicatedMemory:
    tracker: DominanceTracker | None = None
    policy: DedicatedPolicy | None = None
    dominant: set[str] = field(default_factory=set)  # served names, as last decided


def verdict(policy: DedicatedPolicy, tracker: DominanceTracker, served: str, pool: int) -> tuple[Status, str, str]:
    """The condition for an adapter the rule calls dominant (True, or False when the pool is too
    small to carve a deployment from), with the figures that justify it."""
    share, rps = tracker.share(served), tracker.tracks[served].rps
    replicas = dedicated_replicas(share, pool, policy.max_replicas)
    figures = (
        f"{100 * share:.1f}% of the base's requests ({rps:.2f} req/s), at or above {100 * policy.share:g}% for "
        f"{policy.hold_seconds} s"
    )
    if replicas == 0:
        return "False", "PoolTooSmall", f"{figures}; but spec.replicas={pool} leaves no replica for a dedicated deployment"
    return (
        "True",
        "Dominant",
        f"{figures}: a merged dedicated deployment of {replicas} of the base's {pool} replicas would serve it with no "
        "adapter overhead and free its slots for the tail (the rule `loraplane plan` applies)",
    )


def returned(policy: DedicatedPolicy) -> tuple[Status, str, str]:
    return (
        "False",
        "NoLongerDominant",
        f"below {100 * policy.return_share:g}% of the base's requests (or {policy.min_requests_per_second:g} req/s) for "
        f"{policy.return_seconds} s: the shared base serves it",
    )


async def sync_dedicated(
    namespace: str, base: BaseModelSpec, objects: Mapping[str, dict[str, Any]], rates: Mapping[str, float],
    memory: DedicatedMemory, now: float,
) -> list[Event]:  # fmt: skip
    """``objects``: the base's Ready LoraAdapters by served name; ``rates``: their request rates
    (those measured this sync). Writes the conditions that differ and returns the Events to post."""
    policy = base.dedicated
    if policy.mode == "off":
        memory.tracker, memory.policy, memory.dominant = None, None, set()
        for obj in objects.values():
            await _write(namespace, obj, None)
        return []
    if memory.tracker is None or memory.policy != policy:
        # A new tracker (the operator restarted, or the policy changed) starts from what the
        # adapters show, so a dominant adapter is not sent back and forth while it re-learns.
        shown = {served for served, obj in objects.items() if (_shown(obj) or {}).get("status") == "True"}
        memory.tracker, memory.policy = DominanceTracker(policy.rule()), policy
        memory.tracker.seed(shown)
        memory.dominant = shown
    tracker = memory.tracker
    if rates:  # the first sync after a start has no rate yet: nothing to decide from
        measured = {served: rates.get(served, 0.0) for served in objects}
        dominant = set(tracker.update(measured, now))
    else:
        dominant = memory.dominant & set(objects)
    events: list[Event] = []
    for served, obj in objects.items():
        if served in dominant:
            wanted = verdict(policy, tracker, served, base.replicas)
        elif served in memory.dominant or _shown(obj) is not None:
            wanted = returned(policy)
        else:
            continue
        if (served in dominant) != (served in memory.dominant):
            events.append((obj, "Normal", wanted[1], wanted[2]))
        await _write(namespace, obj, wanted)
    memory.dominant = dominant
    return events


def _shown(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c.get("type") == CONDITION), None)


async def _write(namespace: str, obj: dict[str, Any], wanted: tuple[Status, str, str] | None) -> None:
    """Set (or with None remove) the condition unless the object shows it already; the write
    replaces the conditions list, so it is made over the version read (a 409 waits a sync)."""
    shown = _shown(obj)
    if wanted is None and shown is None:
        return
    if wanted is not None and shown is not None and (shown.get("status"), shown.get("reason")) == wanted[:2]:
        return
    current = [Condition.model_validate(c) for c in (obj.get("status") or {}).get("conditions", [])]
    conditions = set_condition(current, CONDITION, *wanted) if wanted else [c for c in current if c.type != CONDITION]
    meta = obj["metadata"]
    try:
        await cluster.patch_status(
            namespace, "loraadapters", meta["name"], {"conditions": [c.body() for c in conditions]}, meta.get("resourceVersion")
        )
    except ApiException as err:
        if err.status not in (404, 409):  # deleted, or changed since the list: the next sync looks again
            raise
