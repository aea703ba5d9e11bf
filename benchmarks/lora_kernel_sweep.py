"""Launch-shape sweep of the LoRA kernels on one GPU: which tile sizes, warps and split of the
shrink's reduction the launchers in ``kernels/bgmv.py`` and ``kernels/sgmv.py`` should use.

Each candidate sets the launcher's module constants, is checked against a float32 torch product
(a candidate that answers wrong is dropped), then timed from CUDA graph replays at every shape:
BGMV at batch 1/16/64/256 x ranks 8/16/64 (every row its own adapter, hidden 4096), SGMV at 2048
and 512 tokens in 8 segments x ranks 16/64. The winner minimises the geometric mean of its time
over the best candidate's at each shape; the current constants are printed beside it. The sweep
changes nothing on disk: copy the winners into the launchers and rerun ``gpu_check.py``.

Run:
  python benchmarks/lora_kernel_sweep.py                  # on a GPU, about 2 minutes on an H200
  python benchmarks/lora_kernel_sweep.py --device cpu     # toy shapes in Triton's interpreter: the logic, not speed
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

Case = tuple[Callable[[], None], Callable[[], float]]  # (run it once, its relative error)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds; kernels left when it runs out keep their constants")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported
    import torch

    from loraplane.kernels import bgmv, sgmv

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("lora_kernel_sweep: no CUDA device (use --device cpu for the interpreter's check of the logic)", file=sys.stderr)
        return 2
    dev, dt = args.device, torch.bfloat16 if cuda else torch.float32
    k_dim, n_dim, num_slots, max_rank = (4096, 4096, 256, 64) if cuda else (512, 256, 8, 16)
    torch.manual_seed(0)
    lora_a = (torch.randn(num_slots, max_rank, k_dim, device=dev) / 64).to(dt)
    lora_b = (torch.randn(num_slots, max_rank, n_dim, device=dev) / 8).to(dt)
    scalings = torch.full((num_slots,), 2.0, device=dev)
    deadline = time.perf_counter() + args.budget

    def bench(fn: Callable[[], None]) -> float:
        """Microseconds per run: CUDA graph replays on a GPU, one host-timed run in the interpreter."""
        if not cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        from triton.testing import do_bench_cudagraph

        return float(do_bench_cudagraph(fn, rep=8)) * 1e3

    def rel(got: Any, want: Any) -> float:
        return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))

    def ranks_of(rank: int) -> Any:
        return torch.full((num_slots,), min(rank, max_rank), dtype=torch.int32, device=dev)

    def segments(tokens: int) -> tuple[Any, Any, int, Any]:
        seg_len = tokens // 8
        starts = torch.arange(0, tokens + 1, seg_len, dtype=torch.int32, device=dev)
        slots = torch.arange(8, dtype=torch.int32, device=dev)
        return starts, slots, seg_len, torch.repeat_interleave(slots.long(), seg_len)

    def bgmv_shrink(batch: int, rank: int) -> Case:
        rank = min(rank, max_rank)
        rows = torch.arange(batch, dtype=torch.int32, device=dev) % num_slots
        x = torch.randn(batch, k_dim, device=dev).to(dt)
        out = torch.zeros(batch, max_rank, device=dev)
        want = torch.einsum("tk,trk->tr", x.float(), lora_a[rows.long(), :rank].float())
        return lambda: bgmv.bgmv_shrink(x, lora_a, ranks_of(rank), rows, out), lambda: rel(out[:, :rank], want)

    def bgmv_expand(batch: int, rank: int) -> Case:
        rank = min(rank, max_rank)
        rows = torch.arange(batch, dtype=torch.int32, device=dev) % num_slots
        buf = torch.randn(batch, max_rank, device=dev)
        y0 = torch.randn(batch, n_dim, device=dev).to(dt)
        y = y0.clone()
        delta = 2.0 * torch.einsum("tr,trn->tn", buf[:, :rank], lora_b[rows.long(), :rank].float())
        ranks = ranks_of(rank)

        def run() -> None:
            y.copy_(y0)
            bgmv.bgmv_expand(y, buf, lora_b, ranks, scalings, rows, 0)

        return run, lambda: rel(y.float() - y0.float(), delta)

    def sgmv_shrink(tokens: int, rank: int) -> Case:
        rank = min(rank, max_rank)
        starts, slots, seg_len, rows = segments(tokens)
        x = torch.randn(tokens, k_dim, device=dev).to(dt)
        out = torch.zeros(tokens, max_rank, device=dev)
        want = torch.einsum("tk,trk->tr", x.float(), lora_a[rows, :rank].float())
        ranks = ranks_of(rank)
        return lambda: sgmv.sgmv_shrink(x, lora_a, ranks, starts, slots, out, seg_len), lambda: rel(out[:, :rank], want)

    def sgmv_expand(tokens: int, rank: int) -> Case:
        rank = min(rank, max_rank)
        starts, slots, seg_len, rows = segments(tokens)
        buf = torch.randn(tokens, max_rank, device=dev)
        y0 = torch.randn(tokens, n_dim, device=dev).to(dt)
        y = y0.clone()
        delta = 2.0 * torch.einsum("tr,trn->tn", buf[:, :rank], lora_b[rows, :rank].float())
        ranks = ranks_of(rank)

        def run() -> None:
            y.copy_(y0)
            sgmv.sgmv_expand(y, buf, lora_b, ranks, scalings, starts, slots, 0, seg_len)

        return run, lambda: rel(y.float() - y0.float(), delta)

    def sweep(
        name: str, module: ModuleType, knobs: tuple[str, ...], candidates: list[tuple[int, ...]],
        shapes: list[tuple[int, int]], make: Callable[[int, int], Case],
    ) -> None:  # fmt: skip
        current = tuple(getattr(module, k) for k in knobs)
        if current not in candidates:
            candidates = [current, *candidates]
        cases = {shape: make(*shape) for shape in shapes}
        times: dict[tuple[int, ...], list[float]] = {}
        for values in candidates:
            if time.perf_counter() > deadline:
                print(f"{name}: --budget spent after {len(times)} of {len(candidates)} candidates")
                break
            for knob, value in zip(knobs, values, strict=True):
                setattr(module, knob, value)
            try:
                row = []
                for shape, (run, error) in cases.items():
                    run()
                    if cuda:
                        torch.cuda.synchronize()
                    if error() > 2e-2:
                        raise AssertionError(f"wrong at {shape}: relative error {error():.3g}")
                    row.append(bench(run))
            except Exception as err:  # a candidate that fails to compile or answers wrong is dropped
                print(f"{name} {dict(zip(knobs, values, strict=True))}: dropped ({type(err).__name__}: {str(err)[:160]})")
                continue
            times[values] = row
        for knob, value in zip(knobs, current, strict=True):
            setattr(module, knob, value)
        if not times:
            return
        best = [min(row[i] for row in times.values()) for i in range(len(shapes))]
        score = {
            v: math.exp(statistics.mean(math.log(t / b) for t, b in zip(row, best, strict=True))) for v, row in times.items()
        }
        winner = min(score, key=lambda v: score[v])
        print(f"\n{name}: shapes {shapes}, microseconds")
        for values, row in sorted(times.items(), key=lambda item: score[item[0]]):
            mark = " <- winner" if values == winner else " <- current" if values == current else ""
            print(f"  {dict(zip(knobs, values, strict=True))}: {' '.join(f'{t:.1f}' for t in row)}  x{score[values]:.2f}{mark}")
        print(f"  best per shape: {' '.join(f'{t:.1f}' for t in best)}", flush=True)

    decode = [(b, r) for r in (8, 16, 64) for b in (1, 16, 64, 256)] if cuda else [(1, 8), (4, 16)]
    prefill = [(2048, 16), (2048, 64), (512, 16)] if cuda else [(64, 8), (32, 16)]
    print(f"{torch.cuda.get_device_name() if cuda else 'CPU, Triton interpreter'}; torch {torch.__version__}, {dt}")
    sweep("BGMV shrink", bgmv, ("SHRINK_BLOCK_K", "SHRINK_PROGRAMS", "SHRINK_WARPS"),
          list(itertools.product((128, 256, 512), (1, 264, 528, 1056), (4, 8))), decode, bgmv_shrink)  # fmt: skip
    sweep("BGMV expand", bgmv, ("EXPAND_BLOCK_N", "EXPAND_WARPS"),
          list(itertools.product((128, 256, 512, 1024), (2, 4, 8))), decode, bgmv_expand)  # fmt: skip
    sweep("SGMV shrink", sgmv, ("SHRINK_BLOCK_M", "SHRINK_BLOCK_K", "SHRINK_PROGRAMS", "SHRINK_WARPS"),
          list(itertools.product((16, 64), (64, 128), (1, 528), (4,))), prefill, sgmv_shrink)  # fmt: skip
    sweep("SGMV expand", sgmv, ("EXPAND_BLOCK_M", "EXPAND_BLOCK_N", "EXPAND_WARPS"),
          list(itertools.product((16, 64), (64, 128, 256), (4, 8))), prefill, sgmv_expand)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
