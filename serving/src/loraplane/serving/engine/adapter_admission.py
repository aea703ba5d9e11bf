"""Admitting an adapter version under a name: fetch and validate it, replay its golden outputs
(when it ships any) under a private name, and only then let it take the name. A refused load or
reload changes nothing: a name that was serving keeps serving its old version."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from loraplane.adapter_format import AdapterValidationError, check_adapter_name
from loraplane.adapter_format.digest import GOLDEN_FILE
from loraplane.adapter_format.golden import DriftLimits, DriftReport, load_golden
from loraplane.adapter_format.names import INTERNAL_OWNER
from loraplane.serving.engine.golden_replay import replay_golden
from loraplane.serving.lora.entries import AdapterInfo, AdapterSpec

if TYPE_CHECKING:  # the replay generates through the engine; only its type is needed here
    from loraplane.serving.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)


def load_lora(engine: LLMEngine, spec: AdapterSpec) -> AdapterInfo:
    """Load ``spec`` into host memory now and register it, raising the validation (or golden
    drift) error if it fails."""
    adapters = engine.adapters
    current = adapters.entries.get(spec.name)
    if current is not None and current.spec == spec and current.loaded is not None:
        return adapters.info(spec.name)
    check_adapter_name(spec.name)
    loaded = adapters.prepare(spec)
    if (loaded.folder / GOLDEN_FILE).is_file():  # verify_golden reads and replays it
        candidate = f"candidate-{uuid.uuid4().hex[:12]}"
        adapters.install(dataclasses.replace(spec, name=candidate, tenant=INTERNAL_OWNER), loaded)
        try:
            verify_golden(engine, candidate)  # unregisters the candidate when it drifts
        finally:
            if candidate in adapters.entries:
                adapters.unregister(candidate)
    adapters.install(spec, loaded)
    info = adapters.info(spec.name)
    log.info("loaded adapter %s (rank %s, %s)", spec.name, info.rank, (info.digest or "")[:19])
    return info


def verify_golden(engine: LLMEngine, name: str, limits: DriftLimits | None = None) -> DriftReport | None:
    """Replay the adapter's golden outputs (if it ships any) on this base; unregister it and
    raise ``GoldenOutputDrift`` when the drift is above ``limits`` (the config's by default)."""
    adapters = engine.adapters
    folder = adapters.info(name).folder or Path(adapters.load_now(name).folder)
    golden = load_golden(folder)
    if golden is None:
        return None
    config = engine.config
    default = DriftLimits(min_token_agreement=config.golden_min_token_agreement, max_mean_kl=config.golden_max_mean_kl)
    try:  # ids outside this base's vocabulary are refused before they reach a step
        report = replay_golden(engine, name, golden)
        report.check(limits or default)
    except AdapterValidationError:
        adapters.unregister(name)
        raise
    return report
