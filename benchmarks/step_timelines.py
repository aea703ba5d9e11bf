"""Step timelines: the requests of the demo scenario whose first token took the most engine steps
under demand placement, each with its state in every step from its arrival to that token.

Run: python benchmarks/step_timelines.py [--top 4]  (about 2 minutes; any option of
hot_tenants_bench.py may follow, e.g. --load 0.8)

The arrivals are those of ``hot_tenants_bench.py --only demo --clock steps``: capacity measured
in engine steps, so they fall in the same steps in every run and a timeline here is a request of
that bench's ``demand`` run. A request's state after each step:

- ``Q``: queued;
- ``P``: parked (its adapter's turn on a shared slot ended; its KV is kept);
- ``R<n>``: running, with n tokens computed in that step (1 for a decode, more for a prompt chunk);
- ``*`` after it: its tenant is over its share of the batch, so its prompts get at most
  ``fair_prefill_chunk`` tokens per step between the tenants over theirs, or one short prompt
  whole in its place when the tenant has nothing else queued (``engine.scheduler``).

The bench's figures say how long the slowest first tokens took; these say where the steps went.
"""

from __future__ import annotations

import argparse
import tempfile
from collections import defaultdict
from pathlib import Path

import hot_tenants_bench as bench
import torch

from loraplane.adapter_format import LLAMA_TARGETS
from loraplane.serving.bench.engine_replay import machine, poisson_arrivals, usable_cpus
from loraplane.serving.config import EngineConfig
from loraplane.serving.engine.builder import resolve_dtype
from loraplane.serving.engine.llm_engine import LLMEngine
from loraplane.serving.engine.outputs import RequestOutput
from loraplane.serving.lora.synthetic import write_adapter
from loraplane.serving.weights.base import resolve_base

NAMES = ["pirate", "shouty", "bullets"]  # the demo scenario's adapters, hottest first


class Timelines:
    """Each request's state after every step (``replay``'s ``after_step``), and the step of its first token."""

    def __init__(self) -> None:
        self.step = 0
        self.states: dict[str, list[tuple[int, str]]] = defaultdict(list)
        self.adapter: dict[str, str | None] = {}
        self.first: dict[str, int] = {}
        self._computed: dict[str, int] = {}

    def __call__(self, engine: LLMEngine, outs: list[RequestOutput]) -> None:
        self.step += 1
        sched = engine.scheduler
        over = sched._over_share()  # the scheduler's own rule, read rather than written again
        for state, seqs in (("Q", sched.waiting), ("P", sched.parked)):
            for seq in seqs:
                self.adapter[seq.request_id] = seq.adapter
                self.states[seq.request_id].append((self.step, state))
        for seq in sched.running:
            done = seq.num_computed_tokens - self._computed.get(seq.request_id, 0)
            self._computed[seq.request_id] = seq.num_computed_tokens
            self.adapter[seq.request_id] = seq.adapter
            self.states[seq.request_id].append((self.step, f"R{max(done, 0)}" + ("*" if seq.tenant in over else "")))
        for out in outs:
            if out.token_ids and out.request_id not in self.first:
                self.first[out.request_id] = self.step

    def slowest(self, adapter: str, top: int) -> list[tuple[int, list[tuple[int, str]]]]:
        """The ``top`` requests of ``adapter`` that took most steps to their first token (from the
        step they were first seen in), each with its states up to that token."""
        waits = []
        for rid, first in self.first.items():
            seen = [s for s in self.states[rid] if s[0] <= first]
            if self.adapter.get(rid) == adapter and seen:
                waits.append((first - seen[0][0] + 1, seen))
        return sorted(waits, key=lambda w: -w[0])[:top]


def main() -> None:
    own = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    own.add_argument("--top", type=int, default=4, help="requests shown per adapter")
    mine, rest = own.parse_known_args()
    args = bench.options().parse_args([*rest, "--clock", "steps"])
    torch.set_num_threads(usable_cpus())
    base = resolve_base("embedded", EngineConfig().cache_dir)
    print(f"embedded base ({base.shape.name}), {machine(resolve_dtype(EngineConfig().dtype))}")
    timelines = Timelines()
    with tempfile.TemporaryDirectory() as tmp:
        folders = {n: write_adapter(Path(tmp) / n, base.shape, args.rank, LLAMA_TARGETS, seed=i) for i, n in enumerate(NAMES)}
        cap, step_clock = bench.capacity(folders, args)
        arrivals = poisson_arrivals(bench.zipf_weights([*NAMES, None]), args.demo_requests, args.load * cap)
        bench.serve("demand", folders, arrivals, 2, 12, args, "demand", step_clock, after_step=timelines)
    print(f"demo scenario under demand placement, {args.demo_requests} requests at {args.load:g} x a capacity of {cap:.2f} req/s")
    for name in NAMES:
        slowest = timelines.slowest(name, mine.top)
        print(f"\n{name}: steps to first token, slowest {[w for w, _ in slowest]}")
        for steps, seen in slowest:
            print(f"  {steps:3d}  " + " ".join(state for _, state in seen))


if __name__ == "__main__":
    main()
