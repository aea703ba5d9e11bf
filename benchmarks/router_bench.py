"""Round-robin against adapter-affinity routing over three real replicas, next to the simulator.

Run: python benchmarks/router_bench.py  (about 6 minutes on 2 CPU cores)

Three `loraplane serve` replicas of the embedded base (each 4 device slots, 16 in host memory)
behind `loraplane router`, all child processes on loopback. 200 synthetic adapters (the seed's
rank mix) over 4 tenants; a Zipf(1.1) trace of Poisson arrivals sent through the router with the
official client, streaming. Each policy gets fresh replicas (every adapter starts cold), and both
replay the same trace. Printed side by side: the device hit rate, host hits and cold loads the
replicas counted, time to first token p50/p99, and what `loraplane sim --replicas 3` predicts
for the same trace and slot sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import httpx

from loraplane.admin_api import ReplicaStats
from loraplane.serving.bench.deployment import Fleet, spawn_replicas, spawn_router
from loraplane.serving.bench.driver import replay
from loraplane.serving.bench.report import AdapterTiers, Latency, tier_delta
from loraplane.serving.bench.run import synthetic_fleet
from loraplane.serving.bench.workload import BenchRequest, bench_trace, zipf_requests
from loraplane.serving.config import EngineConfig
from loraplane.serving.weights.base import resolve_base
from loraplane.sim.replicas import simulate_replicas


def stats(fleet: Fleet) -> list[ReplicaStats]:
    headers = {"Authorization": f"Bearer {fleet.admin_token}"}
    return [
        ReplicaStats.model_validate(httpx.get(f"{url}/admin/stats", headers=headers, timeout=60).json()) for url in fleet.urls
    ]


def measure(
    config: EngineConfig, adapters: dict[str, tuple[Path, str | None]], tenants: list[str], requests: list[BenchRequest],
    replicas: int, policy: str, epsilon: float,
) -> tuple[Latency, AdapterTiers, list[int]]:  # fmt: skip
    with spawn_replicas(config, adapters, tenants, replicas) as fleet, spawn_router(fleet, policy=policy, epsilon=epsilon) as url:
        before = stats(fleet)
        outcomes, _ = asyncio.run(replay(url, requests, fleet.keys))
        after = stats(fleet)
    per_replica = [sum(tier_delta(b, a).values(), AdapterTiers()) for b, a in zip(before, after, strict=True)]
    return Latency.of(outcomes), sum(per_replica, AdapterTiers()), [t.requests for t in per_replica]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--adapters", type=int, default=200)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rate", type=float, default=3.0, help="Poisson arrivals per second")
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--max-cpu-loras", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--epsilon", type=float, default=0.25)
    args = parser.parse_args()

    config = EngineConfig(model=args.model, max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras, max_lora_rank=64)
    shape = resolve_base(config.model, config.cache_dir).shape
    rows = []
    with tempfile.TemporaryDirectory(prefix="loraplane-router-bench-") as tmp:
        adapters = synthetic_fleet(shape, args.adapters, args.tenants, Path(tmp))
        tenants = sorted({owner for _, owner in adapters.values() if owner})
        models, owners = list(adapters), [owner for _, owner in adapters.values()]
        # The same arguments for both, so the simulator replays exactly the requests that are sent.
        requests = zipf_requests(models, owners, args.requests, rate=args.rate, max_tokens=args.max_tokens, prompt_words=16)
        trace = bench_trace(models, owners, args.requests, rate=args.rate, max_tokens=args.max_tokens)
        for policy, sim_routing in (("round-robin", "round-robin"), ("affinity", "affinity")):
            print(f"{policy}: starting {args.replicas} replicas and the router...", flush=True)
            latency, tiers, spread = measure(config, adapters, tenants, requests, args.replicas, policy, args.epsilon)
            predicted = simulate_replicas(  # the replicas' own eviction policy (the engine's default)
                trace, args.replicas, args.max_loras, args.max_cpu_loras, sim_routing, epsilon=args.epsilon,
                policy=config.eviction_policy,
            )  # fmt: skip
            rows.append((policy, latency, tiers, spread, predicted))

    print(
        f"\n{args.replicas} replicas x ({args.max_loras} device, {args.max_cpu_loras} host slots); {args.adapters} adapters; "
        f"{args.requests} requests, Zipf 1.1, Poisson {args.rate:g}/s, {args.max_tokens} output tokens; epsilon {args.epsilon}"
    )
    header = ["routing", "device hit", "host hit", "cold loads", "sim: device hit", "sim: cold loads"]
    header += ["TTFT p50", "TTFT p99", "ok", "requests per replica"]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for policy, latency, tiers, spread, predicted in rows:
        print(
            f"| {policy} | {tiers.rate(tiers.device_hits):.1%} | {tiers.rate(tiers.host_hits):.1%} | {tiers.cold_loads} | "
            f"{predicted.gpu_hit_rate:.1%} | {predicted.cold_loads} | {latency.ttft_p50_ms:.0f} ms | "
            f"{latency.ttft_p99_ms:.0f} ms | {latency.ok}/{latency.requests} | {' / '.join(map(str, spread))} |"
        )
    (rr_lat, rr_tiers, *_), (af_lat, af_tiers, *_) = rows[0][1:], rows[1][1:]
    hit_ratio = af_tiers.rate(af_tiers.device_hits) / max(rr_tiers.rate(rr_tiers.device_hits), 1e-9)
    print(
        f"\naffinity / round-robin: device hit rate {hit_ratio:.2f}x, "
        f"cold loads {af_tiers.cold_loads / max(rr_tiers.cold_loads, 1):.2f}x, "
        f"TTFT p50 {af_lat.ttft_p50_ms / rr_lat.ttft_p50_ms:.2f}x, p99 {af_lat.ttft_p99_ms / rr_lat.ttft_p99_ms:.2f}x"
    )


if __name__ == "__main__":
    main()
