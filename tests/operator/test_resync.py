"""The base sync's resync of adapters kopf has nothing left to react to (``base_sync._resync_stalled``):
an adapter whose reconcile's outcome was never written, or that still waits, and that nothing has
changed for ``resync_interval`` seconds, is touched once; a settled one, one still changing and
one deleted meanwhile cost nothing and break nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from loraplane.operator.runtime import base_sync, cluster
from loraplane.operator.runtime.base_sync import BaseMemory
from loraplane.operator.runtime.settings import OperatorSettings

SETTINGS = OperatorSettings(resync_interval=30)


def adapter(name: str, version: str, generation: int = 1, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "resourceVersion": version, "generation": generation},
        "spec": {"baseModel": "tiny"},
        "status": status,
    }


@pytest.fixture
def touched(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    names: list[str] = []

    async def annotate(namespace: str, plural: str, name: str, annotations: dict[str, str]) -> None:
        if name == "gone":
            raise ApiException(status=404)
        assert list(annotations) == ["loraplane.dev/resync-requested"]
        names.append(name)

    monkeypatch.setattr(cluster, "annotate", annotate)
    return names


def test_only_an_unfinished_adapter_left_unchanged_is_touched(touched: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(base_sync.time, "monotonic", lambda: clock[0])
    memory = BaseMemory()
    waiting = {"observedGeneration": 1, "conditions": [{"type": "Ready", "status": "False", "reason": "StoreUnreachable"}]}
    failed = {"observedGeneration": 1, "conditions": [{"type": "Ready", "status": "False", "reason": "DigestMismatch"}]}
    objects = [
        adapter("lost", "7"),  # no status was ever written for its generation
        adapter("waits", "8", **waiting),
        adapter("settled", "9", observedGeneration=1, phase="Ready"),
        adapter("failed", "10", **failed),  # a verdict, not a wait
        adapter("gone", "11"),
        {**adapter("elsewhere", "12"), "spec": {"baseModel": "other"}},
    ]

    def sync() -> None:
        asyncio.run(base_sync._resync_stalled("tiny", "team-a", objects, memory, SETTINGS))

    sync()
    assert touched == []  # first seen now
    clock[0] += 29
    sync()
    assert touched == []
    objects[1] = adapter("waits", "13", **waiting)  # kopf's retry changed it: timed again from here
    clock[0] += 1
    sync()
    assert touched == ["lost"]  # "gone" was deleted meanwhile (404): skipped, the sync goes on
    clock[0] += 30
    sync()
    assert touched == ["lost", "lost", "waits"]
