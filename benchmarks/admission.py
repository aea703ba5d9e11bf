"""The scheduler's admission on its own: one ``Scheduler.schedule()`` that takes every waiting
prompt into the batch, with fair scheduling on (the engine's default), for several queue lengths
and numbers of tenants. Torch-free and device-free: what a step with many new prompts costs the
host before any metadata is built (the seed scenario's 256 requests arrive at once).

  python benchmarks/admission.py                 # medians of 15 rounds, a line a case
  python benchmarks/admission.py --json out.json

Compare two checkouts by running it in each, alternately (``PYTHONPATH`` over each checkout's
src folders); it imports only names the scheduler has long had.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

from loraplane.serving.engine.block_manager import BlockManager
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.engine.scheduler import Scheduler
from loraplane.serving.engine.sequence import Sequence

CASES = [(96, 1), (96, 8), (256, 1), (256, 32), (1024, 128)]  # (waiting prompts, tenants)
PROMPT_LEN = 85  # 96 prompts of 85 tokens: about the host-overhead benchmark's 8,192-token step


def admit_all(prompts: int, tenants: int) -> tuple[float, list[str]]:
    """Seconds for the one ``schedule()`` that admits ``prompts`` waiting prompts spread over
    ``tenants`` tenants in turn, and the order it admitted them in."""
    blocks = BlockManager(prompts * (PROMPT_LEN // 16 + 2), 16)
    sched = Scheduler(blocks, max_num_seqs=prompts, max_num_batched_tokens=prompts * PROMPT_LEN, fair=True)
    for i in range(prompts):
        seq = Sequence(f"r{i}", [1 + (i + j) % 997 for j in range(PROMPT_LEN)], SamplingParams())
        seq.tenant = f"t{i % tenants}"
        sched.add(seq)
    start = time.perf_counter()
    batch = sched.schedule()
    seconds = time.perf_counter() - start
    if len(batch.items) != prompts:
        raise RuntimeError(f"{len(batch.items)} of {prompts} prompts admitted")
    return seconds, [s.request_id for s, _ in batch.items]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}; fair scheduling")
    figures = {}
    for prompts, tenants in CASES:
        admit_all(prompts, tenants)  # warm
        times = [admit_all(prompts, tenants)[0] for _ in range(args.rounds)]
        ms = statistics.median(times) * 1e3
        figures[f"{prompts} prompts, {tenants} tenants"] = ms
        print(f"admit {prompts:5d} prompts from {tenants:3d} tenant(s): {ms:7.2f} ms (min {min(times) * 1e3:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
