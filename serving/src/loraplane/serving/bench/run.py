"""One benchmark run: the fleet of synthetic adapters for an in-process server, the replay, the report."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from loraplane.adapter_format import BaseShape
from loraplane.serving.bench.deployment import Deployment, spawn_server
from loraplane.serving.bench.driver import Outcome, replay
from loraplane.serving.bench.report import BenchReport, summarize
from loraplane.serving.bench.workload import BenchRequest
from loraplane.serving.config import EngineConfig
from loraplane.serving.lora.synthetic import PEFT_DEFAULT, seed_ranks, write_adapter
from loraplane.serving.weights.base import resolve_base


def synthetic_fleet(shape: BaseShape, num_adapters: int, num_tenants: int, folder: Path) -> dict[str, tuple[Path, str | None]]:
    """``num_adapters`` PEFT adapters with random weights (the seed's rank mix: 80% r8, 18% r16, 2%
    r64; PEFT's default targets q_proj and v_proj; bfloat16), owned round-robin by ``num_tenants``."""
    fleet: dict[str, tuple[Path, str | None]] = {}
    for i, rank in enumerate(tqdm(seed_ranks(num_adapters), desc="writing adapters", unit="adapter", leave=False)):
        name = f"adapter-{i:04d}"
        path = write_adapter(folder / name, shape, rank, PEFT_DEFAULT, seed=i, dtype=torch.bfloat16)
        fleet[name] = (path, f"tenant-{i % num_tenants}")
    return fleet


def run_bench(
    deployment: Deployment, requests: Sequence[BenchRequest], *, progress: bool = True
) -> tuple[BenchReport, list[Outcome]]:
    before = deployment.stats()
    outcomes, wall = asyncio.run(replay(deployment.url, requests, deployment.keys, progress=progress))
    after = deployment.stats()
    return summarize(outcomes, wall, before, after), outcomes


def bench_in_process(
    config: EngineConfig,
    num_adapters: int,
    num_tenants: int,
    make_requests: Callable[[Deployment], list[BenchRequest]],
    *,
    progress: bool = True,
) -> BenchReport:
    """Start a server for ``config`` with a synthetic fleet on its base, then run the bench."""
    shape = resolve_base(config.model, config.cache_dir).shape
    with tempfile.TemporaryDirectory(prefix="loraplane-bench-") as tmp:
        fleet = synthetic_fleet(shape, num_adapters, num_tenants, Path(tmp))
        tenant_names = sorted({owner for _, owner in fleet.values() if owner})
        with spawn_server(config, fleet, tenant_names) as deployment:
            return run_bench(deployment, make_requests(deployment), progress=progress)[0]
