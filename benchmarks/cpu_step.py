"""The CPU engine's decode step on the embedded base (SmolLM2-135M), at batch 16: bare, and with
every row on an adapter (8 adapters of rank 8 on all seven projections, two rows each).

  python benchmarks/cpu_step.py                 # one figure each: the median step of --steps
  python benchmarks/cpu_step.py --json out.json
  python benchmarks/cpu_step.py --without-gemms # every packed GEMM a zero tensor: the rest of the step
  python benchmarks/cpu_step.py --dtype float32  # a dtype other than auto's choice (older checkouts too)

Compare two checkouts by running this script in each, alternately, several times, and quoting the
medians (the machine's speed drifts by tens of percent within minutes); docs/benchmarks.md, "The
CPU step", gives the command used. It imports only names every version of the engine has had.
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

from loraplane.adapter_format import LLAMA_TARGETS
from loraplane.serving.config import EngineConfig
from loraplane.serving.engine.builder import build_engine
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.lora.synthetic import write_adapter


def cpu() -> str:
    info = Path("/proc/cpuinfo").read_text()
    model = next(
        (line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), platform.processor()
    )
    isa = "AVX-512 BF16" if "avx512_bf16" in info else "AVX-512" if " avx512f" in info else "AVX2"
    return f"{model} ({isa}), {torch.get_num_threads()} threads"


def decode_step_ms(engine: object, adapters: list[str | None], steps: int) -> float:
    """The median of ``steps`` decode steps of 16 running requests (40-token prompts)."""
    ids = [
        engine.add_request(  # type: ignore[attr-defined]
            [100 + i + j for j in range(40)], SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True),
            adapter=adapters[i % len(adapters)],
        )
        for i in range(16)
    ]  # fmt: skip
    for _ in range(3):  # the prompts, then the first decodes
        engine.step()  # type: ignore[attr-defined]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()  # type: ignore[attr-defined]
        times.append(time.perf_counter() - start)
    for i in ids:
        engine.abort(i)  # type: ignore[attr-defined]
    engine.step()  # type: ignore[attr-defined]
    return statistics.median(times) * 1e3


def without_gemms() -> None:
    """Every packed GEMM (``cpu_gemm.linear``: the projections and the LM head) replaced by a zero
    tensor of its output's shape, so the step's time is what everything else costs. The tokens
    are then meaningless; the work per step is not (decode rows, KV, adapters all as before)."""
    from loraplane.serving.model import cpu_gemm

    real, widths = cpu_gemm.linear, {}

    def zeros(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if id(packed) not in widths:
            widths[id(packed)] = real(x[:1], packed, bias).shape[1]
        return torch.zeros(x.shape[0], widths[id(packed)], dtype=x.dtype)

    cpu_gemm.linear = zeros


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--without-gemms", action="store_true", help="time the step with every packed GEMM a zero tensor")
    ap.add_argument("--dtype", default="auto", help="the engine's dtype (auto: bfloat16 where the CPU has native bf16)")
    args = ap.parse_args(argv)
    if args.without_gemms:
        without_gemms()
    # The engine converts the embedded base into its cache here (about 670 MB): removed at the end.
    with tempfile.TemporaryDirectory(prefix="cpu-step-") as tmp:
        work = Path(tmp)
        config = EngineConfig(model="embedded", max_model_len=512, max_loras=8, max_lora_rank=8, cache_dir=work, dtype=args.dtype)
        engine = build_engine(config)
        names = [f"s{i}" for i in range(8)]
        for i, name in enumerate(names):
            folder = write_adapter(work / "adapters" / name, engine.base.shape, 8, tuple(LLAMA_TARGETS), seed=i)
            engine.load_lora(name, str(folder))
        bare = decode_step_ms(engine, [None], args.steps)
        mixed = decode_step_ms(engine, list(names), args.steps)
    figures = {"cpu": cpu(), "dtype": str(engine.dtype).removeprefix("torch."), "bare_ms": bare, "adapters_ms": mixed}
    what = "decode step without its GEMMs" if args.without_gemms else "decode step"
    print(f"{figures['cpu']}, {figures['dtype']}: {what} at batch 16: bare {bare:.1f} ms, on 8 adapters {mixed:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
