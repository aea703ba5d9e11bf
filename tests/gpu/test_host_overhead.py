"""What an engine step on the CUDA code path asks of the device, counted on the CPU with the
device's work taken out (``loraplane.serving.bench.host_overhead``; ``benchmarks/host_overhead.py``
gives the same figures at an 8B shape). A change that adds kernel launches, graph replays or
read-backs to a step fails here, on a machine without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplane.serving.bench.host_overhead import (
    DeviceFree,
    HostSync,
    Scenario,
    device_free_engine,
    measure,
    place_all,
    recording,
    run_scenario,
)
from loraplane.serving.bench.shapes import TOY_CONFIG, write_shape
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.lora.entries import AdapterSpec
from loraplane.serving.lora.synthetic import write_adapter
from loraplane.serving.weights.base import resolve_base

LAYERS = TOY_CONFIG["num_hidden_layers"]
# A layer whose rows all have an adapter on all seven projections: 2 norms, 4 projections, 8 adapter
# kernels (a shrink and an expand per projection, its fused slices in the same launches), rotary,
# the KV write, attention, SiLU-and-multiply.
PER_LAYER = 2 + 4 + 8 + 4
# Around the layers: the embedding and the final norm; for the sampled rows, the rows' gather, the
# logits GEMM, their float32 cast and the greedy argmax.
AROUND = 2 + 4
# A decode step replays its graph; outside it, the logits GEMM, the cast and the argmax.
DECODE = 3
# A step with prompts replays its token bucket's graph: the layers, the embedding, the final norm
# and the copy into the buckets' shared output; outside it, what AROUND counts for the sampled rows.
PROMPT_GRAPH = PER_LAYER * LAYERS + 3
PROMPT = 4


def _engine(work: Path, **extra: Any) -> Iterator[tuple[Any, Any, list[str | None]]]:
    folder = write_shape(work / "base", TOY_CONFIG)
    shape = resolve_base(str(folder), work / "shape", weights=False).shape
    names = [f"a{i}" for i in range(3)]
    for i, name in enumerate(names):
        write_adapter(work / name, shape, 2, seed=i, dtype=torch.bfloat16)
    settings = dict(
        model=str(folder), dtype="bfloat16", max_loras=4, max_lora_rank=8, max_num_seqs=16, max_num_batched_tokens=512,
        max_model_len=256, num_kv_blocks=512, block_size=16, enable_prefix_caching=False, cache_dir=work / "cache",
        **extra,
    )  # fmt: skip
    with device_free_engine(settings) as (built, recorder):
        for name in names:
            built.register_lora(AdapterSpec(name, str(work / name)))
            built.pin_lora(name)
        place_all(built, names)
        yield built, recorder, list(names)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, list[str | None]]]:
    yield from _engine(tmp_path_factory.mktemp("host-overhead"))


@pytest.fixture
def eager_engine(tmp_path: Path) -> Iterator[tuple[Any, Any, list[str | None]]]:
    """Closed with its test: one recorder at a time answers device operations."""
    yield from _engine(tmp_path, enforce_eager=True)


def test_a_decode_step_is_one_graph_replay_and_one_read_back(engine: tuple[Any, Any, list[str | None]]) -> None:
    built, recorder, names = engine
    for batch in (1, 5, 16):
        (step,) = run_scenario(built, recorder, Scenario("decode", decode=batch), names, repeats=1)
        t = step.tally
        assert (t.graph_replays, t.launches, t.read_backs, t.copies_in) == (1, DECODE, 1, 1), f"batch {batch}: {t}"
        assert t.read_back_bytes == 8 * batch  # the sampled token ids, nothing more


PROMPT_SCENARIOS = (Scenario("prompts", prompts=6, prompt_len=40), Scenario("mixed", decode=4, prompts=2, prompt_len=30))


def test_a_step_with_prompts_is_one_graph_replay_of_what_its_layers_declare(
    engine: tuple[Any, Any, list[str | None]],
) -> None:
    built, recorder, names = engine
    for scenario in PROMPT_SCENARIOS:
        (step,) = run_scenario(built, recorder, scenario, names, repeats=1)
        t = step.tally
        assert (t.graph_replays, t.launches, t.read_backs, t.copies_in) == (1, PROMPT, 1, 1), f"{scenario.name}: {t}"
    buckets = {size: n for (kind, size), n in recorder.graph_launches.items() if kind == "PromptGraphs"}
    assert buckets and set(buckets.values()) == {PROMPT_GRAPH}, buckets


def test_an_eager_step_with_prompts_launches_what_its_layers_declare(eager_engine: tuple[Any, Any, list[str | None]]) -> None:
    built, recorder, names = eager_engine
    for scenario in PROMPT_SCENARIOS:
        (step,) = run_scenario(built, recorder, scenario, names, repeats=1)
        t = step.tally
        assert t.graph_replays == 0 and t.read_backs == 1 and t.copies_in == 1, f"{scenario.name}: {t}"
        assert t.launches == PER_LAYER * LAYERS + AROUND, f"{scenario.name}: {t.launches} launches, {t.by_op}"


def test_rows_with_temperature_sample_on_the_device_and_only_rows_with_processors_bring_logits_back(
    engine: tuple[Any, Any, list[str | None]],
) -> None:
    """Greedy and temperature rows (seeded or not, with top-p) are sampled on the device: their
    token ids alone cross, in one read-back. A row with a logits processor (a Python callable)
    samples on the host, so its whole logits row crosses, in the step's second read-back."""
    built, recorder, names = engine
    kinds = [
        SamplingParams(max_tokens=4, temperature=0.0),
        SamplingParams(max_tokens=4, temperature=0.7, seed=1),
        SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9),
    ]
    ids = [built.add_request([5] * 8, p, adapter=names[0]) for p in kinds]
    step = measure(recorder, built.step)
    assert (step.tally.read_backs, step.tally.read_back_bytes) == (1, 8 * len(kinds)), step.tally
    penalised = built.add_request(
        [5] * 8, SamplingParams(max_tokens=4, temperature=0.7, frequency_penalty=0.5, logits_processors=(lambda ids, row: row,))
    )
    step = measure(recorder, built.step)  # the new row's prompt and the three decodes, in one step
    assert step.tally.read_backs == 2
    assert step.tally.read_back_bytes == 8 * len(kinds) + 4 * TOY_CONFIG["vocab_size"]
    for i in [*ids, penalised]:
        built.abort(i)
    built.step()


