"""The event loop's cost of streaming ``tool_choice: "required"``: the calls a chunk completes,
read by one ``CallStream`` per choice (each character once) against reading the whole answer so
far again at every chunk (what the stream did before, and what any stateless reading does),
alternated round by round (this machine's speed drifts), medians quoted. That time is spent on
the server's event loop, where every other tenant's stream waits while it runs.

    python benchmarks/tool_stream_bench.py [--rounds 5] [--chars-per-chunk 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from loraplane.serving.api.openai.tools.calls import CallStream, whole_calls
from loraplane.serving.bench.engine_replay import machine


def answer(calls: int) -> str:
    """A ``"required"`` answer of ``calls`` calls, each about 280 characters of arguments."""
    return json.dumps([
        {"name": "get_weather", "parameters": {"city": "paris", "notes": "sunny and {warm} " * 16, "days": i}}
        for i in range(calls)
    ])  # fmt: skip


def rescanned(text: str, step: int) -> tuple[float, int]:
    start, seen = time.perf_counter(), 0
    for i in range(step, len(text) + step, step):
        now, _ = whole_calls(text[:i])
        seen = len(now)
    return time.perf_counter() - start, seen


def streamed(text: str, step: int) -> tuple[float, int]:
    start, stream, seen = time.perf_counter(), CallStream(), 0
    for i in range(0, len(text), step):
        seen += len(stream.feed(text[i : i + step]))
    return time.perf_counter() - start, seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chars-per-chunk", type=int, default=4, help="about one token's text")
    args = parser.parse_args()
    print(machine(torch.float32).rsplit(", ", 1)[0])  # no model runs: the dtype says nothing here
    print(f"{'calls':>5} {'chars':>7} {'chunks':>7} {'rescanned ms':>13} {'CallStream ms':>14} {'ratio':>7}")
    for calls in (4, 16, 64):
        text = answer(calls)
        times: dict[str, list[float]] = {"rescanned": [], "streamed": []}
        for _ in range(args.rounds):
            for name, read in (("rescanned", rescanned), ("streamed", streamed)):
                seconds, seen = read(text, args.chars_per_chunk)
                assert seen == calls, (name, seen)
                times[name].append(seconds * 1000)
        old, new = statistics.median(times["rescanned"]), statistics.median(times["streamed"])
        chunks = -(-len(text) // args.chars_per_chunk)
        print(f"{calls:>5} {len(text):>7} {chunks:>7} {old:>13.1f} {new:>14.2f} {old / new:>6.0f}x")


if __name__ == "__main__":
    main()
