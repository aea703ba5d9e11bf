"""Placement that follows demand: hot adapters against cold-start spikes, on the real engine.

Run: python benchmarks/hot_tenants_bench.py  (about 55 minutes on 2 AVX2 CPU cores in float32; the offered
load is a fraction of the capacity it measures first, so a slower machine takes longer)

Two scenarios, each served three ways side by side in one run, contenders alternated per round:

- ``lru``: the previous placement (LRU slots; a drain picks the least recently admitted holder);
- ``demand``: the default (decayed-demand slots, the engine's hot set, drains by demand);
- ``resident``: every adapter in its own device slot (the bound the others are measured against).

1. The demo's: 3 adapters and the bare base on 2 device slots, Zipf 1.1 shares (the hot adapter
   about half the traffic), Poisson arrivals, ``max_num_seqs`` 16, as ``make demo`` serves them.
2. The seed's: 500 synthetic adapters (rank 8, q/v), Zipf 1.1, 32 device and 100 host slots,
   steady Poisson load; adapters start on the node's disk.

Per popularity rank it prints TTFT p50/p99, mean queue wait (arrival to first admission) and
host->device swaps; then, last, the three ratios the issue sets goals for: the hottest adapters'
TTFT p99 against all-resident (<= 1.5x), the worst adapter's p99 against its all-resident p99
(<= 3x, no starvation) and throughput against the previous placement (>= 0.95).

The machine's speed drifts, and an open-loop load near its capacity turns a slower minute into a
queue that no placement can clear: a run then measures the drift. ``--clock steps`` replays on a
clock of engine steps instead (``engine_replay.replay``): the arrivals fall in the same steps in
every run, so the figures repeat and show what placement itself costs, counted in steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from loraplane.adapter_format import LLAMA_TARGETS
from loraplane.serving.bench.engine_replay import Arrival, Record, machine, poisson_arrivals, replay, usable_cpus
from loraplane.serving.bench.report import percentile
from loraplane.serving.config import EngineConfig
from loraplane.serving.engine.builder import build_engine, resolve_dtype
from loraplane.serving.engine.llm_engine import LLMEngine
from loraplane.serving.engine.outputs import RequestOutput
from loraplane.serving.lora.entries import AdapterSpec
from loraplane.serving.lora.synthetic import PEFT_DEFAULT, write_adapter
from loraplane.serving.weights.base import resolve_base

CONTENDERS = ("lru", "demand", "resident")


def zipf_weights(names: list[str | None], exponent: float = 1.1) -> dict[str | None, float]:
    return {name: 1.0 / (i + 1) ** exponent for i, name in enumerate(names)}


class Run(NamedTuple):
    records: list[Record]
    tokens_per_second: float  # generated, on the replay's clock
    swaps: dict[str, int]  # host -> device placements per adapter
    step_seconds: list[float]  # wall time of each step that ran a batch


def serve(
    contender: str, folders: dict[str, Path], arrivals: list[Arrival], slots: int, host: int, args: argparse.Namespace,
    label: str, step_clock: float | None = None, after_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
) -> Run:  # fmt: skip
    """One run: a fresh engine, adapters registered (on disk, not loaded), the arrivals replayed
    (on the step clock when ``step_clock`` is given, with ``after_step`` after each of the
    arrivals' steps; see ``engine_replay.replay``)."""
    resident = contender == "resident"
    config = EngineConfig(
        max_loras=len(folders) if resident else slots,
        max_cpu_loras=len(folders) if resident else host,
        max_lora_rank=args.rank,
        max_num_seqs=args.max_num_seqs,
        eviction_policy="demand" if resident else contender,
    )
    engine = build_engine(config)
    try:
        for name, folder in folders.items():
            engine.register_lora(AdapterSpec(name, str(folder)))
            if resident:
                engine.adapters.load_now(name)
                assert engine.adapters.ensure_device(name) is not None
        # Warm up on the base alone (torch's first calls are slow); adapters stay where they are.
        replay(engine, [Arrival(0.0, None)] * 4, prompt_len=args.prompt_len, out_len=4, label="warm-up")
        run = replay(
            engine, arrivals, prompt_len=args.prompt_len, out_len=args.output_len, label=label,
            step_clock=step_clock, after_step=after_step,
        )  # fmt: skip
        swaps = {name: int(c.load_seconds.get("host", [0, 0.0])[0]) for name, c in engine.metrics.counts.items()}
        return Run(run.records, sum(r.tokens for r in run.records) / run.wall, swaps, run.step_seconds)
    finally:
        engine.adapters.close()


def capacity(folders: dict[str, Path], args: argparse.Namespace) -> tuple[float, float | None]:
    """Requests per second this machine sustains: a closed batch of ``4 x max_num_seqs`` requests
    over the adapters, all resident, arriving at once; generated tokens/s over output length.
    Also the step clock, None on the wall clock.

    With ``--clock steps`` the clock is the burst's median step, and the capacity is counted in
    requests per step at that length, so the arrivals fall in the same steps in every run of the
    bench and only the printed milliseconds scale with the machine's speed."""
    names = list(folders)
    burst = [Arrival(0.0, names[i % len(names)], names[i % len(names)]) for i in range(4 * args.max_num_seqs)]
    run = serve("resident", folders, burst, len(folders), len(folders), args, "capacity")
    if args.clock == "wall":
        return run.tokens_per_second / args.output_len, None
    step_clock = statistics.median(run.step_seconds)
    return len(burst) / len(run.step_seconds) / step_clock, step_clock


def write_records(path: Path, records: list[Record]) -> None:
    """One run's requests, one JSON line each, in arrival order: where each one's time to first
    token went (``Record``), to find what held back the requests behind a p99."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in sorted(records, key=lambda r: r.arrival.at):
            row = {"at": r.arrival.at, "adapter": r.arrival.adapter, "arrival_tier": r.arrival_tier, "lag": r.lag}
            row |= {"queue_wait": r.queue_wait, "first_steps": r.first_steps, "ttft": r.ttft, "preemptions": r.preemptions}
            row |= {"latency": r.latency, "tokens": r.tokens}
            f.write(json.dumps(row) + "\n")


def groups_of(ranked: list[str | None], seed: bool) -> list[tuple[str, set[str | None]]]:
    """Popularity groups: each model alone in the demo's scenario, rank bands in the seed's."""
    if not seed:
        return [(name or "base", {name}) for name in ranked]
    bands = [(1, 1), (2, 4), (5, 16), (17, 64), (65, len(ranked))]
    return [(f"rank {a}-{b}" if a != b else f"rank {a}", set(ranked[a - 1 : b])) for a, b in bands]


def scenario(
    title: str, folders: dict[str, Path], ranked: list[str | None], arrivals: list[Arrival], slots: int, host: int,
    args: argparse.Namespace, seed: bool, step_clock: float | None,
) -> tuple[float, float, float]:  # fmt: skip
    runs: dict[str, list[Run]] = defaultdict(list)
    for r in range(args.rounds):
        order = CONTENDERS if r % 2 == 0 else tuple(reversed(CONTENDERS))
        for contender in order:
            label = f"{title[:10]} {contender} #{r + 1}"
            runs[contender].append(serve(contender, folders, arrivals, slots, host, args, label, step_clock))
            if args.records is not None:
                path = args.records / f"{'seed' if seed else 'demo'}-{contender}-{r + 1}.jsonl"
                write_records(path, runs[contender][-1].records)
    print(f"\n{title}")
    if step_clock is not None:
        print(f"  on the step clock: one engine step counts {1e3 * step_clock:.0f} ms (the capacity burst's median step)")
    print("  contender | group | requests | TTFT p50 ms | TTFT p99 ms | queue wait ms | swaps")
    # Per contender, the median over rounds of each figure.
    p99: dict[str, dict[str, float]] = defaultdict(dict)
    for contender in CONTENDERS:
        for label, members in groups_of(ranked, seed):
            figures = []
            for records, _, swaps, _ in runs[contender]:
                mine = [r for r in records if r.arrival.adapter in members]
                ttft = [1e3 * r.ttft for r in mine]
                wait = statistics.fmean(1e3 * r.queue_wait for r in mine) if mine else 0.0
                figures.append(
                    (len(mine), percentile(ttft, 0.5), percentile(ttft, 0.99), wait, sum(swaps.get(str(m), 0) for m in members))
                )
            n, p50, q99, wait, swap = (statistics.median(f[i] for f in figures) for i in range(5))
            p99[contender][label] = q99
            print(f"  {contender} | {label} | {n:.0f} | {p50:.0f} | {q99:.0f} | {wait:.0f} | {swap:.0f}")
        tput = statistics.median(run.tokens_per_second for run in runs[contender])
        print(f"  {contender} | all | throughput {tput:.1f} generated tokens/s")
    hottest = groups_of(ranked, seed)[0][0]
    hot_ratio = p99["demand"][hottest] / p99["resident"][hottest]
    worst = max(p99["demand"][g] / p99["resident"][g] for g in p99["demand"] if p99["resident"][g] > 0)
    tputs = {c: statistics.median(run.tokens_per_second for run in runs[c]) for c in CONTENDERS}
    return hot_ratio, worst, tputs["demand"] / tputs["lru"]


def options() -> argparse.ArgumentParser:
    """The bench's options (``benchmarks/step_timelines.py`` takes them too)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1, help="runs per contender, alternated; medians are quoted")
    parser.add_argument("--demo-requests", type=int, default=120)
    parser.add_argument("--load", type=float, default=0.6, help="offered load as a fraction of the measured capacity")
    parser.add_argument("--seed-requests", type=int, default=400)
    parser.add_argument("--seed-adapters", type=int, default=500)
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--only", choices=["demo", "seed"], help="run one scenario")
    parser.add_argument("--records", type=Path, help="write each run's per-request timings here (JSON lines)")
    parser.add_argument(
        "--clock", choices=["wall", "steps"], default="wall",
        help="steps: replay on a clock of engine steps (see engine_replay.replay), the same in every run whatever "
        "the machine's speed does meanwhile",
    )  # fmt: skip
    return parser


def main() -> None:
    args = options().parse_args()
    torch.set_num_threads(usable_cpus())
    base = resolve_base("embedded", EngineConfig().cache_dir)
    print(
        f"embedded base ({base.shape.name}), {machine(resolve_dtype(EngineConfig().dtype))}; "
        f"{args.prompt_len} prompt + {args.output_len} output tokens per request, "
        f"max_num_seqs {args.max_num_seqs}, {args.rounds} round(s)"
    )
    results: dict[str, tuple[float, float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.only in (None, "demo"):
            names = ["pirate", "shouty", "bullets"]
            folders = {n: write_adapter(work / n, base.shape, args.rank, LLAMA_TARGETS, seed=i) for i, n in enumerate(names)}
            ranked: list[str | None] = [*names, None]
            cap, step_clock = capacity(folders, args)
            rate = args.load * cap
            arrivals = poisson_arrivals(zipf_weights(ranked), args.demo_requests, rate)
            results["demo"] = scenario(
                f"1. demo scenario: 3 adapters + base on 2 device slots, {args.demo_requests} requests at "
                f"{rate:.2f} req/s ({args.load:g} x the measured capacity of {cap:.2f} req/s; Zipf 1.1)",
                folders, ranked, arrivals, 2, 12, args, seed=False, step_clock=step_clock,
            )  # fmt: skip
        if args.only in (None, "seed"):
            names = [f"a{i:03d}" for i in range(args.seed_adapters)]
            folders = {
                n: write_adapter(work / "seed" / n, base.shape, args.rank, PEFT_DEFAULT, seed=100 + i)
                for i, n in enumerate(tqdm(names, desc="writing adapters", leave=False))
            }
            cap, step_clock = capacity(dict(list(folders.items())[:32]), args)
            rate = args.load * cap
            arrivals = poisson_arrivals(zipf_weights(list(names)), args.seed_requests, rate)
            used = {a.adapter for a in arrivals}
            folders = {n: f for n, f in folders.items() if n in used}  # all-resident needs one slot per adapter used
            results["seed"] = scenario(
                f"2. seed scenario: {len(folders)} of {args.seed_adapters} adapters requested, 32 device / 100 host "
                f"slots, {args.seed_requests} requests at {rate:.2f} req/s ({args.load:g} x the measured capacity of "
                f"{cap:.2f} req/s; Zipf 1.1)",
                folders, [n for n in names if n in used], arrivals, 32, 100, args, seed=True, step_clock=step_clock,
            )  # fmt: skip
    print("\nratios (demand placement)")
    for name, (hot, worst, tput) in results.items():
        print(
            f"  {name}: hottest p99 / all-resident {hot:.2f}x (goal <= 1.5x); worst adapter p99 / its all-resident "
            f"{worst:.2f}x (goal <= 3x); throughput / lru {tput:.3f} (goal >= 0.95)"
        )


if __name__ == "__main__":
    main()
