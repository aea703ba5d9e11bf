"""The design-review picture: hit rate against device slots, and load wait against host slots."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from pathlib import Path

from tqdm import tqdm

from loraplane.sim.tiers import Costs, simulate_tiers

GPU_SWEEP = (4, 8, 16, 32, 64, 128, 256)
HOST_SWEEP = (50, 100, 200, 300, 400, 500)


def plot_policies(
    adapters: Sequence[Hashable],
    policies: Sequence[str],
    path: str | Path,
    *,
    fixed_host: int = 100,
    fixed_gpu: int = 32,
    costs: Costs = Costs(),
    title: str = "",
) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers or in CI
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    jobs = [(p, g, fixed_host) for p in policies for g in GPU_SWEEP] + [(p, fixed_gpu, h) for p in policies for h in HOST_SWEEP]
    results = {}
    for policy, g, h in tqdm(jobs, desc="simulating", unit="config", leave=False):
        results[policy, g, h] = simulate_tiers(adapters, g, h, policy, costs=costs)
    for policy in policies:
        left.plot(GPU_SWEEP, [100 * results[policy, g, fixed_host].gpu_hit_rate for g in GPU_SWEEP], marker="o", label=policy)
        right.plot(HOST_SWEEP, [results[policy, fixed_gpu, h].mean_wait_ms for h in HOST_SWEEP], marker="o", label=policy)
    left.set(xscale="log", xlabel="GPU slots", ylabel="GPU hit rate (%)", title=f"Device hit rate ({fixed_host} host slots)")
    left.set_xticks(GPU_SWEEP, [str(g) for g in GPU_SWEEP])
    right.set(xlabel="host slots", ylabel="mean load wait per request (ms)", title=f"Load wait ({fixed_gpu} GPU slots)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
