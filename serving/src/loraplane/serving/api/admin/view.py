"""The engine as the admin API shows it: ``/admin/stats`` and one adapter's state, built from the
engine's adapter manager and metrics into the contract's models (``loraplane.admin_api``).

Kept beside the admin routes rather than in the engine, which only steps. Each function reads
engine state, so the routes run it on the engine's thread (``AsyncEngine.call``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from loraplane.adapter_format.names import INTERNAL_OWNER
from loraplane.admin_api import AdapterState, NamedAdapterState, Quotas, ReplicaStats, Tier
from loraplane.serving.engine.llm_engine import LLMEngine
from loraplane.serving.lora.entries import AdapterNotFound
from loraplane.serving.metrics import NONE

S = TypeVar("S", bound=AdapterState)


def adapter_state(engine: LLMEngine, name: str, quotas: Quotas | None = None) -> AdapterState:
    return _state(AdapterState, engine, name, quotas)


def named_adapter_state(engine: LLMEngine, name: str, quotas: Quotas | None = None) -> NamedAdapterState:
    if name not in engine.adapters.entries:
        raise AdapterNotFound(name)
    return _state(NamedAdapterState, engine, name, quotas, name=name)


def _state(cls: type[S], engine: LLMEngine, adapter: str, quotas: Quotas | None, **extra: str) -> S:
    """One adapter's registration, tier and counters (``dict`` of the counters keeps their nested
    models as they are, rather than dumping and validating them again)."""
    info = engine.adapters.info(adapter)
    counts = engine.metrics.counters(engine.metrics.counts[adapter])
    return cls(
        **dict(counts),
        **extra,
        tenant=info.tenant,
        version=info.version,
        source=info.source,
        tier=info.residency,
        pinned=info.pinned,
        running=info.running,
        rank=info.rank,
        digest=info.digest,
        quotas=quotas,
    )


def replica_stats(engine: LLMEngine, quotas: Mapping[str, Quotas] | None = None) -> ReplicaStats:
    """Every adapter's state with its own quotas (what the router enforces at the edge too),
    per-tenant counters, queue depths and the node's disk cache."""
    quotas = quotas or {}
    # A quality gate's candidate lives under a private name for the seconds of its replay: it is
    # no served name, and the operator, which owns the served names, would unregister it mid-replay.
    served = [name for name, entry in engine.adapters.entries.items() if entry.spec.tenant != INTERNAL_OWNER]
    adapters = {name: adapter_state(engine, name, quotas.get(name)) for name in served}
    if engine.base.merged:  # a dedicated replica: its requests are its adapter's, which the operator counts
        adapters[engine.base.shape.name] = merged_state(engine, quotas.get(engine.base.shape.name))
    return ReplicaStats(
        adapters=adapters,
        tenants={t: engine.metrics.counters(c) for t, c in engine.metrics.tenants.items()},
        preemptions=engine.scheduler.num_preemptions,
        waiting=len(engine.scheduler.waiting),
        running=len(engine.scheduler.running),
        parked=len(engine.scheduler.parked),
        parks=engine.scheduler.num_parks,
        interjections=engine.num_interjections,
        device_prefetches=engine.adapters.device_prefetches,
        disk_cache=engine.adapters.files.figures(),
        max_model_len=engine.max_model_len,
        dedicated_model=engine.base.shape.name if engine.base.merged else None,
    )


def merged_state(engine: LLMEngine, quotas: Quotas | None) -> AdapterState:
    """A dedicated replica's one model as an adapter entry (always on the device, in the weights):
    its request counters are the base's, since the adapter is the base here, and the operator
    sums them with the shared replicas' into the adapter's rate, so serving it dedicated does not
    read as its traffic gone. Its quotas, as the router reads them to enforce at the edge."""
    config = engine.config
    counts = engine.metrics.counters(engine.metrics.counts[NONE])
    return AdapterState(
        **dict(counts),
        tenant=config.merged_lora_tenant,
        source=config.merged_lora or config.model,
        tier=Tier.DEVICE,
        pinned=True,
        digest=config.merged_lora_digest,
        quotas=quotas,
    )
