"""The dedicated-deployment policy as the operator applies it each sync: the condition and Event on
the dominant adapter, written only at the decision's edges."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from loraplane.operator.api.basemodel import BaseModelSpec
from loraplane.operator.runtime import dedicated_sync
from loraplane.operator.runtime.dedicated_sync import DedicatedMemory, sync_dedicated

READY = {"type": "Ready", "status": "True", "reason": "Ready", "lastTransitionTime": "2026-12-06T00:00:00Z"}
POLICY = {"mode": "recommend", "share": 0.3, "holdSeconds": 60, "returnShare": 0.2, "returnSeconds": 120}


def base(**dedicated: Any) -> BaseModelSpec:
    return BaseModelSpec.model_validate({"source": {"uri": "embedded"}, "replicas": 4, "dedicated": {**POLICY, **dedicated}})


def adapter(name: str, conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "loraplane.dev/v1alpha1", "kind": "LoraAdapter",
        "metadata": {"name": name, "namespace": "ns", "resourceVersion": "7", "uid": name},
        "status": {"phase": "Ready", "conditions": conditions or [READY]},
    }  # fmt: skip


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any], str | None]]:
    seen: list[tuple[str, dict[str, Any], str | None]] = []

    async def patch_status(namespace: str, plural: str, name: str, patch: dict[str, Any], version: str | None = None) -> None:
        seen.append((name, patch, version))

    monkeypatch.setattr(dedicated_sync.cluster, "patch_status", patch_status)
    return seen


def shown(patch: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in patch["conditions"] if c["type"] == "DedicatedRecommended")


def test_a_dominant_adapter_is_told_once_and_told_again_when_it_returns(writes: list[Any]) -> None:
    objects = {n: adapter(n) for n in ("hot", *[f"t{i}" for i in range(6)])}
    rates = {"hot": 6.0, **{f"t{i}": 1.0 for i in range(6)}}  # hot: 50%
    memory = DedicatedMemory()

    def sync(at: float, rates: dict[str, float], **policy: Any) -> list[Any]:
        return asyncio.run(sync_dedicated("ns", base(**policy), objects, rates, memory, at))

    assert sync(0, rates) == [] and writes == []  # above the line since now: nothing to say yet
    events = sync(60, rates)
    assert [(o["metadata"]["name"], t, r) for o, t, r, _ in events] == [("hot", "Normal", "Dominant")]
    ((name, patch, version),) = writes
    condition = shown(patch)
    assert (name, version, condition["status"], condition["reason"]) == ("hot", "7", "True", "Dominant")
    assert "50.0% of the base's requests (6.00 req/s)" in condition["message"]
    assert "a merged dedicated deployment of 2 of the base's 4 replicas" in condition["message"]
    assert [c["type"] for c in patch["conditions"]] == ["Ready", "DedicatedRecommended"]  # the others kept
    # Shown on the object now: later syncs write nothing, however the figures move.
    objects["hot"] = adapter("hot", patch["conditions"])
    assert sync(90, {**rates, "hot": 9.0}) == [] and len(writes) == 1
    # The condition lost to a concurrent write (the adapter's reconcile replaced its conditions from
    # an older read): written again, with no second Event.
    objects["hot"] = adapter("hot")
    assert sync(100, rates) == [] and len(writes) == 2
    objects["hot"] = adapter("hot", writes[-1][1]["conditions"])
    quiet = {**rates, "hot": 0.5}  # 7.7%
    assert sync(200, quiet) == []
    events = sync(320, quiet)
    assert [(o["metadata"]["name"], r) for o, _, r, _ in events] == [("hot", "NoLongerDominant")]
    assert shown(writes[-1][1])["status"] == "False" and len(writes) == 3
    # Turning the policy off removes what it wrote.
    objects["hot"] = adapter("hot", writes[-1][1]["conditions"])
    assert sync(330, quiet, mode="off") == []
    assert [c["type"] for c in writes[-1][1]["conditions"]] == ["Ready"]


def test_a_restarted_operator_keeps_a_dominant_adapter_it_cannot_yet_measure(writes: list[Any]) -> None:
    dominant = [{"type": "DedicatedRecommended", "status": "True", "reason": "Dominant", "message": "m",
                 "lastTransitionTime": "2026-12-06T00:00:00Z"}]  # fmt: skip
    objects = {"hot": adapter("hot", dominant), **{f"t{i}": adapter(f"t{i}") for i in range(6)}}
    memory = DedicatedMemory()
    assert asyncio.run(sync_dedicated("ns", base(), objects, {}, memory, 0)) == []  # no rate yet
    rates = {"hot": 2.0, **{f"t{i}": 1.0 for i in range(6)}}  # 25%: between the lines
    assert asyncio.run(sync_dedicated("ns", base(), objects, rates, memory, 10)) == []
    assert writes == [] and memory.dominant == {"hot"}


def test_a_pool_of_one_replica_says_why_nothing_would_be_carved(writes: list[Any]) -> None:
    objects = {"hot": adapter("hot"), "t": adapter("t")}
    memory = DedicatedMemory()
    spec = BaseModelSpec.model_validate({"source": {"uri": "embedded"}, "replicas": 1, "dedicated": {**POLICY, "holdSeconds": 0}})
    (event,) = asyncio.run(sync_dedicated("ns", spec, objects, {"hot": 9.0, "t": 1.0}, memory, 0))
    assert event[2] == "PoolTooSmall" and shown(writes[0][1])["status"] == "False"
    assert "spec.replicas=1 leaves no replica" in event[3]
