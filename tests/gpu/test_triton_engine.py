"""The engine's CUDA code path, run on the CPU: the Triton backend forced on (Triton's interpreter,
``TRITON_INTERPRET=1``, set by the root conftest), against transformers + PEFT on the tiny model.

With ``kernel_backend="triton"`` every LoRA product goes through the SGMV (prefill segments),
BGMV (decode rows) or paged BGMV (unified paging) kernels, and attention through the paged
attention kernel reading keys in place through the block tables, exactly as on a GPU; only the
device differs. Mixed batches of ranks 2-16 and bare-base rows, prompts long enough to be
prefilled in chunks and, with small blocks, read across many of them.

Tolerance: fp32 on both sides; the kernels accumulate in another order than transformers, so
logits agree to 1e-4 (as the CPU path's test), and the greedy continuations are identical.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from engine_helpers import engine_greedy, tiny_engine
from peft_reference import hf_greedy

STEPS = 12
# Seven requests: decode steps run in the graph bucket of 8, with one pad row.
MIX = ["qv4", "all8", None, "mlp16", "ku2", "all8", None]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


@pytest.mark.parametrize(
    ("lora_memory", "enforce_eager"),
    [("static", False), ("unified", True), ("unified", False)],
    ids=["graphs", "eager", "unified-graphs"],
)
def test_the_triton_path_matches_peft(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path, lora_memory: str, enforce_eager: bool
) -> None:
    requests = list(zip(_prompts(len(MIX), seed=11), MIX, strict=True))
    ref_tokens, ref_logits = hf_greedy(tiny_llama, tiny_adapters, requests, STEPS)
    # 16 tokens a step: the longer prompts are prefilled in chunks beside other sequences' decodes.
    engine = tiny_engine(
        tiny_llama, tmp_path, tiny_adapters, kernel_backend="triton", lora_memory=lora_memory, max_num_batched_tokens=16,
        enforce_eager=enforce_eager,
    )  # fmt: skip
    assert engine.runner.backend == "triton"
    tokens, logits = engine_greedy(engine, requests, STEPS, eos_id=2)
    graphs = engine.runner.graphs
    # Decode-only steps replayed graphs (the bucket of 8 holds 7 rows and a pad row; smaller ones
    # as requests finish), or nothing did.
    assert (graphs is None) if enforce_eager else (graphs is not None and 8 in graphs.graphs)
    # Steps with prompts (chunks beside decodes included) replayed their token bucket's graph.
    prompt_graphs = engine.runner.prompt_graphs
    assert (prompt_graphs is None) if enforce_eager else (prompt_graphs is not None and 16 in prompt_graphs.graphs)
    for i, (adapter, ours, ref) in enumerate(zip(MIX, logits, ref_logits, strict=True)):
        assert ours.shape == ref.shape == (STEPS, 320)
        err = (ours - ref).abs().max().item()
        assert err < 1e-4, f"request {i} ({adapter}): max logit error {err:.2e}"
    assert tokens == ref_tokens


def test_the_triton_path_is_the_one_that_runs(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guard against the comparison above passing on the CPU path: with the Triton backend the
    SDPA gather and the numba kernels are never called."""
    from loraplane.kernels import cpu
    from loraplane.serving.model import attention

    engine = tiny_engine(tiny_llama, tmp_path, tiny_adapters, kernel_backend="triton")
    calls: list[str] = []

    def spy(module: object, name: str) -> None:
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: (calls.append(name), fn(*a, **k))[1])

    for name in ("add_lora", "add_lora_segments", "add_lora_paged", "shrink", "expand"):
        spy(cpu, name)
    spy(attention, "_attend")
    tokens, _ = engine_greedy(engine, [([5, 6, 7, 8, 9, 10, 11], "all8"), ([12, 13], None)], 3, eos_id=2)
    assert calls == [] and all(len(t) == 3 for t in tokens)


def test_a_prompt_step_fills_the_host_copy_the_step_before_did_not_send_from(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """A long prompt's middle chunks sample nothing, so no read-back waits for their copies to the
    device: a chunk filling the host copy that the chunk before is still being sent from would
    hand that chunk the wrong tokens on a GPU. The prompt graphs fill two host copies by turns;
    after two chunks each holds its own chunk's tokens."""
    from loraplane.serving.engine.sampling_params import SamplingParams

    engine = tiny_engine(tiny_llama, tmp_path, tiny_adapters, kernel_backend="triton", max_num_batched_tokens=16)
    graphs = engine.runner.prompt_graphs
    assert graphs is not None
    prompt = list(range(3, 43))  # three chunks of 16, 16 and 8 tokens
    engine.add_request(prompt, SamplingParams(max_tokens=1), adapter="all8")
    engine.step()
    engine.step()
    assert [h["ids"][:16].tolist() for h in graphs.hosts] == [prompt[:16], prompt[16:32]]
    assert graphs.turn == 0
