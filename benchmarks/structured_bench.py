"""The cost of structured output per decode step, on the embedded base: the same batch of chat
prompts generated with a JSON schema and without, alternated round by round (this machine's
speed drifts), medians quoted. The mask's own time (llguidance filling every guided row's bitmask
and the batch's logits masked with it) is measured inside the guided runs, step by step.

    python benchmarks/structured_bench.py [--rounds 3] [--batch 8] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import statistics
import time

import loraplane.serving.engine.sampler as sampler_module
from loraplane.serving.bench.engine_replay import machine
from loraplane.serving.config import EngineConfig
from loraplane.serving.engine.builder import build_engine
from loraplane.serving.engine.sampling_params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    engine = build_engine(EngineConfig())
    guide = engine.grammars.compile(SCHEMA)
    prompts = [
        engine.tokenizer.chat([{"role": "user", "content": f"Describe person number {i} as JSON with name, age and city."}])
        for i in range(args.batch)
    ]
    mask_times: list[float] = []
    real_mask = sampler_module.mask_guided

    def timed_mask(logits, seqs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return real_mask(logits, seqs)
        finally:
            if any(s.params.guide is not None for s in seqs):
                mask_times.append(time.perf_counter() - start)

    sampler_module.mask_guided = timed_mask  # type: ignore[assignment]
    step_ms: dict[str, list[float]] = {"plain": [], "json_schema": []}
    mask_ms: list[float] = []
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, guide=guide))  # warm: the tokenizer wrap, first kernels
    for r in range(args.rounds):
        for kind in ["plain", "json_schema"] if r % 2 == 0 else ["json_schema", "plain"]:
            params = SamplingParams(
                max_tokens=args.max_tokens, temperature=0.7, seed=r, ignore_eos=kind == "plain",
                guide=guide if kind == "json_schema" else None,
            )  # fmt: skip
            mask_times.clear()
            start = time.perf_counter()
            outs = engine.generate(prompts, params)
            wall = time.perf_counter() - start
            steps = max(len(o.token_ids) for o in outs)
            step_ms[kind].append(1e3 * wall / steps)
            if kind == "json_schema":
                mask_ms.append(1e3 * statistics.median(mask_times))
            print(f"round {r + 1} {kind:12s} {1e3 * wall / steps:7.1f} ms/step over {steps} steps", flush=True)
    plain, guided, mask = (statistics.median(v) for v in (step_ms["plain"], step_ms["json_schema"], mask_ms))
    print(f"\n{machine(engine.dtype)}; "
          f"batch {args.batch}, medians of {args.rounds} rounds")  # fmt: skip
    print(f"step, plain          {plain:7.1f} ms")
    print(f"step, json_schema    {guided:7.1f} ms  ({guided / plain:.2f}x)")
    print(f"mask per step        {mask:7.2f} ms  ({100 * mask / guided:.1f}% of a guided step)")


if __name__ == "__main__":
    main()
