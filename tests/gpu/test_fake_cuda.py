"""The engine with ``device="cuda"`` stepped on fake CUDA tensors (torch's ``FakeTensorMode``),
on a machine without a GPU.

Fake tensors carry a device, shape and dtype but no data. Inside the mode an operation that mixes
a CUDA tensor with a host one raises ``FakeTensorDeviceMismatchError``, and reading a device
value back (``.item()``, ``.tolist()``, ``int()``, ``bool()`` of a tensor) raises
``DataDependentOutputException``: each would be a host synchronisation on a real GPU. The
engine declares one read-back, ``transfers.to_host`` (the sampled token ids, or the logits rows
whose sampling runs on the host); the test stands in for it with zeros and counts the calls.
The kernels run as their registered fake implementations (``loraplane.kernels.ops``), which
also refuse any operand on another device than the output.

The engine's step turns a failed forward pass into failed requests, so "nothing raised" is
checked as "no request ended with an error".
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_helpers import tiny_engine
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from loraplane.serving.engine import transfers
from loraplane.serving.engine.llm_engine import LLMEngine
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.engine.scheduler import FAIR_PREFILL_CHUNK
from loraplane.serving.engine.sequence import FinishReason


class Syncs:
    """Stands in for the declared read-back: records its shapes, returns zeros (token 0)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        assert t.device.type == "cuda", f"read back a {t.device} tensor"
        self.calls.append(tuple(t.shape))
        with unset_fake_temporarily():
            return torch.zeros(tuple(t.shape), dtype=t.dtype)


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> Syncs:
    recorder = Syncs()
    monkeypatch.setattr(transfers, "to_host", recorder)
    return recorder


@pytest.fixture
def fake_cuda() -> Iterator[FakeTensorMode]:
    # Real host tensors (safetensors reads, the adapter loader's threads) may enter: they become
    # fake on first use, as a copy to the device would make them real device tensors.
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


def _run(engine: LLMEngine, syncs: Syncs, requests: list[tuple[list[int], str | None, int]]) -> list[int]:
    """Step until every request finishes; the declared read-backs of each step that ran."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, _, n in requests]
    ids = [engine.add_request(p, sp, adapter=a) for (p, a, _), sp in zip(requests, params, strict=True)]
    per_step, done = [], {}
    while len(done) < len(ids):
        before = len(syncs.calls)
        for out in engine.step():
            assert out.error is None, f"{out.request_id}: {out.error}"
            if out.finished:
                done[out.request_id] = out
        if engine.ran:
            per_step.append(len(syncs.calls) - before)
    for i, (_, _, n) in zip(ids, requests, strict=True):
        assert done[i].finish_reason == FinishReason.LENGTH and len(done[i].token_ids) == n
    return per_step


@pytest.mark.parametrize("lora_memory", ["static", "unified"])
def test_the_engine_steps_on_fake_cuda_without_mismatch_or_hidden_sync(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path, syncs: Syncs, fake_cuda: FakeTensorMode, lora_memory: str
) -> None:
    engine = tiny_engine(
        tiny_llama, tmp_path, {"qv4": tiny_adapters["qv4"]}, device="cuda", max_loras=2, max_cpu_loras=4,
        num_kv_blocks=40, max_model_len=96, max_num_batched_tokens=24, max_num_seqs=6, lora_memory=lora_memory,
    )  # fmt: skip
    for name in ("all8", "mlp16", "ku2"):
        engine.load_lora(name, str(tiny_adapters[name]))
    # Everything the forward pass touches lives on the device; the host tier stays on the host.
    assert engine.model.embed_tokens.weight.device.type == "cuda"
    assert engine.cache.k.device.type == "cuda" and engine.cache.v.device.type == "cuda"
    assert all(s.ranks.device.type == "cuda" for s in engine.slots.slots.values())
    assert engine.runner.backend == "triton"
    assert engine.scheduler.fair_prefill_chunk == FAIR_PREFILL_CHUNK["cuda"]  # a GPU's step is not a CPU's
    assert not engine.interjects  # nor does a step of milliseconds need another run inside it

    # Prompts longer than a step's token budget (chunked prefill), four adapters for two slots
    # (swaps, some prefetched into a slot while their request waits), a bare-base row, and more KV
    # than the cache holds at once (preemption).
    requests = [
        ([3 + (i * 7 + j) % 300 for j in range(30 + 5 * i)], a, 24)
        for i, a in enumerate(["qv4", "all8", None, "mlp16", "ku2", "all8"])
    ]
    per_step = _run(engine, syncs, requests)
    assert engine.scheduler.num_preemptions > 0
    assert engine.adapters.device_prefetches > 0  # slots written ahead of a request's turn, no sync either
    # Plain greedy requests: one read-back (the token ids) per step that samples, none otherwise.
    assert per_step and max(per_step) == 1 and sum(per_step) >= 24

    # A promotion: a new version under a served name, then traffic on it.
    engine.load_lora("qv4", str(tiny_adapters["ku2"]))
    per_step = _run(engine, syncs, [([5, 6, 7, 8, 9, 10], "qv4", 4), ([11, 12, 13], None, 4)])
    assert max(per_step) == 1


def test_sampled_rows_come_back_as_ids_and_only_rows_with_processors_as_logits(
    tiny_llama: Path, tmp_path: Path, syncs: Syncs, fake_cuda: FakeTensorMode
) -> None:
    """A greedy row, a seeded row with temperature and log-probabilities, a row with penalties
    and a bias, and a row held to a JSON schema sample on the device: one read-back of their ids
    and figures ([4, 2 + 2 x 2] float64). A row with a logits processor (a Python callable)
    samples on the host: its logits row comes back. Two read-backs in a step, never more."""
    engine = tiny_engine(tiny_llama, tmp_path, device="cuda")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    guided = SamplingParams(max_tokens=3, temperature=0.8, guide=engine.grammars.compile(schema))
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=3, temperature=0.8, seed=7, logprobs=2, ignore_eos=True)
    penalised = SamplingParams(
        max_tokens=3, temperature=0.8, frequency_penalty=0.5, repetition_penalty=1.2, logit_bias=((5, 2.0),), ignore_eos=True
    )
    processed = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logits_processors=(lambda ids, row: row,))
    rows = (([4, 5, 6], greedy), ([7, 8, 9], seeded), ([10, 11, 12], penalised), ([15], guided), ([13, 14], processed))
    ids = [engine.add_request(prompt, params) for prompt, params in rows]
    while engine.has_unfinished():
        before = len(syncs.calls)
        for out in engine.step():
            # A fake tensor's values are not tokens: the grammar may refuse the one it is handed.
            if out.request_id != ids[3] or not (out.error or "").startswith("structured output"):
                assert out.error is None, out.error
        assert len(syncs.calls) - before <= 2
    assert (4, 6) in syncs.calls and (1, 320) in syncs.calls  # the device rows' ids and figures; one logits row


def test_a_mixed_device_operation_is_caught(tiny_llama: Path, tmp_path: Path, fake_cuda: FakeTensorMode) -> None:
    """The harness catches what it is for: a host tensor reaching a device kernel fails the step."""
    engine = tiny_engine(tiny_llama, tmp_path, device="cuda")
    engine.cache.k = engine.cache.k.to("cpu")  # as if the KV cache had been left on the host
    engine.runner.cache = engine.cache
    engine.add_request([4, 5, 6], SamplingParams(max_tokens=2, temperature=0))
    outs = engine.step()
    assert outs and outs[0].error is not None and "cpu" in outs[0].error
