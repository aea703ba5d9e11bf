"""Request traces: the seeded Zipf generator and readers for recorded CSV/JSONL traces.

The default generator is bit-compatible with the seed lesson's TypeScript simulator (a 32-bit LCG
seeded with 11, Zipf weights summed in index order, binary search over the cumulative table), so
its figures can be checked against the published table digit for digit.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from loraplane.sim.table_rows import csv_rows, validate_row

LCG_MULTIPLIER = 1664525
LCG_INCREMENT = 1013904223
DEFAULT_SEED = 11


@dataclass(frozen=True)
class Trace:
    """A request stream. ``adapters[i]`` indexes ``names``; the other lists are per request."""

    adapters: list[int]
    names: list[str]
    timestamps: list[float]
    tenants: list[str]
    tokens: list[int]

    def __len__(self) -> int:
        return len(self.adapters)

    def request_counts(self) -> list[int]:
        counts = [0] * len(self.names)
        for a in self.adapters:
            counts[a] += 1
        return counts

    def hottest(self, k: int) -> list[int]:
        """The ``k`` most requested adapters, as an auto-pinner reading request rates would pick them."""
        counts = self.request_counts()
        return sorted(range(len(counts)), key=lambda a: (-counts[a], a))[:k]


def lcg_uniform(seed: int = DEFAULT_SEED) -> Iterator[float]:
    """Uniforms in [0, 1) from ``s = (s * 1664525 + 1013904223) mod 2**32``, returning ``s / 2**32``."""
    s = seed % 2**32
    while True:
        s = (s * LCG_MULTIPLIER + LCG_INCREMENT) % 2**32
        yield s / 2**32


def cumulative(weights: Sequence[float]) -> list[float]:
    """Normalised cumulative table, summed left to right exactly as the reference does."""
    total = 0.0
    for w in weights:
        total += w
    if not total > 0:
        raise ValueError("weights must sum to a positive number")
    cdf: list[float] = []
    acc = 0.0
    for w in weights:
        acc = acc + w / total
        cdf.append(acc)
    return cdf


def zipf_weights(num_adapters: int, exponent: float) -> list[float]:
    return [1 / (i + 1) ** exponent for i in range(num_adapters)]


def sample_index(cdf: Sequence[float], u: float) -> int:
    """First index whose cumulative value is not below ``u`` (the reference's binary search)."""
    lo, hi = 0, len(cdf) - 1
    while lo < hi:
        mid = (lo + hi) >> 1
        if cdf[mid] < u:
            lo = mid + 1
        else:
            hi = mid
    return lo


def weighted_trace(
    weights: Sequence[float],
    names: Sequence[str],
    num_requests: int,
    *,
    seed: int = DEFAULT_SEED,
    rate_rps: float = 100.0,
    tokens: int = 256,
    tenants: Sequence[str] | None = None,
) -> Trace:
    """Draw ``num_requests`` adapters with the given weights; arrivals are Poisson at ``rate_rps``.

    Arrival times come from their own seeded generator so the adapter sequence stays identical
    to the reference whatever the rate.
    """
    if len(weights) != len(names) or not names:
        raise ValueError("weights and names must be non-empty and of equal length")
    if num_requests < 0 or rate_rps <= 0:
        raise ValueError("num_requests must be >= 0 and rate_rps > 0")
    cdf = cumulative(weights)
    draw = lcg_uniform(seed)
    adapters = [sample_index(cdf, next(draw)) for _ in range(num_requests)]
    arrivals = random.Random(seed)
    t = 0.0
    timestamps = []
    for _ in range(num_requests):
        t += arrivals.expovariate(rate_rps)
        timestamps.append(t)
    owner = list(tenants) if tenants is not None else [f"tenant-{i % 10}" for i in range(len(names))]
    return Trace(adapters, list(names), timestamps, [owner[a] for a in adapters], [tokens] * num_requests)


def zipf_trace(
    num_adapters: int = 500,
    num_requests: int = 50_000,
    exponent: float = 1.1,
    *,
    seed: int = DEFAULT_SEED,
    rate_rps: float = 100.0,
    tokens: int = 256,
) -> Trace:
    names = [f"adapter-{i:04d}" for i in range(num_adapters)]
    return weighted_trace(zipf_weights(num_adapters, exponent), names, num_requests, seed=seed, rate_rps=rate_rps, tokens=tokens)


class TraceFormatError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


class TraceRecord(BaseModel):
    """One request in a recorded trace (a row of the CSV or a line of the JSONL)."""

    model_config = ConfigDict(extra="forbid")

    timestamp: float = Field(ge=0, description="seconds since the start of the trace")
    adapter: str = Field(min_length=1, description="adapter name; empty string is not allowed")
    tenant: str = Field(default="default", min_length=1)
    tokens: int = Field(default=0, ge=0, description="prompt plus completion tokens")


def _rows(path: Path) -> Iterator[tuple[int, dict[str, object]]]:
    suffix = path.suffix.lower()
    with path.open(newline="", encoding="utf-8") as fh:
        if suffix == ".csv":
            if not fh.readline().strip():
                raise TraceFormatError(f"{path}:1: empty file, expected a header 'timestamp,adapter,tenant,tokens'")
            fh.seek(0)
            yield from csv_rows(path, fh, TraceFormatError)
        elif suffix in (".jsonl", ".ndjson"):
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceFormatError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
                if not isinstance(obj, dict):
                    raise TraceFormatError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
                yield lineno, obj
        else:
            raise TraceFormatError(f"{path}: unknown trace format {suffix!r}; use .csv or .jsonl")


def load_trace(path: str | Path) -> Trace:
    """Read a recorded trace; requests are replayed in timestamp order (stable for ties)."""
    path = Path(path)
    if not path.is_file():
        raise TraceFormatError(f"{path}: no such file")
    records = [validate_row(TraceRecord, row, f"{path}:{lineno}", TraceFormatError) for lineno, row in _rows(path)]
    if not records:
        raise TraceFormatError(f"{path}: no requests in trace")
    records.sort(key=lambda r: r.timestamp)
    index: dict[str, int] = {}
    adapters = [index.setdefault(r.adapter, len(index)) for r in records]
    return Trace(
        adapters,
        list(index),
        [r.timestamp for r in records],
        [r.tenant for r in records],
        [r.tokens for r in records],
    )
