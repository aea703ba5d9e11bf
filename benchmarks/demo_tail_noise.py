"""How often the demo's last line would read above 1.5x if the hot customer and the base had one and
the same distribution of time to first token: the part of that line that is sample size, not placement.

Run: python benchmarks/demo_tail_noise.py [loraplane-demo/report.json] [--draws 20000]

It pools the mixed phase's times to first token from a demo's ``report.json`` (every model: the
null hypothesis is that the model does not matter) and draws, with replacement, as many requests as
the hot customer had and as many as the base had, then takes each side's p99 as the demo does
(nearest rank: the largest of 27, the largest of 3). It prints the share of draws above 1.5x
for the base's Zipf share alone (3 requests) and for the base with its probes (``base_probes``),
beside the ratio that run measured. Seconds of CPU; no server.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from loraplane.serving.bench.report import percentile
from loraplane.serving.demo.styles import STYLES

GOAL = 1.5


def over_goal(pool: list[float], n_hot: int, n_base: int, draws: int, rng: random.Random) -> float:
    """The share of draws whose p99 ratio (``n_hot`` requests against ``n_base``) exceeds GOAL."""
    over = 0
    for _ in range(draws):
        hot = percentile(rng.choices(pool, k=n_hot), 0.99)
        base = percentile(rng.choices(pool, k=n_base), 0.99)
        over += hot > GOAL * base
    return over / draws


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, nargs="?", default=Path("loraplane-demo/report.json"))
    parser.add_argument("--draws", type=int, default=20_000)
    args = parser.parse_args()
    answers = [a for a in json.loads(args.report.read_text())["answers"] if a.get("phase") == "mixed" and a["ttft_ms"]]
    if not answers:
        raise SystemExit(f"{args.report}: no mixed-phase times to first token (a demo report from before they were saved?)")
    hot_name = STYLES[0].name
    adapters = {s.name for s in STYLES}
    hot = [a["ttft_ms"] for a in answers if a["model"] == hot_name]
    base = [a["ttft_ms"] for a in answers if a["model"] not in adapters]
    pool = [a["ttft_ms"] for a in answers]
    measured = percentile(hot, 0.99) / percentile(base, 0.99)
    print(f"{args.report}: {len(pool)} mixed-phase requests, TTFT p50 {percentile(pool, 0.5):.0f} ms, largest {max(pool):.0f} ms")
    print(f"measured: {hot_name} ({len(hot)} requests) p99 against the base's ({len(base)}): {measured:.2f}x")
    rng = random.Random(0)
    zipf_base = len(base) - len(hot)  # base_probes sends as many probes as the hot adapter has requests
    for n_base, what in ((zipf_base, "the Zipf share alone"), (len(base), "with its probes")):
        share = over_goal(pool, len(hot), n_base, args.draws, rng)
        print(f"one distribution, {len(hot)} against {n_base} requests ({what}): above {GOAL}x in {share:.0%} of draws")


if __name__ == "__main__":
    main()
