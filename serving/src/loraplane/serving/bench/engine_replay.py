"""Replay timed arrivals straight into an engine (no HTTP), stepping it meanwhile.

The engine benchmarks (tiers, placement) measure the engine's own scheduling and placement, so
they drive :class:`LLMEngine` in-process: arrivals are added when their time comes, the engine
steps between them, and each request's time to first token is taken from the step that produced
it. Open loop, as a load generator should be: a slow engine does not slow the arrivals down.
"""

from __future__ import annotations

import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from loraplane.serving.engine.llm_engine import LLMEngine
from loraplane.serving.engine.outputs import RequestOutput
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.engine.sequence import Sequence


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the start
    adapter: str | None
    tenant: str | None = None


@dataclass(frozen=True)
class Record:
    arrival: Arrival
    arrival_tier: str | None  # where its adapter was when it arrived: device, host or cold
    queue_wait: float  # seconds from its arrival at the engine to its first admission into a batch
    ttft: float  # seconds from its arrival time to its first token
    tokens: int
    # Where its time to first token went (seconds): the arrival's wait for the step in flight
    # (arrivals reach the engine between steps, or between a step's layers where the engine
    # interjects, as through the server's engine loop), then the queue until its first
    # admission, then the steps from admission to its first token.
    lag: float = 0.0
    first_steps: float = 0.0
    preemptions: int = 0
    request_id: str = ""  # the engine's id, to match what a watcher (``after_step``) saw of it
    latency: float = 0.0  # seconds from its arrival time to its last token (the answer's end)


@dataclass
class Replayed:
    records: list[Record]  # the finished requests
    wall: float  # seconds from the start to the last token
    step_seconds: list[float] = field(default_factory=list)  # each step that ran a batch
    tokens_per_step: list[int] = field(default_factory=list)  # tokens those steps produced
    aborted: int = 0  # requests still in the engine when ``until`` ended the replay


def replay(
    engine: LLMEngine,
    arrivals: list[Arrival],
    *,
    prompt_len: int,
    out_len: int,
    label: str = "replay",
    seed: int = 1,
    until: Callable[[Arrival], bool] | None = None,
    step_clock: float | None = None,
    after_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
) -> Replayed:
    """Send each arrival at its time (random prompts of ``prompt_len`` tokens, ``out_len`` greedy
    tokens each) and step the engine until every request has finished or, with ``until``, until
    every arrival it selects has (the rest are aborted: a burster's backlog need not drain for its
    neighbour's figures). One loop: arrivals, steps and aborts interleave on one clock; arrivals
    also join between the layers of a step, as through the server.

    ``step_clock``: replay on a clock that advances this many seconds per step that runs a batch
    (and by the wall time of a step that only waits for a load) instead of the wall clock. The
    engine's decisions depend only on the steps its requests arrive in, so the figures are then
    the same in every run, however the machine's speed drifts meanwhile; they count steps, not
    what each step costs (a longer prefill step counts as one).

    ``after_step``: called after every engine step with its outputs, to watch the engine's state
    step by step (``benchmarks/step_timelines.py``)."""
    rng = random.Random(seed)
    vocab = engine.base.config.vocab_size
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    pending: dict[str, tuple[Arrival, Sequence, float]] = {}
    first: dict[str, float] = {}
    out = Replayed([], 0.0)
    order = sorted(arrivals, key=lambda a: a.at)
    awaited = sum(1 for a in order if until is not None and until(a))
    bar = tqdm(total=len(order), desc=label, unit="req", leave=False)
    admitted: dict[str, float] = {}  # when it was first admitted (on the step clock: before that step)
    start, sent, clock = time.monotonic(), 0, 0.0

    def arrive(now: float) -> int:
        """Add the arrivals due by ``now``; how many."""
        nonlocal sent
        before = sent
        while sent < len(order) and order[sent].at <= now:
            a = order[sent]
            prompt = [rng.randrange(100, vocab) for _ in range(prompt_len)]
            rid = engine.add_request(prompt, params, adapter=a.adapter, tenant=a.tenant)
            pending[rid] = (a, engine.requests[rid], now)
            sent += 1
        return sent - before

    def record(outs: list[RequestOutput], t: float) -> None:
        nonlocal awaited
        for o in outs:
            if o.request_id not in first and o.token_ids:
                first[o.request_id] = t
            if o.finished and o.request_id in pending:
                a, seq, added = pending.pop(o.request_id)
                admit = admitted.pop(o.request_id, added)
                first_token = first.get(o.request_id, t)
                out.records.append(Record(
                    a, seq.arrival_tier, admit - added, first_token - a.at, len(o.token_ids),
                    lag=added - a.at, first_steps=first_token - admit, preemptions=seq.num_preemptions,
                    request_id=o.request_id, latency=t - a.at,
                ))  # fmt: skip
                if until is not None and until(a):
                    awaited -= 1
                bar.update()

    def between_layers() -> None:
        """As the server's engine loop does (``AsyncEngine._between_layers``): arrivals join in
        the middle of a step, and the engine may run those of tenants below their share at once.
        Wall clock only: the step clock stands still inside a step."""
        now = time.monotonic() - start
        if step_clock is not None or not arrive(now):
            return
        outs = engine.interject()
        note_admissions(now)
        record(outs, time.monotonic() - start)

    def note_admissions(now: float) -> None:
        """On the wall clock, when the scheduler admitted it; on the step clock, ``now``."""
        for rid, (_, seq, _) in pending.items():
            if rid not in admitted and seq.first_scheduled_time is not None:
                admitted[rid] = now if step_clock is not None else seq.first_scheduled_time - start

    engine.between_layers = between_layers
    try:
        while sent < len(order) or engine.has_unfinished():
            if until is not None and awaited == 0:
                break
            now = clock if step_clock is not None else time.monotonic() - start
            arrive(now)
            began = time.monotonic()
            outs = engine.step()
            if step_clock is not None:
                clock += step_clock if engine.ran else time.monotonic() - began
            t = clock if step_clock is not None else time.monotonic() - start
            if engine.ran:
                out.step_seconds.append(time.monotonic() - began)
                out.tokens_per_step.append(len(outs))
            note_admissions(now)
            record(outs, t)
            if after_step is not None:
                after_step(engine, outs)
            if not outs and not engine.has_unfinished() and sent < len(order):
                if step_clock is not None:
                    clock = max(clock, order[sent].at)  # nothing to run until the next arrival
                else:
                    time.sleep(max(0.0, min(0.01, order[sent].at - (time.monotonic() - start))))
    finally:
        engine.between_layers = None
    out.wall = clock if step_clock is not None else time.monotonic() - start
    for rid in list(pending):
        engine.abort(rid)
        out.aborted += 1
    bar.close()
    return out


