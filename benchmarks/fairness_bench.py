"""Fair admission between tenants on the real engine: a bursting tenant against a steady one.

Run: python benchmarks/fairness_bench.py  (about 20 minutes on 2 AVX2 cores, mostly FIFO; 6 emulating AVX2 on AMX)

Rates are relative to the machine, so the comparison means the same on a fast or a slow CPU: the
bench first measures the engine's capacity (requests/s of a closed batch), then tenant B sends a
steady quarter of it and tenant A ten times B's rate (2.5 times the capacity, so A's backlog
grows without bound). Each request is 32 prompt + 16 output tokens on the embedded base,
``max_num_seqs`` 8. Four runs side by side, alternated per round: B alone; B beside A's burst
under fair admission (the default); the same with ``fair_interjection`` off, so B's prompt waits
for the end of A's step in flight rather than running between its layers (the setting is on by
default with the CPU backend only, so on a GPU the two fair runs are the same); the same under
FIFO admission. A run ends when B's last request has finished; A's backlog is then aborted (it is
counted, not drained).

Printed per run: B's time to first token (p50, p99, p99 against B alone) and where it went (the
wait for the step in flight, the admission queue, the steps from admission to the first token,
B's preemptions, the step length), and A's requests served and still queued. Goal: B's p99 within
1.5x of B alone under fair admission, with A's requests rather than B's left queued.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections import defaultdict
from collections.abc import Callable

import torch

from loraplane.serving.bench.engine_replay import Arrival, Record, Replayed, capacity, machine, replay, usable_cpus
from loraplane.serving.bench.report import percentile
from loraplane.serving.config import EngineConfig
from loraplane.serving.engine.builder import build_engine
from loraplane.serving.engine.llm_engine import LLMEngine

PROMPT_LEN, OUTPUT_LEN = 32, 16


def engine(max_num_seqs: int, fair: bool, interjection: bool | None = None) -> LLMEngine:
    """A fresh engine, warmed up (torch's first calls are slow); ``interjection`` as
    ``EngineConfig.fair_interjection`` (None: the device's default)."""
    eng = build_engine(EngineConfig(max_num_seqs=max_num_seqs, fair_scheduling=fair, fair_interjection=interjection))
    replay(eng, [Arrival(0.0, None)] * 4, prompt_len=PROMPT_LEN, out_len=4, label="warm-up")
    return eng


def measure_capacity(max_num_seqs: int, given: float | None = None) -> tuple[float, str]:
    """Requests per second here (``4 x max_num_seqs`` requests at once), or ``given`` without
    measuring; and the machine line."""
    eng = engine(max_num_seqs, fair=True)
    try:
        burst = [Arrival(0.0, None, "probe")] * (4 * max_num_seqs)
        cap = given if given is not None else capacity(eng, burst, prompt_len=PROMPT_LEN, out_len=OUTPUT_LEN)
        return cap, machine(eng.dtype)
    finally:
        eng.adapters.close()


def arrivals(rates: dict[str, float], seconds: float, poisson: bool) -> list[Arrival]:
    """Each tenant's requests at its rate: evenly spaced, the tenants' first ones offset so they
    do not all land in one step, or with ``poisson`` at exponential gaps (seeded, so every
    contender gets the same times), as vLLM's ``benchmark_serving`` draws them. Evenly spaced, B
    alone always finds the engine idle; a Poisson B sometimes lands on its own earlier request."""
    out = []
    for k, (tenant, rate) in enumerate(rates.items()):
        rng = random.Random(tenant)  # per tenant: B's times do not depend on A being there
        at = k / len(rates) / rate
        for _ in range(int(seconds * rate)):
            out.append(Arrival(at, None, tenant))
            at += rng.expovariate(rate) if poisson else 1 / rate
    return out


def serve(
    rates: dict[str, float], seconds: float, max_num_seqs: int, fair: bool, interjection: bool | None, label: str, poisson: bool
) -> Replayed:
    eng = engine(max_num_seqs, fair, interjection)
    try:
        return replay(eng, arrivals(rates, seconds, poisson), prompt_len=PROMPT_LEN, out_len=OUTPUT_LEN, label=label,
                      seed=0, until=lambda a: a.tenant == "B")  # fmt: skip
    finally:
        eng.adapters.close()


def positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not above 0")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--b-share", type=float, default=0.25, help="B's rate as a fraction of the measured capacity")
    parser.add_argument("--burst", type=float, default=10.0, help="A's rate as a multiple of B's")
    parser.add_argument("--b-requests", type=int, default=45, help="B's requests per run")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="runs per contender, alternated; medians are quoted")
    parser.add_argument("--arrivals", choices=("even", "poisson"), default="even", help="the gaps between each tenant's requests")
    parser.add_argument("--capacity", type=positive, help="req/s to take as the capacity instead of measuring it "
                        "(to compare two versions of the engine at the same rates)")  # fmt: skip
    parser.add_argument("--no-fifo", action="store_true", help="leave out the FIFO contender (most of the run's time)")
    parser.add_argument("--no-interjection-run", action="store_true",
                        help="leave out the fair contender with fair_interjection off")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(usable_cpus())
    cap, machine_line = measure_capacity(args.max_num_seqs, args.capacity)
    b_rate = args.b_share * cap
    a_rate = args.burst * b_rate
    seconds = args.b_requests / b_rate
    contenders: dict[str, tuple[dict[str, float], bool, bool | None]] = {
        "B alone": ({"B": b_rate}, True, None),
        "B + A bursting, fair admission": ({"B": b_rate, "A": a_rate}, True, None),
        "B + A bursting, fair, no interjection": ({"B": b_rate, "A": a_rate}, True, False),
        "B + A bursting, FIFO admission": ({"B": b_rate, "A": a_rate}, False, None),
    }
    if args.no_fifo:
        del contenders["B + A bursting, FIFO admission"]
    if args.no_interjection_run:
        del contenders["B + A bursting, fair, no interjection"]
    runs: dict[str, list[Replayed]] = defaultdict(list)
    for r in range(args.rounds):
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for label in order:
            rates, fair, interjection = contenders[label]
            runs[label].append(
                serve(rates, seconds, args.max_num_seqs, fair, interjection, f"{label} #{r + 1}", args.arrivals == "poisson")
            )

    print(f"{machine_line}; embedded base, max_num_seqs {args.max_num_seqs}, {PROMPT_LEN} prompt + {OUTPUT_LEN} output tokens")
    print(
        f"capacity {cap:.2f} req/s{'' if args.capacity is None else ' (given)'}; B {b_rate:.2f} req/s "
        f"({args.b_share:g} x capacity), A {a_rate:.2f} req/s "
        f"({args.burst:g} x B), {args.arrivals} arrivals; {args.b_requests} of B's requests per run over {seconds:.0f} s; "
        f"{args.rounds} round(s)"
    )

    def med(label: str, figure: Callable[[Replayed], float]) -> float:
        return statistics.median(figure(run) for run in runs[label])

    def b_of(run: Replayed) -> list[Record]:
        return [rec for rec in run.records if rec.arrival.tenant == "B"]

    alone = med("B alone", lambda run: percentile([rec.ttft for rec in b_of(run)], 0.99))
    print("  run | B TTFT p50 ms | B TTFT p99 ms | B p99 / alone | A served | A queued at the end")
    for label in contenders:
        b50 = med(label, lambda run: 1e3 * percentile([rec.ttft for rec in b_of(run)], 0.5))
        b99 = med(label, lambda run: 1e3 * percentile([rec.ttft for rec in b_of(run)], 0.99))
        served = med(label, lambda run: sum(1 for rec in run.records if rec.arrival.tenant == "A"))
        queued = med(label, lambda run: run.aborted)
        a = f"{served:.0f} | {queued:.0f}" if "A" in contenders[label][0] else "- | -"
        print(f"  {label} | {b50:.0f} | {b99:.0f} | {b99 / 1e3 / alone:.2f}x | {a}")
    print("where B's time to first token went (ms, mean / p99), and the steps")
    print("  run | wait for the step in flight | admission queue | admission to first token | B preemptions | "
          "step p50 / p99 ms | tokens per step")  # fmt: skip
    for label in contenders:

        def part(name: str, q: float | None, lab: str = label) -> float:
            def one(run: Replayed) -> float:
                values = [1e3 * getattr(rec, name) for rec in b_of(run)]
                return statistics.fmean(values) if q is None else percentile(values, q)

            return med(lab, one)

        parts = " | ".join(f"{part(n, None):.0f} / {part(n, 0.99):.0f}" for n in ("lag", "queue_wait", "first_steps"))
        preempt = med(label, lambda run: sum(rec.preemptions for rec in b_of(run)))
        s50 = med(label, lambda run: 1e3 * percentile(run.step_seconds, 0.5))
        s99 = med(label, lambda run: 1e3 * percentile(run.step_seconds, 0.99))
        tps = med(label, lambda run: statistics.fmean(run.tokens_per_step))
        print(f"  {label} | {parts} | {preempt:.0f} | {s50:.0f} / {s99:.0f} | {tps:.1f}")
    fair_p99 = med("B + A bursting, fair admission", lambda run: percentile([rec.ttft for rec in b_of(run)], 0.99))
    print(f"B's TTFT p99 beside A's burst, fair admission: {fair_p99 / alone:.2f}x B alone (goal <= 1.5x)")


if __name__ == "__main__":
    main()
