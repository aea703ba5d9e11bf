"""Where a live server's time went, from its step trace (``loraplane serve --step-trace FILE``;
``make demo`` writes ``loraplane-demo/steps.jsonl``).

Run: python benchmarks/step_trace_report.py loraplane-demo/steps.jsonl [--last 75]

Prints, for the requests chosen (all, or the ``--last`` N queued, such as the demo's mixed phase):
1. the steps: their lengths, and a least-squares fit of each one's length to what it carried
   (decodes, prompt tokens, prompts), with the residuals: steps far above the fit did something
   their batch does not explain (a drain, a load, the event loop, a slow adapter path);
2. first tokens as the engine saw them (from the request joining its queue to the end of the
   step that gave it): their times, how many steps began after a request arrived without giving
   it its first token (0: it was served in the first step after the one in flight), and the two
   parts of its wait, the rest of the step in flight and its own step;
3. the same times per adapter;
4. what an arrival costs the step it lands in: decode-only steps with a request joining the
   engine's queue during them (the server takes requests between a step's layers on a CPU)
   against those without, compared at equal numbers of decodes.
An interjection runs between another step's layers: its length is taken out of that step's for
the fit, and it counts as the step that served the requests it admitted.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summary(values: list[float]) -> str:
    return f"p50 {pct(values, 0.5):7.1f}  p90 {pct(values, 0.9):7.1f}  max {max(values, default=float('nan')):7.1f} ms"


def load(path: Path) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    arrivals: dict[str, dict[str, Any]] = {}
    steps: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "arrival":
            arrivals[event["request"]] = event
        elif event["event"] == "step" and not event.get("failed"):  # a failed pass gave nothing to time
            steps.append(event)
    return arrivals, steps


def own_lengths(steps: list[dict[str, Any]]) -> list[float]:
    """Each step's length without the interjections that ran inside it."""
    outer = [s for s in steps if not s["interjection"]]
    inner = [s for s in steps if s["interjection"]]
    lengths = []
    for s in outer:
        end = s["t"] + s["ms"] / 1e3
        lengths.append(s["ms"] - sum(i["ms"] for i in inner if s["t"] <= i["t"] < end))
    return lengths


def fit(steps: list[dict[str, Any]]) -> None:
    outer = [s for s in steps if not s["interjection"]]
    if len(outer) < 5:
        print("1. too few steps to fit")
        return
    lengths = np.array(own_lengths(steps))
    x = np.array([[1.0, s["decodes"], s["prompt_tokens"], s["prompts"]] for s in outer])
    coef, *_ = np.linalg.lstsq(x, lengths, rcond=None)
    residual = lengths - x @ coef
    print(f"1. steps: {len(outer)} (and {len(steps) - len(outer)} interjections); length {summary(list(lengths))}")
    print(
        f"   fit: {coef[0]:.1f} ms {coef[1]:+.2f} ms per decode {coef[2]:+.3f} ms per prompt token {coef[3]:+.1f} ms per prompt"
    )
    over = sorted(range(len(outer)), key=lambda i: -residual[i])[:5]
    print(f"   residuals: {summary(list(residual))}; the largest:")
    for i in over:
        s = outer[i]
        print(
            f"     {residual[i]:+7.1f} ms  ({s['ms']:.1f} ms: {s['decodes']} decodes, {s['prompts']} prompts of "
            f"{s['prompt_tokens']} tokens, adapters {', '.join(s['adapters']) or '-'})"
        )


def first_tokens(arrivals: dict[str, dict[str, Any]], steps: list[dict[str, Any]], chosen: set[str]) -> None:
    served: dict[str, dict[str, Any]] = {}
    for s in steps:
        for request in s["first_tokens"]:
            served.setdefault(request, s)
    outer_starts = sorted(s["t"] for s in steps if not s["interjection"])
    ttft, rest, own, waited = [], [], [], []
    per_adapter: dict[str, list[float]] = defaultdict(list)
    for request in chosen:
        a, s = arrivals[request], served.get(request)
        if s is None:
            continue  # no first token (failed, aborted, or still running when the trace ended)
        end = s["t"] + s["ms"] / 1e3
        ttft.append(1e3 * (end - a["t"]))
        per_adapter[a["adapter"] or "base"].append(ttft[-1])
        began = [t for t in outer_starts if a["t"] < t < s["t"]]
        waited.append(len(began))
        rest.append(1e3 * ((began[0] if began else s["t"]) - a["t"]))
        own.append(s["ms"])
    print(f"\n2. first tokens: {len(ttft)} of {len(chosen)} requests; time to first token {summary(ttft)}")
    if not ttft:
        return
    at_once = sum(1 for w in waited if w == 0)
    print(f"   served by the first step after the one in flight: {at_once} of {len(ttft)}; steps waited otherwise: "
          f"{sorted(w for w in waited if w)}")  # fmt: skip
    print(f"   the rest of the step in flight: mean {statistics.mean(rest):.1f} ms; "
          f"the step that gave the token: mean {statistics.mean(own):.1f} ms")  # fmt: skip
    print("\n3. per adapter:")
    for name, values in sorted(per_adapter.items(), key=lambda kv: -len(kv[1])):
        print(f"   {name:<16} {len(values):4d} requests  {summary(values)}")


def arrival_cost(arrivals: dict[str, dict[str, Any]], steps: list[dict[str, Any]]) -> None:
    times = sorted(a["t"] for a in arrivals.values())
    by_decodes: dict[int, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    outer = [s for s in steps if not s["interjection"]]
    for s, length in zip(outer, own_lengths(steps), strict=True):  # an interjection's prompt is not the step's
        if s["prompts"]:
            continue
        end = s["t"] + s["ms"] / 1e3
        landed = any(s["t"] < t < end for t in times)
        by_decodes[s["decodes"]][landed].append(length)
    pairs = [(d, quiet, busy) for d, (quiet, busy) in sorted(by_decodes.items()) if quiet and busy]
    print("\n4. decode-only steps with an arrival inside against those without (median ms):")
    if not pairs:
        print("   none to compare")
        return
    for d, quiet, busy in pairs:
        print(f"   {d:3d} decodes: {statistics.median(busy):6.1f} ({len(busy):3d} steps) against "
              f"{statistics.median(quiet):6.1f} ({len(quiet):3d} steps)")  # fmt: skip
    weight = sum(len(b) for _, _, b in pairs)
    cost = sum(len(b) * (statistics.median(b) - statistics.median(q)) for _, q, b in pairs) / weight
    print(f"   an arrival adds {cost:+.1f} ms to the step it lands in (weighted by the steps with one)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--last", type=int, help="only the last N requests queued (and the steps from the first of them)")
    args = parser.parse_args()
    arrivals, steps = load(args.trace)
    order = sorted(arrivals, key=lambda r: arrivals[r]["t"])
    chosen = order[-args.last :] if args.last else order
    if chosen:
        since = arrivals[chosen[0]]["t"]
        steps = [s for s in steps if s["t"] + s["ms"] / 1e3 >= since]
    print(f"{args.trace}: {len(chosen)} requests, {len(steps)} forward passes\n")
    fit(steps)
    first_tokens(arrivals, steps, set(chosen))
    arrival_cost({r: arrivals[r] for r in chosen}, steps)


if __name__ == "__main__":
    main()
