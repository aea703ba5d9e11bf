"""Where a serving step's time goes on one GPU: an 8B-shaped engine (random bfloat16 weights, as
``gpu_check.py`` part 4 builds it) serves a Zipf trace over 32 adapters, every step timed and
sorted into steps that carry prompt tokens and decode-only steps (CUDA graph replays); then
torch's profiler lists the top operations by host time and by GPU time over a shorter trace.

A step whose wall time is far above its GPU time is host-bound: the figure to lower is the host
work per step, not a kernel.

Run:
  python benchmarks/gpu_step_profile.py                 # on a GPU, about a minute on an H200
  python benchmarks/gpu_step_profile.py --device cpu    # a toy shape on the CPU: the script's logic
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gpu_check as g


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--requests", type=int, default=128)
    args = parser.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from loraplane.serving.bench.shapes import LLAMA3_8B_CONFIG, TOY_CONFIG, write_shape
    from loraplane.serving.config import EngineConfig
    from loraplane.serving.engine.builder import build_engine
    from loraplane.serving.engine.sampling_params import SamplingParams
    from loraplane.serving.lora.entries import AdapterSpec
    from loraplane.serving.lora.synthetic import seed_ranks, write_adapter
    from loraplane.serving.weights.base import resolve_base

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("gpu_step_profile: no CUDA device (use --device cpu to check the script)", file=sys.stderr)
        return 2
    raw = LLAMA3_8B_CONFIG if cuda else TOY_CONFIG
    w = g.Workload(32, args.requests, 256, 64, 32) if cuda else g.Workload(8, 8, 16, 4, 4)
    work = Path(tempfile.mkdtemp(prefix="step-profile-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # the run's adapters and caches go at exit
    folder = write_shape(work / "model", raw)  # config.json and a small tokenizer: prompts are token ids
    shape = resolve_base(str(folder), work / "shape-cache", weights=False).shape
    trace = g.zipf_trace(w, raw["vocab_size"])
    used = sorted({adapter for _, adapter in trace})
    ranks = seed_ranks(w.num_adapters)
    for name in used:
        write_adapter(work / "adapters" / name, shape, ranks[int(name[1:])], seed=int(name[1:]), dtype=torch.bfloat16)
    engine = build_engine(
        EngineConfig(
            model=str(folder), load_format="dummy", device=args.device, dtype="bfloat16" if cuda else "float32",
            kernel_backend="triton" if cuda else "cpu", max_loras=w.max_loras, max_cpu_loras=w.num_adapters,
            max_lora_rank=64, max_model_len=320, kv_cache_memory_mb=20000 if cuda else 200, enable_prefix_caching=False,
            cache_dir=work / "cache",
        )
    )  # fmt: skip
    for name in used:
        engine.register_lora(AdapterSpec(name, str(work / "adapters" / name)))
        engine.prefetch_lora(name)
    while engine.adapters.loads_in_flight():
        engine.adapters.wait_for_loads(timeout=1.0)
        engine.adapters.poll()
    scheduled: dict[str, int] = {}
    schedule = engine.scheduler.schedule

    def counted() -> Any:
        batch = schedule()
        scheduled["rows"], scheduled["tokens"] = len(batch.items), batch.num_tokens
        return batch

    engine.scheduler.schedule = counted  # type: ignore[method-assign]
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def serve(requests: list[tuple[list[int], str]], output_len: int) -> tuple[float, list[tuple[float, int, int]]]:
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        for prompt, adapter in requests:
            engine.add_request(prompt, params, adapter=adapter)
        steps, began = [], time.perf_counter()
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            sync()
            steps.append((time.perf_counter() - start, scheduled.get("rows", 0), scheduled.get("tokens", 0)))
        return time.perf_counter() - began, steps

    serve(trace[:16], 4)  # compiles and captures what the timed run needs
    wall, steps = serve(trace, w.output_len)
    print(
        f"{torch.cuda.get_device_name() if cuda else 'CPU'}; {len(trace)} requests x ({w.prompt_len} prompt + "
        f"{w.output_len} output) over {len(used)} adapters: {wall:.2f} s, {len(steps)} steps, "
        f"{len(trace) * w.output_len / wall:.0f} generated tok/s"
    )
    kinds = {
        "steps with prompt tokens": [s for s in steps if s[2] > s[1]],
        "decode-only steps": [s for s in steps if s[2] == s[1] and s[1]],
    }
    for kind, chosen in kinds.items():
        if chosen:
            ms = sorted(s[0] * 1e3 for s in chosen)
            print(
                f"{kind}: {len(chosen)}, {sum(ms) / 1e3:.2f} s in all; ms median {statistics.median(ms):.1f}, "
                f"p90 {ms[int(len(ms) * 0.9)]:.1f}; rows median {statistics.median(s[1] for s in chosen)}, "
                f"tokens median {statistics.median(s[2] for s in chosen)}"
            )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        serve(trace[: max(len(trace) // 2, 1)], 16)
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    if cuda:
        print(table.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
