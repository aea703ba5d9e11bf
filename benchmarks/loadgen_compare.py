"""``loraplane bench`` beside a third-party load generator (``guidellm``) on the same trace, against
one ``loraplane serve`` on the embedded base: ``--requests`` streamed completions of
``--prompt-tokens`` prompt and ``--output-tokens`` output tokens each, arriving at a constant
``--rate``. Constant rather than Poisson because guidellm 0.8.1's Poisson profile sent about 1.6
times the rate it was given here (mean gaps of 1.24 and 1.26 s at rate 0.5), which its constant
profile does not (2.00 s).
The two are alternated round by round (this machine's speed drifts) and medians quoted, so a
disagreement between them is a measurement problem of one of the two, not the server's drift.

    python benchmarks/loadgen_compare.py [--rounds 3] [--requests 30] [--rate 0.5] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from loraplane.serving.bench.deployment import spawn_server
from loraplane.serving.bench.run import run_bench
from loraplane.serving.bench.workload import zipf_requests
from loraplane.serving.config import EngineConfig
from loraplane.serving.weights.base import resolve_base

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
# guidellm starts up to 10 worker processes that poll; on a 2-core machine they take the server's
# CPU and every figure measures that contention instead (TTFT 3-9x, ITL 3x in a first run).
GUIDELLM_WORKERS = {"GUIDELLM__MAX_WORKER_PROCESSES": "1"}
FIGURES = ("ttft_p50_ms", "itl_p50_ms", "requests_per_second", "output_tokens_per_second")


def run_guidellm(url: str, model: str, tokenizer: Path, args: argparse.Namespace, out: Path) -> dict[str, float]:
    cmd = [
        str(Path(sys.executable).parent / "guidellm"), "run",
        "--backend", f"kind=openai_http,target={url},model={model},request_format=/v1/completions",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--profile", f"kind=constant,rate={args.rate}",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--output", f"kind=json,path={out}", "--disable-console-interactive",
    ]  # fmt: skip
    subprocess.run(cmd, env={**os.environ, **OFFLINE, **GUIDELLM_WORKERS}, check=True, capture_output=True)
    bench = json.loads(out.read_text())["benchmarks"][0]
    m = bench["metrics"]
    totals = m["request_totals"]
    ok = totals["successful"]
    # guidellm may leave the last request of a run "incomplete" when its constraint ends the run;
    # an error is the server's and fails the benchmark.
    assert totals["errored"] == 0 and ok >= args.requests - 1, f"guidellm: {totals}"
    return {  # throughput as ours is counted: over the run's wall time (guidellm's own rate figures are per window)
        "ttft_p50_ms": m["time_to_first_token_ms"]["successful"]["median"],
        "itl_p50_ms": m["inter_token_latency_ms"]["successful"]["median"],
        "requests_per_second": ok / bench["duration"],
        "output_tokens_per_second": m["output_token_count"]["successful"]["total_sum"] / bench["duration"],
    }


def run_ours(deployment, model: str, args: argparse.Namespace) -> dict[str, float]:  # type: ignore[no-untyped-def]
    poisson = zipf_requests([model], [None], args.requests, rate=args.rate, prompt_words=args.prompt_tokens,
                            max_tokens=args.output_tokens, seed=11)  # fmt: skip
    requests = [dataclasses.replace(r, at=i / args.rate) for i, r in enumerate(poisson)]  # guidellm's constant arrivals
    report, _ = run_bench(deployment, requests, progress=False)
    assert report.overall.ok == args.requests, f"loraplane bench completed {report.overall.ok} of {args.requests}"
    return {
        "ttft_p50_ms": report.overall.ttft_p50_ms,
        "itl_p50_ms": report.overall.itl_p50_ms,
        "requests_per_second": report.requests_per_second,
        "output_tokens_per_second": report.tokens_per_second,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--rate", type=float, default=0.5)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    config = EngineConfig()
    base = resolve_base(config.model, config.cache_dir)
    results: dict[str, list[dict[str, float]]] = {"guidellm": [], "loraplane bench": []}
    with tempfile.TemporaryDirectory() as tmp, spawn_server(config, {}, []) as deployment:
        for r in range(args.rounds):
            order = ["guidellm", "loraplane bench"] if r % 2 == 0 else ["loraplane bench", "guidellm"]
            for who in order:
                if who == "guidellm":
                    figures = run_guidellm(deployment.url, base.shape.name, base.folder, args, Path(tmp) / f"g{r}.json")
                else:
                    figures = run_ours(deployment, base.shape.name, args)
                results[who].append(figures)
                print(f"round {r + 1} {who:16s} " + "  ".join(f"{k}={v:.1f}" for k, v in figures.items()), flush=True)
    medians = {who: {k: statistics.median(f[k] for f in runs) for k in FIGURES} for who, runs in results.items()}
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    trace = f"{args.requests} requests at {args.rate}/s, {args.prompt_tokens} prompt and {args.output_tokens} output tokens"
    print(f"\n{machine}; {trace}, medians of {args.rounds}")
    print(f"{'figure':26s} {'guidellm':>10s} {'loraplane bench':>16s} {'ratio':>7s}")
    for k in FIGURES:
        g, o = medians["guidellm"][k], medians["loraplane bench"][k]
        print(f"{k:26s} {g:10.1f} {o:16.1f} {o / g if g else float('nan'):7.2f}")
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "medians": medians}, indent=2))


if __name__ == "__main__":
    main()
