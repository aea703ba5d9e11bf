"""Step timelines: the requests of the demo scenario whose first token took the most engine steps
under demand placement, each with its state in every step from its arrival to that token.

Run: python benchmarks/step_timelines.py [--top 4] [--clock wall]  (about 2 minutes; any option
of hot_tenants_bench.py may follow, e.g. --load 0.8)

By default the arrivals are those of ``hot_tenants_bench.py --only demo --clock steps``: capacity
measured in engine steps, so they fall in the same steps in every run and a timeline here is a
request of that bench's ``demand`` run. With ``--clock wall`` they arrive on the wall clock, as in
that bench's default runs, whose slow requests differ from run to run: the timelines then also
give each request's time to first token and each step's length, to find what held back a
wall-clock p99 (the arrivals that join in the middle of a step, and the steps the engine
interjects for them, are seen only in the states after the step). A request's state after each
step:

- ``Q``: queued;
- ``P``: parked (its adapter's turn on a shared slot ended; its KV is kept);
- ``R<n>``: running, with n tokens computed in that step (1 for a decode, more for a prompt chunk);
- ``*`` after it: its tenant is over its share of the batch, so its prompts get at most
  ``fair_prefill_chunk`` tokens per step between the tenants over theirs, or one short prompt
  whole in its place when the tenant has nothing else queued (``engine.scheduler``).

Under each timeline, the batch after each step: how many sequences run, and in brackets how many
of them are the request's tenant's; against ``--max-num-seqs`` (16), that says when a queued
request waited for a place in the batch rather than for its adapter.

The bench's figures say how long the slowest first tokens took; these say where the steps went.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter, defaultdict
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
        self.at: list[float] = [time.monotonic()]  # when each step ended; [0] is when watching began
        self.states: dict[str, list[tuple[int, str]]] = defaultdict(list)
        self.batch: list[Counter[str | None]] = [Counter()]  # the running sequences per tenant after each step
        self.adapter: dict[str, str | None] = {}
        self.tenant: dict[str, str | None] = {}
        self.first: dict[str, int] = {}
        self._computed: dict[str, int] = {}

    def __call__(self, engine: LLMEngine, outs: list[RequestOutput]) -> None:
        self.step += 1
        self.at.append(time.monotonic())
        sched = engine.scheduler
        self.batch.append(Counter(seq.tenant for seq in sched.running))
        over = sched._over_share()  # the scheduler's own rule, read rather than written again
        for state, seqs in (("Q", sched.waiting), ("P", sched.parked)):
            for seq in seqs:
                self.adapter[seq.request_id], self.tenant[seq.request_id] = seq.adapter, seq.tenant
                self.states[seq.request_id].append((self.step, state))
        for seq in sched.running:
            done = seq.num_computed_tokens - self._computed.get(seq.request_id, 0)
            self._computed[seq.request_id] = seq.num_computed_tokens
            self.adapter[seq.request_id], self.tenant[seq.request_id] = seq.adapter, seq.tenant
            self.states[seq.request_id].append((self.step, f"R{max(done, 0)}" + ("*" if seq.tenant in over else "")))
        for out in outs:
            if out.token_ids and out.request_id not in self.first:
                self.first[out.request_id] = self.step

    def slowest(self, adapter: str, top: int, ttft: dict[str, float]) -> list[tuple[str, int, list[tuple[int, str]]]]:
        """The ``top`` requests of ``adapter`` that took most steps to their first token (from the
        step they were first seen in), or with ``ttft`` (seconds, per request id) the longest
        times: each one's id, steps and states up to that token."""
        waits = []
        for rid, first in self.first.items():
            seen = [s for s in self.states[rid] if s[0] <= first]
            if self.adapter.get(rid) == adapter and seen:
                steps = first - seen[0][0] + 1
                waits.append((ttft.get(rid, steps), rid, steps, seen))
        return [(rid, steps, seen) for _, rid, steps, seen in sorted(waits, key=lambda w: -w[0])[:top]]

    def lengths(self, seen: list[tuple[int, str]]) -> str:
        """The wall time of each step in ``seen``, in ms."""
        return " ".join(f"{1e3 * (self.at[step] - self.at[step - 1]):.0f}" for step, _ in seen)

    def batches(self, rid: str, seen: list[tuple[int, str]]) -> str:
        """The batch after each step in ``seen``: its running sequences, and in brackets those
        of the request's tenant (a queued request of a tenant over its share waits for a place
        in a full batch, ``max_num_seqs``)."""
        tenant = self.tenant.get(rid)
        return " ".join(f"{sum(self.batch[step].values())}({self.batch[step][tenant]})" for step, _ in seen)


def main() -> None:
    own = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    own.add_argument("--top", type=int, default=4, help="requests shown per adapter")
    own.add_argument("--clock", choices=["wall", "steps"], default="steps", help="as hot_tenants_bench.py's")
    mine, rest = own.parse_known_args()
    args = bench.options().parse_args([*rest, "--clock", mine.clock])
    torch.set_num_threads(usable_cpus())
    base = resolve_base("embedded", EngineConfig().cache_dir)
    print(f"embedded base ({base.shape.name}), {machine(resolve_dtype(EngineConfig().dtype))}")
    timelines = Timelines()
    with tempfile.TemporaryDirectory() as tmp:
        folders = {n: write_adapter(Path(tmp) / n, base.shape, args.rank, LLAMA_TARGETS, seed=i) for i, n in enumerate(NAMES)}
        cap, step_clock = bench.capacity(folders, args)
        arrivals = poisson_arrivals(bench.zipf_weights([*NAMES, None]), args.demo_requests, args.load * cap)
        run = bench.serve("demand", folders, arrivals, 2, 12, args, "demand", step_clock, after_step=timelines)
    print(f"demo scenario under demand placement, {args.demo_requests} requests at {args.load:g} x a capacity of {cap:.2f} req/s")
    wall = mine.clock == "wall"
    records = {r.request_id: r for r in run.records} if wall else {}
    for name in NAMES:
        slowest = timelines.slowest(name, mine.top, {rid: r.ttft for rid, r in records.items()})
        print(f"\n{name}: steps to first token of the {'slowest' if wall else 'most'}, {[w for _, w, _ in slowest]}")
        for rid, steps, seen in slowest:
            print(f"  {steps:3d}  " + " ".join(state for _, state in seen))
            print(f"       batch (its tenant's): {timelines.batches(rid, seen)}")
            if wall:
                r = records[rid]
                print(
                    f"       ttft {1e3 * r.ttft:.0f} ms (lag {1e3 * r.lag:.0f}, queue {1e3 * r.queue_wait:.0f}, "
                    f"arrived with its adapter on {r.arrival_tier}); step ms: {timelines.lengths(seen)}"
                )


if __name__ == "__main__":
    main()
