"""The CPU decode step's GEMMs alone: the embedded base's 121 weights (30 layers of q/k/v, o,
gate/up and down, and the LM head) against 16 rows, random weights cycled so they come from
memory as in a step; oneDNN with packed weights (``cpu_gemm``, what the engine runs) against
torch's plain ``F.linear``, in float32 and bfloat16, alternated.

  python benchmarks/cpu_gemms.py            # medians of 10 passes a contender, two rounds

It says how much of ``benchmarks/cpu_step.py``'s step is the weights' streaming, which no change
to the rest of the step can remove, and whether bfloat16 pays on this CPU (it does only where
the CPU has BF16 instructions; elsewhere oneDNN converts every operand).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn import functional as F

from loraplane.serving.model import cpu_gemm

HIDDEN, INTERMEDIATE, VOCAB, LAYERS, KV = 576, 1536, 49152, 30, 192  # SmolLM2-135M
ROWS = 16


def contenders(dtype: torch.dtype) -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    shapes = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    weights = [[(torch.randn(o, i) * 0.02).to(dtype) for o, i in shapes] for _ in range(LAYERS)]
    weights.append([(torch.randn(VOCAB, HIDDEN) * 0.02).to(dtype)])
    packed = [[cpu_gemm.pack(w) for w in layer] for layer in weights]
    x = {n: torch.randn(ROWS, n).to(dtype) for n in (HIDDEN, INTERMEDIATE)}
    name = str(dtype).removeprefix("torch.")

    def plain() -> None:
        for layer in weights:
            for w in layer:
                F.linear(x[w.shape[1]], w)

    def onednn() -> None:
        for layer, packs in zip(weights, packed, strict=True):
            for w, p in zip(layer, packs, strict=True):
                cpu_gemm.linear(x[w.shape[1]], p)

    return {f"{name}, oneDNN packed": onednn, f"{name}, F.linear": plain}


def median_ms(f: Callable[[], None], passes: int = 10) -> float:
    f()
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    info = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "CPU")
    isa = "AVX-512 BF16" if "avx512_bf16" in info else "AVX-512" if " avx512f" in info else "AVX2"
    print(f"{model} ({isa}), {torch.get_num_threads()} threads, native bf16: {cpu_gemm.native_bf16()}")
    print(f"{ROWS} rows against {LAYERS * 4 + 1} weights, random, cycled")
    runs = {**contenders(torch.float32), **contenders(torch.bfloat16)}
    figures: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(2):
        for name, f in runs.items():
            figures[name].append(median_ms(f))
    for name, ms in figures.items():
        print(f"{name:28s} " + ", ".join(f"{m:.1f}" for m in ms) + " ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
