"""Replay timed arrivals straight into an engine (no HTTP), stepping it meanwhile.

The engine benchmarks (tiers, placement) measure the engine's own scheduling and placement, so
they drive :class:`LLMEngine` in-process: arrivals are added when their time comes, the engine
steps between them, and each request's time to first token is taken from the step that produced
it. Open loop, as a load generator should be: a slow engine does not slow the arrivals down.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from tqdm import tqdm

from loraplane.serving.engine.llm_engine import LLMEngine
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


def replay(
    engine: LLMEngine, arrivals: list[Arrival], *, prompt_len: int, out_len: int, label: str = "replay", seed: int = 1
) -> tuple[list[Record], float]:
    """Send each arrival at its time (random prompts of ``prompt_len`` tokens, ``out_len`` greedy
    tokens each); returns the finished requests' records and the wall time to the last token."""
    rng = random.Random(seed)
    vocab = engine.base.config.vocab_size
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    pending: dict[str, tuple[Arrival, Sequence]] = {}
    first: dict[str, float] = {}
    records: list[Record] = []
    order = sorted(arrivals, key=lambda a: a.at)
    bar = tqdm(total=len(order), desc=label, unit="req", leave=False)
    start, sent = time.monotonic(), 0
    while sent < len(order) or engine.has_unfinished():
        now = time.monotonic() - start
        while sent < len(order) and order[sent].at <= now:
            a = order[sent]
            prompt = [rng.randrange(100, vocab) for _ in range(prompt_len)]
            rid = engine.add_request(prompt, params, adapter=a.adapter, tenant=a.tenant)
            pending[rid] = (a, engine.requests[rid])
            sent += 1
        outs = engine.step()
        t = time.monotonic() - start
        for out in outs:
            if out.request_id not in first and out.token_ids:
                first[out.request_id] = t
            if out.finished and out.request_id in pending:
                a, seq = pending.pop(out.request_id)
                wait = (seq.first_scheduled_time or seq.arrival_time) - seq.arrival_time
                records.append(Record(a, seq.arrival_tier, wait, first.get(out.request_id, t) - a.at, len(out.token_ids)))
                bar.update()
        if not outs and not engine.has_unfinished() and sent < len(order):
            time.sleep(max(0.0, min(0.01, order[sent].at - (time.monotonic() - start))))
    bar.close()
    return records, time.monotonic() - start


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
