"""Plain-text tables for the simulator, column for column with the seed lesson's output."""

from __future__ import annotations

from collections.abc import Sequence

from loraplane.sim.replicas import ReplicaResult
from loraplane.sim.tiers import TierResult

TIER_HEADER = "GPU slots  host slots  GPU hit  host hit  disk loads  mean load wait/request"


def _tier_cells(r: TierResult) -> str:
    return (
        f"{r.gpu_slots:>9}{r.host_slots:>12}{100 * r.gpu_hit_rate:>8.1f}%{100 * r.host_hit_rate:>9.1f}%"
        f"{r.cold_loads:>12}{r.mean_wait_ms:>13.2f} ms"
    )


def tier_table(results: Sequence[TierResult], *, show_policy: bool = False) -> str:
    width = max([len(r.policy) for r in results] + [len("policy")])
    lines = [f"{'policy':<{width}}  {TIER_HEADER}" if show_policy else TIER_HEADER]
    for r in results:
        lines.append(f"{r.policy:<{width}}  {_tier_cells(r)}" if show_policy else _tier_cells(r))
    return "\n".join(lines)


def comparison_table(results: Sequence[TierResult], baseline: TierResult, belady: TierResult, bound_ms: float) -> str:
    """Each policy's wait against LRU (the cut) and against Belady's MIN (the distance left)."""
    width = max(len(r.policy) for r in results)
    lines = [f"{'policy':<{width}}  GPU hit  host hit  disk loads  mean wait  vs LRU   vs Belady"]
    for r in results:
        cut = 1 - r.mean_wait_ms / baseline.mean_wait_ms if baseline.mean_wait_ms else 0.0
        gap = r.mean_wait_ms / belady.mean_wait_ms if belady.mean_wait_ms else 1.0
        lines.append(
            f"{r.policy:<{width}}  {100 * r.gpu_hit_rate:>6.1f}%  {100 * r.host_hit_rate:>7.1f}%  {r.cold_loads:>10}"
            f"  {r.mean_wait_ms:>6.2f} ms  {-100 * cut + 0.0:>+5.1f}%  {gap:>8.2f}x"
        )
    lines.append(f"lower bound on mean wait for any policy (MIN per tier size): {bound_ms:.2f} ms")
    return "\n".join(lines)


def replica_table(results: Sequence[ReplicaResult]) -> str:
    lines = ["routing      replicas  GPU hit  host hit  disk loads  mean wait  busiest share  peak load/mean"]
    for r in results:
        lines.append(
            f"{r.routing:<12}{r.num_replicas:>9}{100 * r.gpu_hit_rate:>8.1f}%{100 * r.host_hit_rate:>9.1f}%"
            f"{r.cold_loads:>12}{r.mean_wait_ms:>8.2f} ms{r.max_share:>14.2f}x{r.peak_inflight_ratio:>15.2f}x"
        )
    return "\n".join(lines)