def poisson_arrivals(weights: dict[str | None, float], count: int, rate: float, *, seed: int = 11) -> list[Arrival]:
    """``count`` arrivals at ``rate`` per second (exponential gaps), each adapter drawn with its
    weight; the tenant is the adapter's name (the base's requests go out as tenant ``base``)."""
    rng = random.Random(seed)
    names, w = list(weights), list(weights.values())
    at, out = 0.0, []
    for _ in range(count):
        at += rng.expovariate(rate)
        name = rng.choices(names, w)[0]
        out.append(Arrival(at, name, name or "base"))
    return out


def capacity(engine: LLMEngine, burst: list[Arrival], *, prompt_len: int, out_len: int) -> float:
    """Requests per second ``engine`` sustains on this machine: ``burst`` (all arriving at once,
    several batches' worth) replayed closed; generated tokens per second over the output length.
    The benches offer load relative to it, so a slower machine is not simply overloaded."""
    run = replay(engine, burst, prompt_len=prompt_len, out_len=out_len, label="capacity")
    return sum(r.tokens for r in run.records) / run.wall / out_len


def usable_cpus() -> int:
    """The CPUs this process may run on: a container's cpuset or ``taskset`` limits them while
    ``os.cpu_count()`` still counts the machine's, and torch threads beyond them only contend."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine(dtype: torch.dtype) -> str:
    """The CPU (as /proc/cpuinfo names it; ``platform.processor()`` is empty on Linux), the CPUs usable,
    torch and its threads, and the engine's dtype: printed beside every figure."""
    cpu = platform.processor() or platform.machine()
    info = "/proc/cpuinfo"
    if os.path.exists(info):
        with open(info) as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    name = str(dtype).removeprefix("torch.")
    cpus = usable_cpus()
    cpus_line = f"{cpus} CPUs" if cpus == os.cpu_count() else f"{cpus} of {os.cpu_count()} CPUs"
    return f"{cpu}, {cpus_line}, torch {torch.__version__} ({torch.get_num_threads()} threads), {name}"
