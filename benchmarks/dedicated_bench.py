"""A dominant adapter on a merged dedicated replica against the same adapter on the shared pool.

Run: python benchmarks/dedicated_bench.py [--replicas 2]  (on 2 AVX2 CPU cores in float32: about 17
minutes with two replicas, 19 with four)

The lesson's decision chart: *one adapter dominates traffic? give it a merged dedicated deployment,
keep the long tail on the shared base.* Here one adapter carries ``--dominant-share`` (default
50%) of the requests and ``--tail`` others share the rest by Zipf 1.1, on ``--replicas`` replicas
of the embedded base either way (the same GPU budget), with ``--slots`` device slots each:

- ``shared``: every replica serves every adapter. The dominant adapter's requests go round the
  replicas (as the router's load bound spreads a hot adapter); each tail adapter has a home
  replica (as affinity routing keeps it).
- ``dedicated``: as many replicas as the dominance rule gives it (``dedicated_replicas``: its
  share of them, leaving the tail one) serve the merged checkpoint (``loraplane merge``: base +
  scale·B·A, no adapter, no slot), taking its requests as plain base requests; the others serve
  the tail, each tail adapter at a home among them.

Each replica replays its own share of one Poisson trace (open loop, at ``--load`` times the
measured capacity of one replica, for half the trace per replica), one replica after the other on
this machine (replicas are separate machines: running them together on two cores would measure
their contention); contenders alternate per round and medians are quoted. Printed side by side:
the dominant adapter's TTFT p50/p99 and its decode rate per request (generated tokens per second
after the first), its throughput in a closed burst (``4 x max_num_seqs`` requests at once, on a
shared replica with it resident against the merged replica), the tail's TTFT p99 and the tail's
device-slot hit rate (requests whose adapter was on the device when they arrived).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import torch

from loraplane.adapter_format import LLAMA_TARGETS
from loraplane.routing.dominance import dedicated_replicas
from loraplane.serving.bench.engine_replay import Arrival, Record, machine, poisson_arrivals, replay, usable_cpus
from loraplane.serving.bench.report import percentile
from loraplane.serving.config import EngineConfig
from loraplane.serving.engine.builder import build_engine, resolve_dtype
from loraplane.serving.lora.entries import AdapterSpec
from loraplane.serving.lora.merge import merge_adapter
from loraplane.serving.lora.synthetic import write_adapter
from loraplane.serving.weights.base import resolve_base

DOMINANT = "dominant"
CONTENDERS = ("shared", "dedicated")


class Replica(NamedTuple):
    model: str  # the engine's base: 'embedded' or the merged folder
    adapters: dict[str, Path]  # registered (on the node's disk, not loaded)
    arrivals: list[Arrival]  # the tenant field names the logical adapter; ``adapter`` is what the engine is asked for


def replicas(
    contender: str, arrivals: list[Arrival], folders: dict[str, Path], merged: Path, args: argparse.Namespace
) -> list[Replica]:
    """The trace split over ``args.replicas`` replicas: the dominant adapter's requests in turn
    over those that serve it, each tail adapter at a home replica (hottest first, so the homes carry
    alike). ``dedicated``: the dominance rule's replica count serves the merged checkpoint."""
    tail = [n for n in folders if n != DOMINANT]
    n = args.replicas
    k = dedicated_replicas(args.dominant_share, n, n) if contender == "dedicated" else 0
    hot = list(range(k)) if k else list(range(n))  # the replicas that take the dominant adapter's requests
    homes = list(range(k, n))
    home = {name: homes[i % len(homes)] for i, name in enumerate(tail)}
    split: list[list[Arrival]] = [[] for _ in range(n)]
    turn = 0
    for a in arrivals:
        if a.adapter == DOMINANT:
            split[hot[turn % len(hot)]].append(Arrival(a.at, None, DOMINANT) if k else a)
            turn += 1
        else:
            split[home[str(a.adapter)]].append(a)
    return [
        Replica(str(merged), {}, split[i]) if i < k else Replica("embedded", {m: folders[m] for m in folders if
                                                                               k == 0 or m != DOMINANT}, split[i])
        for i in range(n)
    ]  # fmt: skip


def serve(replica: Replica, args: argparse.Namespace, label: str, burst: bool = False) -> tuple[list[Record], float]:
    """A fresh engine for one replica: its adapters registered, a warm-up on the base, then its
    arrivals replayed. ``burst``: the dominant adapter made resident first (the capacity burst)."""
    slots = max(1, min(args.slots, len(replica.adapters) or 1))
    engine = build_engine(
        EngineConfig(
            model=replica.model,
            max_loras=slots,
            max_cpu_loras=max(slots, len(replica.adapters)),
            max_lora_rank=args.rank,
            max_num_seqs=args.max_num_seqs,
            eviction_policy="demand",
        )
    )
    try:
        for name, folder in replica.adapters.items():
            engine.register_lora(AdapterSpec(name, str(folder)))
        if burst and DOMINANT in replica.adapters:
            engine.adapters.load_now(DOMINANT)
            assert engine.adapters.ensure_device(DOMINANT) is not None
        replay(engine, [Arrival(0.0, None)] * 4, prompt_len=args.prompt_len, out_len=4, label="warm-up")
        run = replay(engine, replica.arrivals, prompt_len=args.prompt_len, out_len=args.output_len, label=label)
        return run.records, sum(r.tokens for r in run.records) / run.wall
    finally:
        engine.adapters.close()


