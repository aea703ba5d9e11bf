"""The model traces whole under ``torch.compile``: the LoRA and attention kernels are custom ops
(``kernels/ops.py``), so dynamo sees one opaque node per launch instead of breaking the graph at a
Triton kernel. ``fullgraph=True`` turns any graph break into an error; ``aot_eager`` traces through
AOTAutograd without generating code, so the check needs no compiler and runs the same kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import tiny_engine

from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.model.context import StepContext
from loraplane.serving.model.llama import LlamaModel


def test_a_step_with_adapters_compiles_without_graph_breaks(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = tiny_engine(tiny_llama, tmp_path, tiny_adapters, kernel_backend="triton", enforce_eager=True)
    steps: list[tuple[torch.Tensor, StepContext]] = []
    forward = LlamaModel.forward

    def spy(model: LlamaModel, ids: torch.Tensor, ctx: StepContext, cache: object) -> torch.Tensor:
        steps.append((ids, ctx))
        return forward(model, ids, ctx, cache)  # type: ignore[arg-type]

    monkeypatch.setattr(LlamaModel, "forward", spy)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    engine.add_request([5, 6, 7, 8, 9, 10, 11], greedy, adapter="all8")
    engine.generate([[12, 13, 14]], greedy, ["mlp16"])  # prefill segments of two adapters (SGMV), then decodes
    monkeypatch.undo()
    ids, ctx = next((i, c) for i, c in steps if c.lora is not None and c.lora.seg_starts is not None)
    assert ctx.paged is not None and ctx.lora is not None
    with torch.inference_mode():
        eager = engine.model(ids, ctx, engine.cache)
        compiled = torch.compile(engine.model, backend="aot_eager", fullgraph=True)(ids, ctx, engine.cache)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
