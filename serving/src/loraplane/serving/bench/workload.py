"""The requests a benchmark sends: a Zipf trace over adapters (the simulator's generator, so a run
can be set beside ``loraplane sim``'s prediction for the same trace) turned into API calls."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from loraplane.sim.trace import Trace, weighted_trace, zipf_weights

# Plain words for synthetic prompts: text rather than token ids, so the same workload runs against
# any server whatever its tokenizer. Roughly one token per word on Llama-family vocabularies.
WORDS = (
    "river",
    "stone",
    "light",
    "garden",
    "paper",
    "window",
    "market",
    "silver",
    "orange",
    "winter",
    "music",
    "engine",
    "harbor",
    "forest",
    "planet",
    "signal",
    "bridge",
    "story",
    "cloud",
    "number",
    "village",
    "ocean",
    "letter",
    "mountain",
    "candle",
    "season",
    "machine",
    "circle",
    "morning",
    "theory",
    "pattern",
    "journey",
    "kitchen",
    "lantern",
    "meadow",
    "",
)


@dataclass(frozen=True)
class BenchRequest:
    """One call: sent ``at`` seconds after the start, as ``tenant`` (None on an open server)."""

    at: float
    model: str
    tenant: str | None
    prompt: str
    max_tokens: int
    chat: bool = False


def bench_trace(
    models: Sequence[str],
    owners: Sequence[str | None],
    num_requests: int,
    *,
    rate: float,
    exponent: float = 1.1,
    seed: int = 11,
    max_tokens: int = 16,
) -> Trace:
    """The simulator's trace behind :func:`zipf_requests` with the same arguments, for
    ``loraplane sim``'s prediction of the very requests a benchmark sends."""
    if len(models) != len(owners):
        raise ValueError("one owner per model")
    weights = zipf_weights(len(models), exponent)
    owner_names = [o or "" for o in owners]
    return weighted_trace(weights, list(models), num_requests, seed=seed, rate_rps=rate, tokens=max_tokens, tenants=owner_names)


def zipf_requests(
    models: Sequence[str],
    owners: Sequence[str | None],
    num_requests: int,
    *,
    rate: float,
    exponent: float = 1.1,
    prompt_words: int = 32,
    max_tokens: int = 16,
    seed: int = 11,
    prompts: Sequence[str] = (),
    chat: bool = False,
) -> list[BenchRequest]:
    """``models[i]`` is drawn with Zipf weight ``1 / (i+1) ** exponent``; arrivals are Poisson at
    ``rate`` per second; each request goes out as its adapter's owner. Prompts are random words,
    or ``prompts`` in turn."""
    trace = bench_trace(models, owners, num_requests, rate=rate, exponent=exponent, seed=seed, max_tokens=max_tokens)
    rng = random.Random(seed)
    return [
        BenchRequest(
            at=trace.timestamps[i],
            model=models[a],
            tenant=owners[a],
            prompt=prompts[i % len(prompts)] if prompts else " ".join(rng.choice(WORDS) for _ in range(prompt_words)),
            max_tokens=max_tokens,
            chat=chat,
        )
        for i, a in enumerate(trace.adapters)
    ]
