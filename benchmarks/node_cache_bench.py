"""What a node cache saves: object-store reads and first-token latency after a pod restart, and how
much of a Zipf trace a node cache sized to the working set answers.

Run: python benchmarks/node_cache_bench.py  (about 4 minutes on 2 CPU cores)

A real S3-compatible server on loopback (moto) behind a TCP proxy that counts the bytes it sends,
the node agent (`loraplane node-agent`) as a real process, and the embedded base with synthetic
PEFT adapters (bfloat16 files). Printed side by side:

1. restart: a new serving pod (a rollout, a reschedule, a scale-up: its own cache is a fresh
   emptyDir) serves its first request for an adapter. Time to first token and object-store bytes
   read by that pod's load, with no node cache (the pod fetches from the store) against a node
   cache that holds the adapter (the operator staged it), alternating, a different adapter each
   round; medians.
2. Zipf 1.1 over 500 adapters (the seed's rank mix): each request's adapter read through the node
   agent, as pods whose host tier does not hold it read it, with the node cache bounded to the
   whole fleet's bytes, the working set's (95% of requests) and half of that. Node hit rate,
   objects fetched, refetches (fetches beyond each adapter's first) and bytes read from the store.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import torch
from tqdm import tqdm

from loraplane.adapter_format import adapter_digest
from loraplane.serving.config import EngineConfig
from loraplane.serving.engine.builder import build_engine
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.lora.entries import AdapterSpec
from loraplane.serving.lora.synthetic import PEFT_DEFAULT, seed_ranks, write_adapter
from loraplane.sim.trace import zipf_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
from flaky_proxy import flaky_proxy
from node_agent_process import TOKEN, node_agent
from s3_server import ACCESS, SECRET, moto_server, upload_folder

PROMPT = list(range(10, 42))


def pod(base, scratch: Path, agent: str | None, node: Path | None, endpoint: str):  # type: ignore[no-untyped-def]
    """A new serving pod: the base already converted (``base``, the probe's checkpoint), a fresh cache of its own."""
    settings: dict[str, object] = {"model": str(base.folder), "base_name": base.shape.name, "cache_dir": scratch,
                                   "max_loras": 2, "max_lora_rank": 64, "s3_endpoint": endpoint}  # fmt: skip
    if agent is not None:
        settings.update(node_cache_url=agent, node_cache_dir=node)
    return build_engine(EngineConfig(**settings))  # type: ignore[arg-type]


def first_token_seconds(engine, name: str, uri: str, digest: str) -> float:  # type: ignore[no-untyped-def]
    engine.register_lora(AdapterSpec(name, uri, digest=digest))
    start = time.perf_counter()
    (out,) = engine.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0), [name])
    assert out.error is None, out.error
    return time.perf_counter() - start


def restarts(args: argparse.Namespace, work: Path, base, endpoint: str) -> None:  # type: ignore[no-untyped-def]
    base_shape = base.shape
    folders = {
        f"r16-{i}": write_adapter(work / "restart" / f"r16-{i}", base_shape, 16, seed=100 + i, dtype=torch.bfloat16)
        for i in range(2 * args.rounds)
    }
    uris = {n: upload_folder(endpoint, "adapters", f"restart/{n}", f) for n, f in folders.items()}
    digests = {n: adapter_digest(f) for n, f in folders.items()}
    size = (next(iter(folders.values())) / "adapter_model.safetensors").stat().st_size
    with flaky_proxy(endpoint) as proxy, node_agent(work / "node", proxy.url) as agent:
        staged = [{"source": uris[n], "digest": digests[n]} for n in folders]
        httpx.put(f"{agent}/v1/staging", json={"adapters": staged}, headers={"Authorization": f"Bearer {TOKEN}"})
        deadline = time.monotonic() + 120
        while not all(
            s["cached"] for s in httpx.get(f"{agent}/v1/state", headers={"Authorization": f"Bearer {TOKEN}"}).json()["staged"]
        ):
            assert time.monotonic() < deadline, "staging did not finish"
            time.sleep(0.5)
        os.environ["LORAPLANE_ADMIN_TOKEN"] = TOKEN
        figures: dict[str, tuple[list[float], list[int]]] = {"no node cache": ([], []), "node cache": ([], [])}
        names = list(folders)
        for r in tqdm(range(args.rounds), desc="restarts", leave=False):
            order = ["no node cache", "node cache"] if r % 2 == 0 else ["node cache", "no node cache"]
            for k, contender in enumerate(order):
                name = names[2 * r + k]
                engine = pod(base, work / f"pod-{r}-{k}", agent if contender == "node cache" else None, work / "node", proxy.url)
                before = proxy.bytes_from_target
                seconds = first_token_seconds(engine, name, uris[name], digests[name])
                figures[contender][0].append(seconds)
                figures[contender][1].append(proxy.bytes_from_target - before)
                engine.adapters.close()  # its loader pool and, with a node cache, its figures thread
    print(
        f"\n1. first request after a pod restart, rank-16 adapters of {size / 2**20:.1f} MiB, {args.rounds} rounds each (medians)"
    )
    print(f"{'':16}{'TTFT ms':>10}{'store bytes read':>20}")
    for contender, (seconds, read) in figures.items():
        print(f"{contender:16}{1e3 * statistics.median(seconds):>10.1f}{statistics.median(read):>20,.0f}")
    ratio = statistics.median(figures["node cache"][0]) / statistics.median(figures["no node cache"][0])
    print(f"node cache TTFT / no node cache TTFT: {ratio:.2f}x")


