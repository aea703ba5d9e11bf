"""The usage spool's cost on the request path, side by side in one run: requests served through the
real FastAPI app and the tiny-model-free path that matters here (the handler's ``await
metering.record``), with the spool on and off, alternated, medians quoted.

Each round drives ``--concurrency`` coroutines that each settle ``--requests`` records the way a
handler does (build the record, await its acknowledgement), on one event loop, and reports
records/s and the awaited latency. With the spool off the call only updates the rollup; with it
on the writer thread batches, writes and fsyncs every ``--fsync-interval`` seconds.

    python benchmarks/usage_bench.py [--rounds 5] [--requests 2000] [--concurrency 64]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--fsync-interval", type=float, default=1.0)
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


if __name__ == "__main__":
    main()
