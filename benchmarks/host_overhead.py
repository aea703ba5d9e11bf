"""The host's work per engine step on the CUDA code path, with the device's work taken out
(``loraplane.serving.bench.host_overhead``): host milliseconds, kernel launches, graph replays,
read-backs and copies to the device per step, at an 8B shape, on this machine's CPU.

  python benchmarks/host_overhead.py                 # Llama-3-8B shape, 32 adapters on 32 slots (a few minutes)
  python benchmarks/host_overhead.py --shape toy     # seconds
  python benchmarks/host_overhead.py --json out.json --repeats 9

Steps (graph replays unless --enforce-eager): decode at batch 1, 64 and 256; one step of 8,192
prompt tokens over 96 rows; a mixed step (64 decodes beside 8 prompts of 512 tokens). Every row
has an adapter (all seven projections, 32 distinct), greedy but in the two sampled decode steps
(temperature and top-p, every other row seeded; then frequency and repetition penalties too).
Figures are medians of ``--repeats`` measured steps (min and max beside); the recorder's own cost
per operation is printed too.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from loraplane.serving.bench.host_overhead import Scenario, device_free_engine, per_op_cost, place_all, run_scenario
from loraplane.serving.bench.shapes import LLAMA3_8B_CONFIG, TOY_CONFIG, write_shape
from loraplane.serving.lora.entries import AdapterSpec
from loraplane.serving.lora.synthetic import write_adapter
from loraplane.serving.weights.base import resolve_base

SCENARIOS = [
    Scenario("decode, batch 1", decode=1),
    Scenario("decode, batch 64", decode=64),
    Scenario("decode, batch 256", decode=256),
    Scenario("decode, batch 256, temperature 0.8, top-p 0.95", decode=256, temperature=0.8, top_p=0.95),
    Scenario(
        "decode, batch 256, temperature, penalties",
        decode=256,
        temperature=0.8,
        top_p=0.95,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
    ),
    Scenario("8,192 prompt tokens over 96 rows", prompts=96, prompt_len=8192 // 96 + 1),
    Scenario("mixed: 64 decodes + 8 prompts of 512", decode=64, prompts=8, prompt_len=512),
]


def cpu_line() -> str:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    flags = Path("/proc/cpuinfo").read_text()
    isa = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "no AVX2"
    return f"{model}, {isa}, {torch.get_num_threads()} threads, Python {platform.python_version()}, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["8b", "toy"], default="8b")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (vLLM's flag)")
    ap.add_argument(
        "--async-scheduling", action="store_true",
        help="vLLM's flag: a step launches before the previous one is read back (its read-back is that one's ids)",
    )  # fmt: skip
    ap.add_argument("--only", help="run the scenarios whose name contains this")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--work-dir", help="where the shape and its adapters are written (kept between runs)")
    args = ap.parse_args(argv)
    config = LLAMA3_8B_CONFIG if args.shape == "8b" else TOY_CONFIG
    work = Path(args.work_dir or Path(tempfile.gettempdir()) / f"loraplane-host-overhead-{args.shape}")
    folder = write_shape(work / "base", config)
    shape = resolve_base(str(folder), work / "cache-shape", weights=False).shape
    names = [f"a{i:02d}" for i in range(args.adapters)]
    for i, name in enumerate(names):  # rank 1: what a step does on the host does not depend on ranks
        if not (work / "adapters" / name / "adapter_config.json").exists():
            write_adapter(work / "adapters" / name, shape, 1, seed=i, dtype=torch.bfloat16)
    settings = dict(
        model=str(folder),
        dtype="bfloat16",
        max_loras=args.adapters + 1,
        max_cpu_loras=args.adapters + 1,
        max_lora_rank=16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=2048,
        num_kv_blocks=40_000,
        block_size=16,
        enable_prefix_caching=False,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        cache_dir=work / "cache",
    )
    print(cpu_line())
    layers, graphs = config["num_hidden_layers"], "eager" if args.enforce_eager else "decode and prompt graphs"
    graphs += ", async scheduling" if args.async_scheduling else ""
    print(
        f"{args.shape} shape: hidden {config['hidden_size']}, {layers} layers, vocab {config['vocab_size']}; "
        f"{args.adapters} adapters pinned on {args.adapters + 1} slots; {graphs}; bf16"
    )
    rows = []
    with device_free_engine(settings) as (engine, recorder):
        for name in names:
            engine.register_lora(AdapterSpec(name, str(work / "adapters" / name)))
            engine.pin_lora(name)
        place_all(engine, names)
        cost = per_op_cost(recorder)
        print(f"the recorder's own cost: {cost * 1e6:.1f} us per operation\n")
        header = (
            f"{'step':40} {'host ms (min-max)':>22} {'launches':>9} {'replays':>8} {'read-backs (bytes)':>19} {'copies in':>10}"
        )
        print(header)
        for s in SCENARIOS:
            if args.only and args.only not in s.name:
                continue
            start = time.perf_counter()
            figures = run_scenario(engine, recorder, s, names, args.repeats)
            ms = sorted(f.seconds * 1e3 for f in figures)
            t = figures[len(figures) // 2].tally
            row = {
                "step": s.name, "host_ms": statistics.median(ms), "host_ms_min": ms[0], "host_ms_max": ms[-1],
                "launches": t.launches, "graph_replays": t.graph_replays, "read_backs": t.read_backs,
                "read_back_bytes": t.read_back_bytes, "copies_in": t.copies_in, "ops": t.ops, "top_ops": t.by_op.most_common(12),
            }  # fmt: skip
            rows.append(row)
            print(
                f"{s.name:40} {row['host_ms']:>9.2f} ({ms[0]:.2f}-{ms[-1]:.2f}) {t.launches:>9} {t.graph_replays:>8} "
                f"{t.read_backs:>8} ({t.read_back_bytes:>8}) {t.copies_in:>10}   [{time.perf_counter() - start:.0f} s]",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"cpu": cpu_line(), "shape": args.shape, "recorder_us_per_op": cost * 1e6, "rows": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
