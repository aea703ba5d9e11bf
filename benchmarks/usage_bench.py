"""The usage spool's cost on the request path, spool on against off, side by side in one run,
alternated round by round (this machine's speed drifts), medians quoted.

1. The record path alone: ``--concurrency`` coroutines on one event loop settle records the way a
   handler does (build the record, await its acknowledgement). Off, the call only updates the
   rollup; on, the writer thread batches, writes and fsyncs every ``--fsync-interval`` seconds.
2. Served requests (``--server``): two ``loraplane serve`` child processes on the embedded base,
   one with ``--usage-dir``, one without, each sent the same rounds of short completions
   (``max_tokens`` 1, the case where a per-request cost shows most) through the official client.

    python benchmarks/usage_bench.py [--rounds 5] [--requests 2000] [--concurrency 64] [--server]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import tempfile
import time
from pathlib import Path

from loraplane.usage import Metering, Outcome, UsageRecord


async def drive(metering: Metering, requests: int, concurrency: int) -> tuple[float, list[float]]:
    latencies: list[float] = []

    async def worker(w: int) -> None:
        for i in range(requests // concurrency):
            record = UsageRecord(request_id=f"cmpl-{w}-{i}", tenant=f"t{w % 4}", adapter=f"a{i % 50}", prompt_tokens=120,
                                 completion_tokens=64, outcome=Outcome.COMPLETED)  # fmt: skip
            start = time.perf_counter()
            await metering.record(record)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return len(latencies) / (time.perf_counter() - start), latencies


def one_round(spool: bool, args: argparse.Namespace, root: Path) -> tuple[float, float, float]:
    folder = root / f"spool-{time.monotonic_ns()}" if spool else None
    metering = Metering.create("bench", folder, fsync_interval=args.fsync_interval)
    try:
        rate, lat = asyncio.run(drive(metering, args.requests, args.concurrency))
    finally:
        metering.close()
    lat.sort()
    return rate, lat[len(lat) // 2] * 1e6, lat[int(len(lat) * 0.99)] * 1e6


def served(args: argparse.Namespace) -> None:
    """Requests/s of the two servers, alternated."""
    from contextlib import ExitStack

    import openai

    from loraplane.serving.bench.deployment import spawn_server
    from loraplane.serving.config import EngineConfig

    config = EngineConfig(model="embedded", max_model_len=512)
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        urls = {
            False: stack.enter_context(spawn_server(config, {}, [])).url,
            True: stack.enter_context(spawn_server(config, {}, [], server_args=["--usage-dir", tmp])).url,
        }
        rates: dict[bool, list[float]] = {False: [], True: []}

        async def round_of(url: str) -> float:
            api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            model = (await api.models.list()).data[0].id
            sem = asyncio.Semaphore(8)

            async def one(i: int) -> None:
                async with sem:
                    await api.completions.create(model=model, prompt=f"request {i}", max_tokens=1)

            start = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(args.server_requests)))
            rate = args.server_requests / (time.perf_counter() - start)
            await api.close()  # before asyncio.run closes the loop its connections live on
            return rate

        for r in range(args.rounds + 1):
            for spool in (False, True) if r % 2 else (True, False):
                rate = asyncio.run(round_of(urls[spool]))
                if r:  # the first round warms both up
                    rates[spool].append(rate)
        print("| server | requests/s (median) | rounds |")
        print("| --- | --- | --- |")
        for spool, values in rates.items():
            each = ", ".join(f"{v:.1f}" for v in values)
            print(f"| spool {'on' if spool else 'off'} | {statistics.median(values):.1f} | {each} |")
        print(f"on/off: {statistics.median(rates[True]) / statistics.median(rates[False]):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--fsync-interval", type=float, default=1.0)
    parser.add_argument("--server", action="store_true", help="also measure served requests (two child servers)")
    parser.add_argument("--server-requests", type=int, default=48)
    args = parser.parse_args()
    print(f"cpu: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    results: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for spool in (False, True):  # alternate: this machine's speed drifts
                results[spool].append(one_round(spool, args, Path(tmp)))
    print("| spool | records/s (median) | awaited p50 | awaited p99 |")
    print("| --- | --- | --- | --- |")
    for spool, rows in results.items():
        rate, p50, p99 = (statistics.median(r[i] for r in rows) for i in range(3))
        print(f"| {'on' if spool else 'off'} | {rate:,.0f} | {p50:.0f} µs | {p99:.0f} µs |")
    off, on = (statistics.median(r[1] for r in results[s]) for s in (False, True))
    print(f"added latency per request (median): {on - off:.0f} µs")
    if args.server:
        served(args)


if __name__ == "__main__":
    main()
