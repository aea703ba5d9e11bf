"""Fair admission between tenants on the real engine: a bursting tenant against a steady one.

Run: python benchmarks/fairness_bench.py  (about 7 minutes on 2 CPU cores)

Tenant B sends a steady stream (2 requests/s); tenant A sends ten times B's share (20
requests/s, more than the engine can serve, so a backlog builds). Each request is 32 prompt +
16 output tokens on the embedded base, `max_num_seqs` 8. Printed side by side: B's time to first
token alone, with A bursting under fair admission (the default), and with A bursting under FIFO
admission. Goal: B's p99 within 1.5x of B alone with fairness on. 45 s of arrivals give 90 of B's
requests per run, so p99 is not simply the slowest one on a noisy machine.
"""

from __future__ import annotations

import argparse

from loraplane.serving.bench.engine_replay import Arrival, replay
from loraplane.serving.bench.report import percentile
from loraplane.serving.config import EngineConfig
from loraplane.serving.engine.llm_engine import LLMEngine


def run(engine: LLMEngine, seconds: float, rates: dict[str, float], prompt_len: int, out_len: int) -> dict[str, list[float]]:
    """Send each tenant's requests at its rate for ``seconds``; TTFT per tenant (seconds)."""
    arrivals = [Arrival(i / rate, None, tenant) for tenant, rate in rates.items() for i in range(int(seconds * rate))]
    records, _ = replay(engine, arrivals, prompt_len=prompt_len, out_len=out_len, label="+".join(rates), seed=0)
    ttft: dict[str, list[float]] = {t: [] for t in rates}
    for r in records:
        ttft[str(r.arrival.tenant)].append(r.ttft)
    return ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=45.0)
    parser.add_argument("--b-rate", type=float, default=2.0)
    parser.add_argument("--burst", type=float, default=10.0, help="A's rate as a multiple of B's")
    args = parser.parse_args()
    rows = []
    for label, fair, rates in (
        ("B alone", True, {"B": args.b_rate}),
        ("B + A bursting, fair admission", True, {"B": args.b_rate, "A": args.burst * args.b_rate}),
        ("B + A bursting, FIFO admission", False, {"B": args.b_rate, "A": args.burst * args.b_rate}),
    ):
        engine = LLMEngine(EngineConfig(max_num_seqs=8, fair_scheduling=fair))
        ttft = run(engine, args.seconds, rates, 32, 16)
        rows.append((label, ttft))
        engine.adapters.close()
    alone = percentile(rows[0][1]["B"], 0.99)
    print(f"embedded base, max_num_seqs 8, {args.seconds:g} s of arrivals: B {args.b_rate:g} req/s, A {args.burst:g}x that")
    print("  run | B TTFT p50 ms | B TTFT p99 ms | B p99 / alone | A TTFT p50 ms")
    for label, ttft in rows:
        b = ttft["B"]
        a = f"{1e3 * percentile(ttft['A'], 0.5):.0f}" if "A" in ttft else "-"
        print(f"  {label} | {1e3 * percentile(b, 0.5):.0f} | {1e3 * percentile(b, 0.99):.0f} | "
              f"{percentile(b, 0.99) / alone:.2f}x | {a}")  # fmt: skip


if __name__ == "__main__":
    main()
