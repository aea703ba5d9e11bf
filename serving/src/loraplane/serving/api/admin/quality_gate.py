"""Golden-output checks of a version before it serves, run beside live traffic.

A candidate is fetched and validated off the engine thread (a slow object store or a large
file's hash stalls no step), loaded under a private name, and its golden outputs are replayed
as ordinary teacher-forced requests, so the engine keeps stepping everyone else's requests in the
same batches and no replay consumes their outputs. The whole check runs under a deadline; the
candidate is dropped however it ends.

- ``/admin/verify`` (the operator's quality gate) reports the drift and registers nothing. One
  replay per version at a time: a caller asking for a version being verified waits for that
  replay (the operator's retry after a lost connection does not start a second one), and a
  replay whose callers have all gone away is cancelled, its requests aborted.
- ``/v1/load_lora_adapter`` replays the version's golden outputs when it ships any, with the
  engine's limits, and only then gives it its name: a refused version changes nothing, and a name
  that was serving keeps its old version.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from loraplane.adapter_format.digest import GOLDEN_FILE
from loraplane.adapter_format.golden import DriftLimits, DriftReport, GoldenOutputs, load_golden
from loraplane.adapter_format.names import check_adapter_name
from loraplane.admin_api import VERIFY_DEADLINE_SECONDS, VerifyRequest
from loraplane.serving.engine.async_engine import AsyncEngine
from loraplane.serving.engine.golden_replay import drift, forced_requests
from loraplane.serving.http.errors import APIError
from loraplane.serving.http.tenants import INTERNAL_TENANT
from loraplane.serving.lora.entries import AdapterSpec
from loraplane.serving.lora.peft_loader import LoadedAdapter


def _deadline_error(seconds: float) -> APIError:
    return APIError(504, f"the golden-output check did not finish within {seconds:g} s", type_="server_error",
                    code="verification_timeout")  # fmt: skip


async def _fetch(engine: AsyncEngine, spec: AdapterSpec) -> tuple[tuple[LoadedAdapter, str, float], GoldenOutputs | None]:
    """Off the engine thread: the validated weights and the golden outputs, if the version has any."""
    fetched = await asyncio.to_thread(engine.engine.adapters.fetch, spec)
    folder = Path(fetched[0].folder)
    golden = await asyncio.to_thread(load_golden, folder) if (folder / GOLDEN_FILE).is_file() else None
    return fetched, golden


async def _replay(engine: AsyncEngine, name: str, golden: GoldenOutputs, limits: DriftLimits) -> DriftReport:
    """The golden cases as ordinary requests on the adapter registered as ``name``; raises
    ``AdapterValidationError`` when the drift is over ``limits``."""
    paths, params = forced_requests(golden, engine.engine.base.config.vocab_size)

    async def run(i: int) -> None:
        async for _ in engine.generate(golden.cases[i].prompt_token_ids, params[i], name, f"{name}-{i}"):
            pass

    await asyncio.gather(*(run(i) for i in range(len(golden.cases))))
    report = drift(golden, paths)
    report.check(limits)
    return report


async def _drop(engine: AsyncEngine, name: str) -> None:
    adapters = engine.engine.adapters
    await engine.call(lambda: adapters.unregister(name) if name in adapters.entries else None)


async def verify_candidate(engine: AsyncEngine, req: VerifyRequest, deadline: float = VERIFY_DEADLINE_SECONDS) -> DriftReport:
    """The drift report; AdapterValidationError when the files are bad or the drift is too high,
    APIError 400 when the candidate ships no golden outputs, 504 past ``deadline``."""
    name = f"quality-gate-{uuid.uuid4().hex[:12]}"
    spec = AdapterSpec(name, req.lora_path, req.digest, INTERNAL_TENANT, req.allow_rank_truncation)
    adapters = engine.engine.adapters
    try:
        async with asyncio.timeout(deadline):
            fetched, golden = await _fetch(engine, spec)
            if golden is None:
                raise APIError(400, f"the quality gate needs {GOLDEN_FILE} next to the weights; this version has none",
                               code="golden_outputs_missing", param="lora_path")  # fmt: skip
            await engine.call(lambda: adapters.install(spec, adapters.prepare(spec, fetched)))
            limits = DriftLimits(min_token_agreement=req.min_token_agreement, max_mean_kl=req.max_mean_kl)
            return await _replay(engine, name, golden, limits)
    except TimeoutError:
        raise _deadline_error(deadline) from None
    finally:
        await _drop(engine, name)


class SharedVerifies:
    """The replica's verifies in flight, one per candidate version (the whole request: source,
    digest and limits). Each runs as a task of its own that its callers await; when the last of
    them stops waiting (its client went away), the task is cancelled."""

    def __init__(self) -> None:
        self.running: dict[str, tuple[asyncio.Task[DriftReport], list[int]]] = {}

    async def verify(self, engine: AsyncEngine, req: VerifyRequest) -> DriftReport:
        key = req.model_dump_json()
        entry = self.running.get(key)
        if entry is None:
            task = asyncio.ensure_future(verify_candidate(engine, req))
            entry = self.running[key] = (task, [0])
            task.add_done_callback(lambda _: self.running.pop(key, None) if self.running.get(key) is entry else None)
        task, waiting = entry
        waiting[0] += 1
        try:
            return await asyncio.shield(task)
        finally:
            waiting[0] -= 1
            if not waiting[0] and not task.done():
                task.cancel()  # nobody waits for it any more: its requests are aborted, its candidate dropped
                if self.running.get(key) is entry:
                    del self.running[key]


async def load_adapter(engine: AsyncEngine, spec: AdapterSpec, deadline: float = VERIFY_DEADLINE_SECONDS) -> None:
    """Fetch, validate and (when it ships golden outputs) replay ``spec`` beside traffic, then
    register it under its name; raises the validation or drift error, changing nothing."""
    adapters = engine.engine.adapters
    current = await engine.call(lambda: adapters.entries.get(spec.name))
    if current is not None and current.spec == spec and current.loaded is not None:
        return
    check_adapter_name(spec.name)
    candidate = AdapterSpec(f"candidate-{uuid.uuid4().hex[:12]}", spec.source, spec.digest, INTERNAL_TENANT,
                            spec.allow_rank_truncation)  # fmt: skip
    try:
        async with asyncio.timeout(deadline):
            fetched, golden = await _fetch(engine, spec)
            if golden is not None:
                await engine.call(lambda: adapters.install(candidate, fetched[0]))
                config = engine.engine.config
                limits = DriftLimits(min_token_agreement=config.golden_min_token_agreement, max_mean_kl=config.golden_max_mean_kl)
                await _replay(engine, candidate.name, golden, limits)
    except TimeoutError:
        raise _deadline_error(deadline) from None
    finally:
        await _drop(engine, candidate.name)
    await engine.call(lambda: adapters.install(spec, adapters.prepare(spec, fetched)))
