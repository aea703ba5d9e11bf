"""Where the CPU adapter path should switch a segment from the row kernel to BLAS, measured on
engine steps: new prompts beside running decodes, the steps a live server's first tokens wait for.

Run: python benchmarks/cpu_segment_threshold.py [--dtype float32] [--rounds 4]  (2 to 4 minutes)

For each step shape (decodes running, then prompts of the given lengths admitted together, each
prompt on another adapter than its neighbours), the one step that admits the prompts is timed
with segments going through BLAS from each candidate length (``kernels.cpu.SEGMENT_BLAS_MIN_LEN``,
set here for the run; shorter segments and the decodes go through the row kernel). Candidates
alternate within each round; medians over rounds of the median of three steps.

Timed alone, one projection's adapter product gave another answer: BLAS won from 16 tokens in
bfloat16 and at every length in float32 (hot caches, one call repeated). Inside a step, beside
the base matmuls, rows won up to a few dozen tokens in bfloat16 and about a hundred in float32, so
the engine's thresholds come from here.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from loraplane.adapter_format import LLAMA_TARGETS
from loraplane.kernels import cpu
from loraplane.serving.bench.engine_replay import machine
from loraplane.serving.config import EngineConfig
from loraplane.serving.engine.builder import build_engine, resolve_dtype
from loraplane.serving.engine.llm_engine import LLMEngine
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.lora.synthetic import write_adapter

NAMES = ("a", "b", "c")
SHAPES = ((5, (20, 20)), (8, (40,)), (4, (120,)), (2, (400,)))  # (decodes running, new prompts' lengths)
CANDIDATES = {"half": (16, 48, 128), "float32": (8, 128, 512)}


def step_ms(engine: LLMEngine, decodes: int, prompts: tuple[int, ...], rng: random.Random, reps: int = 3) -> float:
    """The median time of the step that admits ``prompts`` beside ``decodes`` running requests."""

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 40_000) for _ in range(n)]

    times = []
    for _ in range(reps):
        running = [
            engine.add_request(tokens(20), SamplingParams(max_tokens=60, temperature=0, ignore_eos=True), adapter=NAMES[i % 2])
            for i in range(decodes)
        ]
        while any(not engine.requests[i].output_token_ids for i in running):
            engine.step()
        engine.step()  # a plain decode step: nothing of the prompts' admission left over
        short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        for j, n in enumerate(prompts):
            engine.add_request(tokens(n), short, adapter=NAMES[(j + 2) % 3])
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        for request_id in list(engine.requests):
            engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()
    return 1e3 * statistics.median(times)


def set_threshold(dtype: torch.dtype, length: int) -> None:
    if dtype == torch.float32:
        cpu.SEGMENT_BLAS_MIN_LEN[torch.float32] = length
    else:
        cpu.SEGMENT_BLAS_MIN_LEN_HALF = length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype)
    candidates = CANDIDATES["float32" if dtype == torch.float32 else "half"]
    default = cpu.blas_min_len(dtype)
    with tempfile.TemporaryDirectory() as tmp:
        config = EngineConfig(dtype=args.dtype, max_loras=3, max_lora_rank=16, max_num_seqs=32)
        engine = build_engine(config)
        for i, name in enumerate(NAMES):
            engine.load_lora(name, str(write_adapter(Path(tmp) / name, engine.base.shape, 16, LLAMA_TARGETS, seed=i)))
        print(f"embedded {engine.base.shape.name}, {machine(dtype)}; the engine's threshold for it: {default} tokens")
        rng = random.Random(0)
        step_ms(engine, 2, (20,), rng, reps=2)  # warm-up (numba and oneDNN compile on first use)
        samples: dict[tuple[int, int], list[float]] = {}
        for r in range(args.rounds):
            for length in candidates if r % 2 == 0 else reversed(candidates):
                set_threshold(dtype, length)
                for s, (decodes, prompts) in enumerate(SHAPES):
                    samples.setdefault((s, length), []).append(step_ms(engine, decodes, prompts, rng))
        set_threshold(dtype, default)
    print(f"\nms for the step that admits the prompts (median of {args.rounds} rounds), by where BLAS starts:")
    print(f"{'decodes + new prompts':<26}" + "".join(f"{f'BLAS from {n}':>15}" for n in candidates))
    for s, (decodes, prompts) in enumerate(SHAPES):
        label = f"{decodes} + {' and '.join(map(str, prompts))} tokens"
        print(f"{label:<26}" + "".join(f"{statistics.median(samples[(s, n)]):>15.1f}" for n in candidates))


if __name__ == "__main__":
    main()
