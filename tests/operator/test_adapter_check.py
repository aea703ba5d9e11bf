"""The operator's fetch-and-check of an adapter runs on threads of its own, under a deadline: a
slow or hanging object store must not hold the threads every Kubernetes API call runs on."""

from __future__ import annotations

import asyncio
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from crd_schema import examples
from small_disk import fill, small_disk

from loraplane.adapter_format import BaseShape
from loraplane.adapter_format.sources import S3Settings
from loraplane.operator.api.basemodel import BaseModelSpec
from loraplane.operator.api.loraadapter import LoraAdapterSpec
from loraplane.operator.runtime import adapter_check
from loraplane.serving.http.loopback import free_port

SPEC = LoraAdapterSpec.model_validate(next(d for d in examples() if d["kind"] == "LoraAdapter")["spec"])
ENGINE = BaseModelSpec.model_validate(next(d for d in examples() if d["kind"] == "BaseModel")["spec"]).engine
SHAPE = BaseShape(name="b", hidden_size=8, intermediate_size=16, num_layers=1, num_attention_heads=2, num_kv_heads=1)


def test_a_hanging_store_holds_only_the_fetch_threads_and_each_fetch_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def hanging(*_: Any) -> None:
        release.wait(60)  # a store that accepted the connection and never answers

    monkeypatch.setattr(adapter_check, "check_adapter", hanging)

    async def story() -> list[BaseException | None]:
        fetches = [
            asyncio.create_task(adapter_check.check_adapter_off_loop(SPEC, SHAPE, ENGINE, deadline=1.0)) for _ in range(40)
        ]
        await asyncio.sleep(0.1)  # every fetch has asked for a thread
        # What cluster.py does for each Kubernetes API call: answered while every fetch hangs.
        await asyncio.wait_for(asyncio.gather(*(asyncio.to_thread(lambda: None) for _ in range(40))), 10)
        outcomes = await asyncio.gather(*fetches, return_exceptions=True)
        release.set()
        return outcomes

    outcomes = asyncio.run(story())
    assert all(isinstance(o, TimeoutError) for o in outcomes), outcomes


def test_a_fetch_past_its_deadline_stops_and_is_retried_not_failed(tiny_adapters: dict[str, Any]) -> None:
    """The fetch itself stops at the deadline (the thread is free again), and the adapter is not
    marked Failed for it: a slow store is a reason to try again, not a verdict on its files."""
    spec = SPEC.model_copy(update={"source": SPEC.source.model_copy(update={"uri": str(tiny_adapters["qv4"]), "digest": None})})
    with pytest.raises(TimeoutError):
        adapter_check.check_adapter(spec, SHAPE, ENGINE, deadline=0.0)


def test_a_full_scratch_volume_defers_the_check_instead_of_failing_the_adapter(
    tiny_adapters: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator's /tmp full (a real full volume): the adapter's files are not at fault, so the
    check is deferred (retried later), never a Failed adapter; with room again it passes."""
    spec = SPEC.model_copy(update={"source": SPEC.source.model_copy(update={"uri": str(tiny_adapters["qv4"]), "digest": None})})
    with small_disk(tmp_path / "scratch", 64) as disk:
        monkeypatch.setattr(tempfile, "tempdir", str(disk))
        filler = fill(disk)
        with pytest.raises(adapter_check.CheckDeferred) as deferred:
            adapter_check.check_adapter(spec, SHAPE, ENGINE)
        assert deferred.value.reason == "ScratchFull" and list(disk.iterdir()) == [filler]
        filler.unlink()
        with pytest.raises(adapter_check.CheckFailed) as failed:  # checked now: a base of another shape
            adapter_check.check_adapter(spec, SHAPE, ENGINE)
        assert failed.value.reason == "BaseMismatch"


def test_a_store_refusing_connections_defers_the_check_instead_of_failing_the_adapter() -> None:
    """Nothing listens at the store's address (its pods restarting): the adapter is not at fault,
    so the check is deferred with a reason a person can read, and the handler retries it."""
    spec = SPEC.model_copy(update={"source": SPEC.source.model_copy(update={"uri": "s3://adapters/acme/support"})})
    s3 = S3Settings(endpoint=f"http://127.0.0.1:{free_port()}", access_key="a", secret_key="b", region="us-east-1")
    with pytest.raises(adapter_check.CheckDeferred) as deferred:
        adapter_check.check_adapter(spec, SHAPE, ENGINE, s3)
    assert deferred.value.reason == "StoreUnreachable" and s3.endpoint in deferred.value.message
    assert deferred.value.reason in adapter_check.DEFERRED_REASONS
