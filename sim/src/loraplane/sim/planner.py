"""``loraplane plan``: from a table of fine-tunes and a budget to slot counts, rank cap and replicas.

Every decision is a pure function of the input and comes with a one-line reason, in the order an
engineer would argue it: first take an adapter that dominates the base's traffic out of the shared
pool (a merged dedicated deployment, by the rule the operator applies:
``loraplane.routing.dominance``), then cap ranks so slots are not sized for the rare high-rank
adapter, then size device slots and the host tier from memory, then replicas from load, and finally ask the
simulator what hit rates and load waits that plan gets on a trace with the same traffic mix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loraplane.routing.dominance import DominanceRule, dedicated_replicas, shares, steady_dominant
from loraplane.sim.plan_input import FineTune, PlanInput
from loraplane.sim.replicas import ReplicaResult, simulate_replicas
from loraplane.sim.trace import weighted_trace

GIB_MB = 1024.0


@dataclass(frozen=True)
class Adapter:
    name: str
    rps: float
    rank: int
    size_mb: float


@dataclass
class Plan:
    merged: list[tuple[Adapter, int]]  # adapter, dedicated replicas
    shared: list[Adapter]
    rank_cap: int
    above_cap: list[Adapter]
    slot_mb: float
    slot_mb_uncapped: float
    gpu_slots: int
    host_slots: int
    replicas: int
    reasons: list[str] = field(default_factory=list)


def _adapters(spec: PlanInput) -> list[Adapter]:
    def rps(f: FineTune) -> float:
        if f.rps is not None:
            return f.rps
        assert f.share is not None and spec.total_rps is not None
        return f.share * spec.total_rps

    out = [Adapter(f.name, rps(f), f.rank, f.size_mb or spec.base.adapter_mb(f.rank)) for f in spec.fine_tunes()]
    return sorted(out, key=lambda a: (-a.rps, a.name))


def _coverage_count(adapters: list[Adapter], share: float) -> int:
    """How many of the hottest adapters carry ``share`` of their traffic."""
    total = sum(a.rps for a in adapters)
    acc = 0.0
    for i, a in enumerate(adapters, start=1):
        acc += a.rps
        if acc >= share * total - 1e-12:
            return i
    return len(adapters)


def make_plan(spec: PlanInput) -> Plan:
    """Merge the adapters that dominate the base's traffic, size the multi-LoRA pool for the
    rest and say why at each step. One pass on purpose: ``reasons`` is the plan's explanation, in
    the order the decisions were taken."""
    knobs, budget = spec.knobs, spec.budget
    adapters = _adapters(spec)
    reasons: list[str] = []

    rule = DominanceRule(
        share=knobs.dedicated_share,
        return_share=knobs.dedicated_share,
        min_rps=knobs.dedicated_min_rps,
        max_dedicated=knobs.max_dedicated,
    )
    share = shares({a.name: a.rps for a in adapters})
    total_rps = sum(a.rps for a in adapters)
    pool = math.ceil(total_rps / (budget.replica_rps * knobs.target_utilization))  # every adapter on the shared base
    dominant = set(steady_dominant(rule, {a.name: a.rps for a in adapters}))
    merged = []
    for a in adapters:
        n = dedicated_replicas(share[a.name], pool, budget.max_replicas) if a.name in dominant else 0
        if a.name in dominant and n == 0:
            reasons.append(
                f"keep {a.name} shared: it carries {100 * share[a.name]:.1f}% of requests (dominant from "
                f"{100 * rule.share:g}%), but {pool} replica(s) leave none to carve a dedicated deployment out of"
            )
        elif n:
            merged.append((a, n))
            reasons.append(
                f"merge {a.name}: {100 * share[a.name]:.1f}% of requests ({a.rps:.1f} req/s; dominant from "
                f"{100 * rule.share:g}%), so a dedicated merged deployment of {n} of the {pool} replica(s) the whole "
                "base needs serves it with no adapter overhead and frees its slots for the tail"
            )
    if not dominant and adapters:
        top = adapters[0]
        reasons.append(
            f"no dedicated deployment: the busiest adapter, {top.name}, carries {100 * share[top.name]:.1f}% of requests "
            f"({top.rps:.1f} req/s), under the {100 * rule.share:g}% (and {rule.min_rps:g} req/s) that make one dominant"
        )
    merged_names = {a.name for a, _ in merged}
    shared = [a for a in adapters if a.name not in merged_names]
    if not shared:
        reasons.append("every adapter is heavy enough for its own deployment; no shared pool is needed")
        return Plan(merged, [], 0, [], 0.0, 0.0, 0, 0, 0, reasons)
    shared_rps = sum(a.rps for a in shared)

    by_rank = sorted(shared, key=lambda a: a.rank)
    rank_cap = by_rank[-1].rank
    acc = 0.0
    for a in by_rank:
        acc += a.rps
        if shared_rps == 0 or acc >= knobs.rank_cap_coverage * shared_rps - 1e-12:
            rank_cap = a.rank
            break
    above = [a for a in shared if a.rank > rank_cap]
    mb_per_rank = max(a.size_mb / a.rank for a in shared)
    slot_mb = mb_per_rank * rank_cap
    slot_mb_uncapped = mb_per_rank * by_rank[-1].rank
    above_share = sum(a.rps for a in above) / shared_rps if shared_rps else 0.0
    reasons.append(
        f"rank cap {rank_cap}: ranks up to {rank_cap} carry {100 * (1 - above_share):.1f}% of shared traffic; "
        f"{len(above)} adapter(s) above it ({100 * above_share:.1f}% of traffic) must be truncated or retrained; "
        f"a slot costs {slot_mb:.0f} MB instead of {slot_mb_uncapped:.0f} MB at rank {by_rank[-1].rank}"
    )

    gpu_mb = budget.gpu_adapter_memory_gib * GIB_MB * (1 - knobs.headroom)
    gpu_slots = max(0, min(len(shared), int(gpu_mb // slot_mb)))
    uncapped_slots = int(gpu_mb // slot_mb_uncapped)
    hot_share = sum(a.rps for a in shared[:gpu_slots]) / shared_rps if shared_rps else 0.0
    reasons.append(
        f"GPU slots {gpu_slots}: {budget.gpu_adapter_memory_gib:g} GiB less {100 * knobs.headroom:.0f}% headroom at "
        f"{slot_mb:.0f} MB a slot (only {uncapped_slots} without the cap); the {gpu_slots} hottest adapters carry "
        f"{100 * hot_share:.1f}% of shared traffic"
    )

    host_mb = budget.host_memory_gib * GIB_MB * (1 - knobs.headroom)
    used, host_slots = 0.0, 0
    for a in shared:  # hottest first: the host tier should hold the working set, not random tail
        size = min(a.size_mb, slot_mb)
        if used + size > host_mb:
            break
        used += size
        host_slots += 1
    working_set = _coverage_count(shared, 0.95)
    if host_slots >= len(shared):
        reasons.append(
            f"host slots {host_slots}: all {len(shared)} shared adapters fit in {used / GIB_MB:.1f} GiB of "
            f"{budget.host_memory_gib:g} GiB, so cold loads happen only on first touch"
        )
    else:
        advice = "" if host_slots >= working_set else ", so expect cold loads: add host memory first, not GPU slots"
        reasons.append(
            f"host slots {host_slots}: {budget.host_memory_gib:g} GiB holds the {host_slots} hottest; "
            f"the working set for 95% of traffic is {working_set} adapters{advice}"
        )

    needed = math.ceil(shared_rps / (budget.replica_rps * knobs.target_utilization))
    replicas = max(1, min(needed, budget.max_replicas))
    reasons.append(
        f"replicas {replicas}: {shared_rps:.1f} req/s of shared traffic at {budget.replica_rps:g} req/s per replica and "
        f"{100 * knobs.target_utilization:.0f}% target utilisation"
        + (f"; {needed} would be needed, the budget caps it at {budget.max_replicas}" if needed > budget.max_replicas else "")
        + f" (one merged deployment per fine-tune would need {len(adapters)})"
    )
    return Plan(merged, shared, rank_cap, above, slot_mb, slot_mb_uncapped, gpu_slots, host_slots, replicas, reasons)


def predict(plan: Plan, spec: PlanInput, *, routing: str = "affinity") -> ReplicaResult | None:
    """The simulator's figures for the plan on a trace with the shared pool's traffic mix."""
    if not plan.shared:
        return None
    shared_rps = sum(a.rps for a in plan.shared)
    weights = [a.rps for a in plan.shared]
    if not sum(weights) > 0:
        return None
    trace = weighted_trace(
        weights,
        [a.name for a in plan.shared],
        spec.knobs.requests_to_simulate,
        rate_rps=shared_rps,
        tokens=spec.budget.max_num_seqs,
    )
    # tokens_per_s chosen so a request holds its replica for max_num_seqs / replica_rps seconds:
    # a replica at full load then has max_num_seqs sequences in flight, as the bound expects.
    return simulate_replicas(
        trace,
        plan.replicas,
        plan.gpu_slots,
        plan.host_slots,
        routing,
        policy=spec.knobs.policy,
        tokens_per_s=spec.budget.replica_rps,
    )
