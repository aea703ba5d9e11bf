"""Every kernel the engine launches compiles for sm_80 and sm_90, at the configurations it launches.

The interpreter (``TRITON_INTERPRET=1``) runs the kernels on the CPU but never type-checks them as
the compiler does: a pointer of the wrong element type passes there and fails on a GPU. Here the
tiny engine is stepped on the Triton backend (static slots and unified paging, prompts longer than
the 16-token step so prefill is chunked into SGMV segments beside decodes) while every launch is
recorded; each recorded launch is then compiled by Triton for A100 and H100 with its activations,
adapter slots and KV cache retyped to bf16 and fp16 as a GPU engine holds them (and in float32, as
recorded), together with the launches an 8B Llama engine makes (recorded from the same launchers
on ``meta`` tensors). No GPU or driver is needed: Triton ships ``ptxas``. The compiles run in child
processes without the interpreter (see tests/helpers/compile_check.py); Triton's cache
makes reruns quicker.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import compile_check
import pytest
import torch
from compile_check import Launch, compile_launches, engine_shapes, record_launches, summary_table, with_dtype
from engine_helpers import engine_greedy, tiny_engine

from loraplane.kernels import bgmv
from loraplane.serving.engine import device_sampling
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.engine.sequence import Sequence

KERNEL_NAMES = {name for _, name in compile_check.ENGINE_KERNELS}
# What every step launches whatever the adapters' memory: attention and the layer's fused work.
LAYER_KERNELS = {"_paged_attention_kernel", "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel", "_kv_write_kernel"}
# bf16 and fp16 as a GPU engine runs by default; float32 too (dtype="float32": IEEE dots in attention).
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
STEPS = 3


def _requests() -> list[tuple[list[int], str | None]]:
    # 21 and 18 tokens: longer than the 16-token step, so their prefill is cut into chunks.
    return [
        (list(range(3, 24)), "all8"),
        ([5, 6, 7, 8, 9], None),
        (list(range(40, 58)), "mlp16"),
        ([60, 61, 62], "ku2"),
    ]


@pytest.fixture(scope="module")
def engine_launches(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[Launch]:
    launches: list[Launch] = []
    # Steps with prompts replay graphs whose segment kernels take work lists (TILED); with
    # enforce_eager they launch per-segment grids: both variants must compile.
    for lora_memory, eager in (("static", False), ("static", True), ("unified", False)):
        engine = tiny_engine(
            tiny_llama, tmp_path_factory.mktemp(lora_memory), tiny_adapters, kernel_backend="triton",
            lora_memory=lora_memory, max_num_batched_tokens=16, enforce_eager=eager,
        )  # fmt: skip
        with record_launches() as log:
            tokens, _ = engine_greedy(engine, _requests(), STEPS, eos_id=2)
        assert all(len(t) == STEPS for t in tokens)
        paged = {"_paged_shrink_kernel", "_paged_expand_kernel"}
        lora = paged if lora_memory == "unified" else {name for name in KERNEL_NAMES if "gmv" in name} - paged
        assert log.names == lora | LAYER_KERNELS, f"{lora_memory}: launched {sorted(log.names)}"
        launches += log.launches
    # The sampler's kernels: the top-k/top-p cut-off, a seeded row's noise and the race, on the
    # Triton backend's draw (the engines' greedy steps above take an argmax).
    logits = torch.randn(3, 300)
    seqs = [Sequence(f"s{i}", [1, 2], SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, seed=i)) for i in range(3)]
    with record_launches() as log:
        device_sampling.draw(logits, seqs, backend="triton")
    assert log.names == {"_seeded_noise_kernel", "_top_k_top_p_kernel", "_race_kernel"}
    return launches + log.launches


def test_the_engine_launches_every_kernel(engine_launches: list[Launch]) -> None:
    assert {launch.name for launch in engine_launches} == KERNEL_NAMES
    attention = {launch.constexprs["BLOCK_M"] for launch in engine_launches if launch.name == "_paged_attention_kernel"}
    assert attention == {16, 32}, "decode steps and chunked prefill both reach attention"  # tiny model: group 2
    for name in ("_paged_attention_kernel", "_sgmv_shrink_kernel", "_sgmv_expand_kernel"):
        tiled = {launch.constexprs["TILED"] for launch in engine_launches if launch.name == name}
        assert tiled == {True, False}, f"{name}: graphs' work lists and eager grids both launched, got {tiled}"


def test_recording_types_the_arguments_and_can_skip_the_kernel() -> None:
    x, a = torch.randn(3, 64), torch.randn(2, 16, 64)
    out = torch.zeros(3, 16)
    ranks, row_slots = torch.tensor([8, 16], dtype=torch.int32), torch.tensor([0, -1, 1], dtype=torch.int32)
    with record_launches(execute=False) as log:
        bgmv.bgmv_shrink(x, a, ranks, row_slots, out)
        bgmv.bgmv_shrink(x, a, ranks, row_slots, out)
    assert not out.any(), "execute=False must not run the kernel"
    assert "run" not in vars(bgmv._bgmv_shrink_kernel), "the launch entry point is restored on exit"
    (launch,) = log.launches
    assert log.counts["_bgmv_shrink_kernel"] == 2
    assert launch.signature["x_ptr"] == "*fp32" and launch.signature["row_slots_ptr"] == "*i32"
    assert launch.signature["K"] == "i32" and "K" in launch.aligned  # 64: divisible by 16, as Triton specializes it
    assert launch.signature["stride_xk"] == "constexpr" and launch.constexprs["stride_xk"] == 1  # Triton folds ints equal to 1
    half = with_dtype(launch, torch.bfloat16)
    assert (half.signature["x_ptr"], half.signature["a_ptr"], half.signature["out_ptr"]) == ("*bf16", "*bf16", "*fp32")
    bgmv.bgmv_shrink(x, a, ranks, row_slots, out)
    assert out.any(), "outside the block the kernel runs again"


@pytest.mark.slow
def test_every_launch_compiles_for_sm80_and_sm90(engine_launches: list[Launch], record_property: pytest.RecordProperty) -> None:
    launches = [with_dtype(launch, dtype) for launch in engine_launches for dtype in DTYPES]
    launches += [launch for dtype in DTYPES for launch in engine_shapes(dtype=dtype)]
    results = compile_launches(launches, compile_check.CAPABILITIES)
    table = summary_table(results)
    print(f"\nshared memory per kernel (tiny engine and 8B Llama shapes):\n{table}")
    record_property("kernel_compile_table", table)
    failed = [f"{r.kernel} sm{r.capability} {r.dtype} {r.constexprs}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    covered = {(r.kernel, r.capability, r.dtype) for r in results}
    assert covered == {(k, c, d) for k in KERNEL_NAMES for c in (80, 90) for d in DTYPES.values()}


def test_a_wrong_pointer_type_fails_to_compile(engine_launches: list[Launch]) -> None:
    """The check can fail: offsets read as floats make ``pool_ptr + rows`` a pointer plus a float."""
    launch = next(launch for launch in engine_launches if launch.name == "_paged_shrink_kernel")
    broken = replace(launch, signature={**launch.signature, "a_off_ptr": "*fp32"})
    (result,) = compile_launches([broken], [90])
    assert not result.ok and result.error is not None and "pointer" in result.error
