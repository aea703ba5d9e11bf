"""What the BaseModel sync writes into its LoraAdapters' status: what the replicas reported, never
a snapshot older than the adapter itself."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from loraplane.admin_api import AdapterState
from loraplane.operator.api.loraadapter import LoraAdapterSpec
from loraplane.operator.runtime import base_sync
from loraplane.operator.runtime.adapter_flow import parse_status
from loraplane.operator.runtime.base_sync import AdapterView, BaseMemory
from loraplane.operator.runtime.settings import OperatorSettings


def _view(*, asked: bool, shown: bool) -> AdapterView:
    """A Ready adapter whose manifest asks for a pin (``asked``) and whose status shows ``shown``."""
    spec = LoraAdapterSpec.model_validate(
        {"baseModel": "tiny", "tenant": "acme", "source": {"uri": "s3://a/support", "digest": "sha256:" + "0" * 64},
         "pinned": asked}
    )  # fmt: skip
    return AdapterView("support", "support", spec, parse_status({"phase": "Ready", "pinned": shown}))


@pytest.fixture
def patches(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []

    async def patch_status(namespace: str, plural: str, name: str, patch: dict[str, Any]) -> None:
        seen.append(patch)

    monkeypatch.setattr(base_sync.cluster, "patch_status", patch_status)
    return seen


def test_an_adapter_staged_after_the_stats_were_read_keeps_its_status(patches: list[dict[str, Any]]) -> None:
    """Ready and pinned by its own reconcile between the sync's stats and its listing: no replica
    listed it, so nothing is written over its status (a `pinned: false` from no entries was)."""
    write = base_sync._write_metrics
    settings = OperatorSettings()
    asyncio.run(write("ns", {"support": _view(asked=True, shown=True)}, {"r0": {}, "r1": {}}, BaseMemory(), settings, None))
    assert patches == []
    # What the replicas report is written: pinned on both once they say so, and not pinned while
    # one refuses the pin.
    stats = {f"r{i}": {"support": AdapterState(tier="device", pinned=True)} for i in range(2)}
    asyncio.run(write("ns", {"support": _view(asked=True, shown=False)}, stats, BaseMemory(), settings, None))
    (patch,) = patches
    assert patch["pinned"] is True and [p["replica"] for p in patch["replicas"]] == ["r0", "r1"]
    stats["r1"]["support"] = AdapterState(tier="device", pinned=False)
    asyncio.run(write("ns", {"support": _view(asked=True, shown=True)}, stats, BaseMemory(), settings, None))
    assert len(patches) == 2 and patches[-1]["pinned"] is False