def zipf(args: argparse.Namespace, work: Path, base_shape, endpoint: str) -> None:  # type: ignore[no-untyped-def]
    ranks = seed_ranks(args.adapters)
    folders = {
        f"adapter-{i:04d}": write_adapter(
            work / "zipf" / f"adapter-{i:04d}", base_shape, r, PEFT_DEFAULT, seed=i, dtype=torch.bfloat16
        )
        for i, r in enumerate(tqdm(ranks, desc="write adapters", leave=False))
    }
    uris = {n: upload_folder(endpoint, "adapters", f"zipf/{n}", f) for n, f in tqdm(folders.items(), desc="upload", leave=False)}
    digests = {n: adapter_digest(f) for n, f in folders.items()}
    sizes = {n: sum(p.stat().st_size for p in f.iterdir()) for n, f in folders.items()}
    trace = zipf_trace(args.adapters, args.requests, 1.1)
    names = [trace.names[a] for a in trace.adapters]
    counts = Counter(names)
    covered, working = 0, []
    for name, n in counts.most_common():
        if covered >= 0.95 * len(names):
            break
        working.append(name)
        covered += n
    working_bytes, total = sum(sizes[n] for n in working), sum(sizes.values())
    print(
        f"\n2. Zipf 1.1 over {args.adapters} adapters, {args.requests} reads through the node agent; working set (95% of"
        f" requests) {len(working)} adapters, {working_bytes / 2**20:.0f} MiB; all {total / 2**20:.0f} MiB"
    )
    distinct = len(counts)
    print(f"{distinct} distinct adapters requested: that many first fetches are unavoidable; refetches are the bound's cost")
    print(f"{'node cache bound':24}{'node hit rate':>15}{'fetches':>10}{'refetches':>11}{'store MiB read':>16}")
    for label, bound in (("whole fleet", total), ("working set", working_bytes), ("half the working set", working_bytes // 2)):
        with flaky_proxy(endpoint) as proxy, node_agent(work / f"node-{bound}", proxy.url, "--max-bytes", str(bound)) as agent:
            auth = {"Authorization": f"Bearer {TOKEN}"}
            with httpx.Client(headers=auth, timeout=120) as http:
                for name in tqdm(names, desc=label, leave=False):
                    got = http.post(f"{agent}/v1/acquire", json={"source": uris[name], "digest": digests[name]})
                    got.raise_for_status()
                    http.post(f"{agent}/v1/release", json={"lease": got.json()["lease"]})
                state = http.get(f"{agent}/v1/state").json()
            reads = state["hits"] + state["misses"]
            refetches = state["misses"] - distinct
            mib = proxy.bytes_from_target / 2**20
            print(f"{label:24}{state['hits'] / reads:>15.1%}{state['misses']:>10}{refetches:>11}{mib:>16.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--adapters", type=int, default=500)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--skip", nargs="*", default=[], choices=["restart", "zipf"])
    args = parser.parse_args()
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET, AWS_REGION="us-east-1")
    work = Path(tempfile.mkdtemp(prefix="node-cache-bench-"))
    probe = build_engine(EngineConfig(cache_dir=work / "probe", max_loras=1))
    base = probe.base
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    print(f"embedded {base.shape.name}, dtype {probe.dtype}, CPU {cpu}, torch threads {torch.get_num_threads()}")
    del probe
    try:
        with moto_server() as endpoint:
            if "restart" not in args.skip:
                restarts(args, work, base, endpoint)
            if "zipf" not in args.skip:
                zipf(args, work, base.shape, endpoint)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