def burst_rate(model: str, folders: dict[str, Path], args: argparse.Namespace, label: str) -> float:
    """Generated tokens/s of ``4 x max_num_seqs`` of the dominant adapter's requests at once."""
    adapter = DOMINANT if model == "embedded" else None
    arrivals = [Arrival(0.0, adapter, DOMINANT)] * (4 * args.max_num_seqs)
    return serve(Replica(model, {DOMINANT: folders[DOMINANT]} if adapter else {}, arrivals), args, label, burst=True)[1]


class Figures(NamedTuple):
    dominant_p50: float
    dominant_p99: float
    dominant_decode: float  # median per-request generated tokens/s after the first token
    dominant_burst: float
    tail_p99: float
    tail_device_hits: float


def figures(records: list[Record], burst: float) -> Figures:
    dom = [r for r in records if r.arrival.tenant == DOMINANT]
    tail = [r for r in records if r.arrival.tenant != DOMINANT]
    decode = [(r.tokens - 1) / (r.latency - r.ttft) for r in dom if r.tokens > 1 and r.latency > r.ttft]
    return Figures(
        percentile([1e3 * r.ttft for r in dom], 0.5),
        percentile([1e3 * r.ttft for r in dom], 0.99),
        statistics.median(decode) if decode else 0.0,
        burst,
        percentile([1e3 * r.ttft for r in tail], 0.99),
        sum(r.arrival_tier == "device" for r in tail) / len(tail) if tail else 0.0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="runs per contender, alternated; medians are quoted")
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--tail", type=int, default=24, help="adapters besides the dominant one")
    parser.add_argument("--dominant-share", type=float, default=0.5)
    parser.add_argument("--replicas", type=int, default=2, help="the budget: replicas either way")
    parser.add_argument("--slots", type=int, default=4, help="device slots per replica")
    parser.add_argument("--load", type=float, default=0.6, help="per replica, as a fraction of one replica's capacity")
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(usable_cpus())
    base = resolve_base("embedded", EngineConfig().cache_dir)
    print(
        f"embedded base ({base.shape.name}), {machine(resolve_dtype(EngineConfig().dtype))}; {args.replicas} replicas, "
        f"{args.slots} device slots each; {args.requests} requests of {args.prompt_len} + {args.output_len} tokens; "
        f"'{DOMINANT}' {100 * args.dominant_share:g}% of requests, {args.tail} tail adapters (Zipf 1.1) the rest; "
        f"rank {args.rank}, all seven projections; {args.rounds} round(s)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        names = [DOMINANT, *(f"tail-{i:02d}" for i in range(args.tail))]
        folders = {n: write_adapter(work / n, base.shape, args.rank, LLAMA_TARGETS, seed=i) for i, n in enumerate(names)}
        merged = merge_adapter(base, folders[DOMINANT], work / "merged").folder
        # One replica's capacity on this trace's mix: a closed burst over the adapters, all resident.
        cap_arrivals = [Arrival(0.0, names[i % len(names)], names[i % len(names)]) for i in range(4 * args.max_num_seqs)]
        _, tokens_per_second = serve(Replica("embedded", folders, cap_arrivals), argparse.Namespace(**{
            **vars(args), "slots": len(folders)}), "capacity")  # fmt: skip
        rate = args.replicas * args.load * tokens_per_second / args.output_len
        zipf = {n: 1.0 / (i + 1) ** 1.1 for i, n in enumerate(names[1:])}
        weights: dict[str | None, float] = {DOMINANT: args.dominant_share}
        weights |= {n: (1 - args.dominant_share) * w / sum(zipf.values()) for n, w in zipf.items()}
        arrivals = poisson_arrivals(weights, args.requests, rate)
        each = f"{args.load:g} x one replica's {tokens_per_second:.0f} tok/s each"
        print(f"offered load: {rate:.2f} req/s over {args.replicas} replicas ({each})")
        runs: dict[str, list[Figures]] = defaultdict(list)
        for r in range(args.rounds):
            for contender in CONTENDERS if r % 2 == 0 else tuple(reversed(CONTENDERS)):
                records: list[Record] = []
                for i, replica in enumerate(replicas(contender, arrivals, folders, merged, args)):
                    records += serve(replica, args, f"{contender} r{i} #{r + 1}")[0]
                model = str(merged) if contender == "dedicated" else "embedded"
                runs[contender].append(figures(records, burst_rate(model, folders, args, f"{contender} burst #{r + 1}")))
    print("\ncontender | dominant TTFT p50 ms | p99 ms | decode tok/s per request | burst tok/s | tail TTFT p99 ms", end="")
    print(" | tail device hits")
    median = {c: Figures(*(statistics.median(getattr(f, k) for f in runs[c]) for k in Figures._fields)) for c in CONTENDERS}
    for c in CONTENDERS:
        m = median[c]
        print(
            f"{c} | {m.dominant_p50:.0f} | {m.dominant_p99:.0f} | {m.dominant_decode:.1f} | {m.dominant_burst:.0f} | "
            f"{m.tail_p99:.0f} | {100 * m.tail_device_hits:.1f}%"
        )
    s, d = median["shared"], median["dedicated"]
    print(
        f"\ndedicated / shared: dominant burst throughput {d.dominant_burst / s.dominant_burst:.2f}x, dominant TTFT p99 "
        f"{d.dominant_p99 / s.dominant_p99:.2f}x, tail TTFT p99 {d.tail_p99 / s.tail_p99:.2f}x, tail device hits "
        f"{100 * s.tail_device_hits:.1f}% -> {100 * d.tail_device_hits:.1f}%"
    )


if __name__ == "__main__":
    main()
