"""Gathered low-rank kernels against merging per adapter and against the base matmul alone.

Run: python benchmarks/kernels_bench.py  (about a minute on 2 CPU cores)

Side by side in one run, on whatever device torch sees (CUDA if present, else CPU):
1. the seed lesson's shape: batch 64, width 2048, rank 16, 50 adapters (about 34 distinct in a batch):
   merge-per-adapter, a naive gather (A[ids]), a Python loop over segments, our gathered path,
   and the base matmul alone;
2. the adapter overhead as the number of distinct adapters in the batch grows (1, 8, 34, 64);
3. decode and prefill shapes of the embedded model (SmolLM2-135M, all seven projections);
4. on CUDA only: achieved memory bandwidth of BGMV and TFLOP/s of SGMV.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from loraplane.kernels import LoraSlots, add_lora, bgmv_expand, bgmv_shrink, sgmv_expand, sgmv_shrink
from loraplane.serving.bench.engine_replay import machine


def timed(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Median wall time in ms over ``repeat`` runs after two warm-ups (compiles and caches)."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)


def make_slots(num_slots: int, rank: int, k: int, n: int, device: torch.device, dtype: torch.dtype) -> LoraSlots:
    g = torch.Generator().manual_seed(0)
    slots = LoraSlots.empty(num_slots, rank, k, n, dtype=dtype, device=device)
    slots.lora_a.copy_(torch.randn(num_slots, rank, k, generator=g) * 0.02)
    slots.lora_b.copy_(torch.randn(num_slots, rank, n, generator=g) * 0.02)
    slots.ranks.fill_(rank)
    slots.scalings.fill_(2.0)
    return slots


def seed_shape(device: torch.device, dtype: torch.dtype, repeat: int) -> None:
    batch, d, rank, num_adapters = 64, 2048, 16, 50
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(d, d, generator=g) * 0.02).to(device, dtype)
    x = torch.randn(batch, d, generator=g).to(device, dtype)
    slots = make_slots(num_adapters, rank, d, d, device, dtype)
    ids = torch.randint(0, num_adapters, (batch,), generator=g).to(device, torch.int32)
    a, b_t, scale = slots.lora_a, slots.lora_b, slots.scalings
    distinct = len(set(ids.tolist()))

    def base() -> torch.Tensor:
        return x @ w.T

    def merged() -> torch.Tensor:
        y = torch.empty(batch, d, device=device, dtype=dtype)
        for s in ids.unique().tolist():
            rows = ids == s
            y[rows] = x[rows] @ (w + scale[s] * b_t[s].T @ a[s]).T
        return y

    def naive_gather() -> torch.Tensor:
        longs = ids.long()
        shrink = torch.bmm(a[longs], x.unsqueeze(2))
        return base() + scale[longs, None] * torch.bmm(b_t[longs].transpose(1, 2), shrink).squeeze(2)

    def segment_loop() -> torch.Tensor:
        y = base()
        order = torch.argsort(ids)
        sorted_ids, xs = ids[order], x[order]
        uniq, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
        out, start = torch.empty_like(y), 0
        for s, n in zip(uniq.tolist(), counts.tolist(), strict=True):
            out[start : start + n] = scale[s] * (xs[start : start + n] @ a[s].T) @ b_t[s]
            start += n
        y[order] += out
        return y

    y = base()

    def adapter_only() -> torch.Tensor:
        return add_lora(y, x, slots, row_slots=ids, check=False)

    def gathered() -> torch.Tensor:
        return add_lora(base(), x, slots, row_slots=ids, check=False)

    t_base = timed(base, device, repeat)
    rows = [
        ("merge per adapter", timed(merged, device, repeat)),
        ("naive gather A[ids] + base", timed(naive_gather, device, repeat)),
        ("loop over segments + base", timed(segment_loop, device, repeat)),
        ("gathered (ours) + base", timed(gathered, device, repeat)),
        ("base matmul alone", t_base),
    ]
    t_adapter = timed(adapter_only, device, repeat)
    ref = merged()
    err = (gathered().float() - ref.float()).abs().max().item()
    print(f"\n[1] seed shape: batch {batch}, width {d}, rank {rank}, {num_adapters} adapters ({distinct} distinct), {dtype}")
    print(f"{'path':<30}{'ms':>9}{'x base':>9}")
    for name, ms in rows:
        print(f"{name:<30}{ms:>9.3f}{ms / t_base:>9.2f}")
    t_gathered = rows[3][1]
    print(f"merge-per-adapter / gathered: {rows[0][1] / t_gathered:.1f}x  (target >= 15x)")
    print(
        f"adapter part alone: {t_adapter:.3f} ms = {100 * t_adapter / t_base:.1f}% of the base matmul "
        f"(target <= 15%; FLOPs 2r/d = {200 * rank / d:.1f}%)"
    )
    print(f"max |gathered - merged| = {err:.2e}")

    print("\n[2] adapter overhead against distinct adapters in the batch (64 slots)")
    slots64 = make_slots(64, rank, d, d, device, dtype)
    print(f"{'distinct':>9}{'adapter ms':>12}{'% of base':>11}")
    for k in (1, 8, 34, 64):
        kids = (torch.arange(batch) % k).to(device, torch.int32)

        def part(kids: torch.Tensor = kids) -> torch.Tensor:
            return add_lora(y, x, slots64, row_slots=kids, check=False)

        ms = timed(part, device, repeat)
        print(f"{k:>9}{ms:>12.3f}{100 * ms / t_base:>10.1f}%")


SMOLLM2 = {  # name: (in, out) for SmolLM2-135M: hidden 576, 9 heads x 64, 3 KV heads, MLP 1536
    "q_proj": (576, 576),
    "k_proj": (576, 192),
    "v_proj": (576, 192),
    "o_proj": (576, 576),
    "gate_proj": (576, 1536),
    "up_proj": (576, 1536),
    "down_proj": (1536, 576),
}


def model_shapes(device: torch.device, dtype: torch.dtype, repeat: int) -> None:
    rank, num_adapters = 16, 8
    print(f"\n[3] SmolLM2-135M projections, rank {rank}, {num_adapters} adapters, one layer, {dtype}")
    print(f"{'shape':<34}{'base ms':>9}{'adapter ms':>12}{'overhead':>10}")
    g = torch.Generator().manual_seed(1)
    cases = {
        "decode: 16 sequences (BGMV)": 16,
        "prefill: 16 x 128 tokens (SGMV)": 16 * 128,
    }
    for label, tokens in cases.items():
        total_base = total_adapter = 0.0
        for k, n in SMOLLM2.values():
            w = (torch.randn(n, k, generator=g) * 0.02).to(device, dtype)
            x = torch.randn(tokens, k, generator=g).to(device, dtype)
            slots = make_slots(num_adapters, rank, k, n, device, dtype)
            y = x @ w.T
            if tokens == 16:
                ids = (torch.arange(tokens) % num_adapters).to(device, torch.int32)

                def part(x: torch.Tensor = x, y: torch.Tensor = y, s: LoraSlots = slots, ids: torch.Tensor = ids) -> object:
                    return add_lora(y, x, s, row_slots=ids, check=False)
            else:
                seg_starts = torch.arange(0, tokens + 1, 128, dtype=torch.int32).to(device)
                seg_slots = (torch.arange(16) % num_adapters).to(device, torch.int32)

                def part(
                    x: torch.Tensor = x,
                    y: torch.Tensor = y,
                    s: LoraSlots = slots,
                    st: torch.Tensor = seg_starts,
                    ss: torch.Tensor = seg_slots,
                ) -> object:
                    return add_lora(y, x, s, seg_starts=st, seg_slots=ss, check=False)

            total_base += timed(lambda x=x, w=w: x @ w.T, device, repeat)
            total_adapter += timed(part, device, repeat)
        print(f"{label:<34}{total_base:>9.3f}{total_adapter:>12.3f}{100 * total_adapter / total_base:>9.1f}%")


def gpu_throughput(device: torch.device, repeat: int) -> None:
    """Bytes BGMV must move and FLOPs SGMV must do, over their time, against the device's peak."""
    props = torch.cuda.get_device_properties(device)
    print(f"\n[4] {props.name}")
    dtype, rank, d, num_slots = torch.bfloat16, 16, 4096, 64
    slots = make_slots(num_slots, rank, d, d, device, dtype)
    for batch in (16, 64, 256):
        x = torch.randn(batch, d, device=device, dtype=dtype)
        y = torch.randn(batch, d, device=device, dtype=dtype)
        ids = (torch.arange(batch, device=device) % num_slots).to(torch.int32)
        buf = torch.zeros(batch, rank, device=device, dtype=torch.float32)
        ms_s = timed(
            lambda x=x, ids=ids, buf=buf: bgmv_shrink(x, slots.lora_a, slots.ranks, ids, out=buf, check=False), device, repeat
        )
        ms_e = timed(
            lambda y=y, ids=ids, buf=buf: bgmv_expand(y, buf, slots.lora_b, slots.ranks, slots.scalings, ids, check=False),
            device,
            repeat,
        )
        distinct = min(batch, num_slots)
        moved = distinct * rank * d * 2 * 2 + batch * d * 2 * 3  # A and B of each distinct adapter, x read, y read+write
        gbs = moved / (ms_s + ms_e) / 1e6
        print(f"BGMV batch {batch:>4}: shrink {ms_s * 1e3:7.1f} us, expand {ms_e * 1e3:7.1f} us, {gbs:8.1f} GB/s")
    tokens = 8192
    x = torch.randn(tokens, d, device=device, dtype=dtype)
    y = torch.randn(tokens, d, device=device, dtype=dtype)
    w = torch.randn(d, d, device=device, dtype=dtype)
    seg_starts = torch.arange(0, tokens + 1, 512, device=device, dtype=torch.int32)
    seg_slots = torch.arange(tokens // 512, device=device, dtype=torch.int32) % num_slots
    buf = torch.zeros(tokens, rank, device=device, dtype=torch.float32)
    ms_s = timed(lambda: sgmv_shrink(x, slots.lora_a, slots.ranks, seg_starts, seg_slots, out=buf, check=False), device, repeat)
    ms_e = timed(
        lambda: sgmv_expand(y, buf, slots.lora_b, slots.ranks, slots.scalings, seg_starts, seg_slots, check=False), device, repeat
    )
    ms_base = timed(lambda: x @ w.T, device, repeat)
    flops = 2 * tokens * d * rank * 2
    ms = ms_s + ms_e
    print(f"SGMV {tokens} tokens: {flops / ms / 1e9:.1f} TFLOP/s; adapter {ms:.3f} ms", end="")
    print(f" vs base GEMM {ms_base:.3f} ms ({100 * ms / ms_base:.1f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=30, help="timed runs per figure (median reported)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else machine(dtype)
    print(f"device {device}: {where}")
    seed_shape(device, dtype, args.repeat)
    model_shapes(device, dtype, args.repeat)
    if device.type == "cuda":
        gpu_throughput(device, args.repeat)


if __name__ == "__main__":
    main()