def test_a_hidden_read_back_or_a_mixed_device_operation_is_caught() -> None:
    with recording():
        x = DeviceFree((4, 8), (8, 1), torch.float32)
        with pytest.raises(HostSync):
            x.sum().item()
        with pytest.raises(RuntimeError, match="mixes device tensors with host"):
            x + torch.ones(4, 8)
        y = torch.tensor([1.0, 2.0]).to(torch.device("cuda", 0))
        assert type(y) is DeviceFree and y.device.type == "cuda"


def test_the_benchmark_runs(tmp_path: Path) -> None:
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("host_overhead_bench", Path(__file__).parents[2] / "benchmarks" / "host_overhead.py")
    assert spec is not None and spec.loader is not None
    bench = module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "figures.json"
    assert bench.main(["--shape", "toy", "--repeats", "1", "--adapters", "4", "--only", "batch 1", "--json", str(out),
                       "--work-dir", str(tmp_path / "work")]) == 0  # fmt: skip
    assert '"launches": 3' in out.read_text()


def test_steps_above_the_capture_size_run_eagerly(tmp_path: Path) -> None:
    """``max_cudagraph_capture_size`` (vLLM's) caps what is captured: a step with more tokens, of
    prompts or of decodes, launches its layers one by one; smaller ones still replay."""
    for built, recorder, names in _engine(tmp_path, max_cudagraph_capture_size=8):
        for scenario, replays in ((Scenario("decode", decode=5), 1), (Scenario("decode", decode=12), 0)):
            (step,) = run_scenario(built, recorder, scenario, names, repeats=1)
            assert step.tally.graph_replays == replays, f"{scenario}: {step.tally}"
        (step,) = run_scenario(built, recorder, PROMPT_SCENARIOS[0], names, repeats=1)
        assert step.tally.graph_replays == 0 and step.tally.launches == PER_LAYER * LAYERS + AROUND
        prompt_graphs = built.runner.prompt_graphs
        assert prompt_graphs.sizes == [8] and built.runner.graphs.sizes == [1, 2, 4, 8]


# Async scheduling feeds the tokens in flight into the next step's input ids on the device: the
# feed's row indices cross in a second small copy, and it launches their two casts to int64, the
# gather of the tokens, their clamp (a failed row's code is fed as id 0), their cast and the write.
FEED = 6


def test_an_async_decode_step_reads_back_the_step_before_after_launching_its_own(tmp_path: Path) -> None:
    """Under async scheduling a decode step is still one graph replay; its one read-back is the
    previous step's token ids, waited for after this step is launched, and the tokens it is fed
    never cross to the host and back: one more copy in (the feed's rows), no more read-backs."""
    for built, recorder, names in _engine(tmp_path, async_scheduling=True):
        for batch in (1, 5, 16):
            (step,) = run_scenario(built, recorder, Scenario("decode", decode=batch), names, repeats=1)
            t = step.tally
            assert (t.graph_replays, t.launches, t.read_backs, t.copies_in) == (1, DECODE + FEED, 1, 2), f"batch {batch}: {t}"
            assert t.read_back_bytes == 8 * batch
        (step,) = run_scenario(built, recorder, PROMPT_SCENARIOS[1], names, repeats=1)  # the mixed step
        t = step.tally
        assert (t.graph_replays, t.launches, t.read_backs, t.copies_in) == (1, PROMPT + FEED, 1, 2), t
