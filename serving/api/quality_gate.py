"""A quality gate for a candidate version: load it under a private name, replay its golden outputs
on this replica's base as ordinary requests (so traffic keeps flowing beside them), report the
drift, and drop the candidate again. The operator calls it before it registers a version whose
LoraAdapter sets ``spec.qualityGate``; nothing here changes what callers are served."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from loraplane.adapter_format.golden import GOLDEN_FILE, DriftLimits, DriftReport, load_golden
from loraplane.serving.api.async_engine import AsyncEngine
from loraplane.serving.api.errors import APIError
from loraplane.serving.api.protocol import VerifyRequest
from loraplane.serving.api.tenants import INTERNAL_TENANT
from loraplane.serving.lora.golden_replay import drift, forced_requests
from loraplane.serving.lora.manager import AdapterSpec


async def verify_candidate(engine: AsyncEngine, req: VerifyRequest) -> DriftReport:
    """The drift report; AdapterValidationError when the files are bad or the drift is too high,
    APIError 400 when the candidate ships no golden outputs to replay."""
    name = f"quality-gate-{uuid.uuid4().hex[:12]}"
    spec = AdapterSpec(name, req.lora_path, req.digest, INTERNAL_TENANT, req.allow_rank_truncation)
    await engine.call(lambda: engine.engine.register_lora(spec))
    try:
        await engine.call(lambda: engine.engine.adapters.load_now(name))
        folder = await engine.call(lambda: engine.engine.adapters.info(name).folder)
        golden = load_golden(Path(folder)) if folder is not None else None
        if golden is None:
            raise APIError(400, f"the quality gate needs {GOLDEN_FILE} next to the weights; this version has none",
                           code="golden_outputs_missing", param="lora_path")  # fmt: skip
        paths, params = forced_requests(golden, engine.engine.base.config.vocab_size)

        async def run(i: int) -> None:
            async for _ in engine.generate(golden.cases[i].prompt_token_ids, params[i], name, f"{name}-{i}"):
                pass

        await asyncio.gather(*(run(i) for i in range(len(golden.cases))))
        report = drift(golden, paths)
        report.check(DriftLimits(min_token_agreement=req.min_token_agreement, max_mean_kl=req.max_mean_kl))
        return report
    finally:
        await engine.call(lambda: engine.engine.adapters.unregister(name) if name in engine.engine.adapters.entries else None)
