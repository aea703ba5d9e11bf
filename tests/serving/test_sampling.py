"""Per-request sampling: seeds, top-k/top-p, stop strings and ids, max tokens, log-probabilities."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import LogitsRecorder, tiny_engine

from loraplane.serving.engine.sampling_params import SamplingError, SamplingParams
from loraplane.serving.engine.sequence import FinishReason

PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory):
    return tiny_engine(tiny_llama, tmp_path_factory.mktemp("sampling"), tiny_adapters)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(engine) -> None:
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = engine.generate([PROMPT], p)[0].token_ids
    noisy = SamplingParams(max_tokens=12, temperature=1.5, ignore_eos=True)  # unseeded neighbours
    batch = engine.generate([[9, 9, 9], PROMPT, [4, 5]], [noisy, p, noisy], [None, None, "qv4"])
    assert batch[1].token_ids == alone
    other_seed = engine.generate([PROMPT], SamplingParams(**{**p.__dict__, "seed": 99}))[0].token_ids
    assert other_seed != alone


def test_top_k_one_is_greedy_and_top_k_bounds_the_choice(engine) -> None:
    greedy = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    top1 = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=1.3, top_k=1, seed=3, ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids
    recorder = LogitsRecorder(None)
    p = SamplingParams(max_tokens=20, temperature=2.0, top_k=3, seed=5, ignore_eos=True, logits_processors=[recorder])
    out = engine.generate([PROMPT], p)[0]
    for token, row in zip(out.token_ids, recorder.rows, strict=True):
        assert token in torch.topk(row, 3).indices.tolist()


def test_top_p_keeps_the_smallest_nucleus(engine) -> None:
    recorder = LogitsRecorder(None)
    p = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.3, seed=8, ignore_eos=True, logits_processors=[recorder])
    out = engine.generate([PROMPT], p)[0]
    for token, row in zip(out.token_ids, recorder.rows, strict=True):
        probs, order = torch.sort(torch.softmax(row, -1), descending=True)
        nucleus = order[: int((probs.cumsum(0) < 0.3).sum()) + 1].tolist()
        assert token in nucleus


def test_min_p_drops_tokens_below_its_share_of_the_top_one(engine) -> None:
    """vLLM's min_p, after temperature: at 0.5 every drawn token is at least half as likely as the
    step's most likely one, where the same seed without it draws some that are not."""
    recorder = LogitsRecorder(None)
    kwargs = {"max_tokens": 30, "temperature": 2.0, "seed": 4, "ignore_eos": True}
    out = engine.generate([PROMPT], SamplingParams(**kwargs, min_p=0.5, logits_processors=[recorder]))[0]
    for token, row in zip(out.token_ids, recorder.rows, strict=True):
        probs = torch.softmax(row / 2.0, -1)
        assert probs[token] >= 0.5 * probs.max()
    recorder = LogitsRecorder(None)
    free = engine.generate([PROMPT], SamplingParams(**kwargs, logits_processors=[recorder]))[0]
    shares = [
        float(torch.softmax(row / 2.0, -1)[t] / torch.softmax(row / 2.0, -1).max())
        for t, row in zip(free.token_ids, recorder.rows, strict=True)
    ]
    assert min(shares) < 0.5


def test_special_tokens_and_the_stop_string_in_the_text_as_asked(engine) -> None:
    """vLLM's skip_special_tokens (on by default) and include_stop_str_in_output (off)."""
    eos = engine.tokenizer.eos_token_id
    forced = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logit_bias=((eos, 100.0),))
    assert engine.generate([PROMPT], forced)[0].text == ""
    shown = engine.generate([PROMPT], SamplingParams(**{**forced.__dict__, "skip_special_tokens": False}))[0]
    assert shown.text == engine.tokenizer.hf.decode([eos]) * 3
    greedy = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop = greedy.text[2:4]
    kept = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,), include_stop_str_in_output=True)
    out = engine.generate([PROMPT], kept)[0]
    assert out.finish_reason is FinishReason.STOP and out.text == greedy.text[: greedy.text.find(stop) + len(stop)]


def test_logprobs_are_those_of_the_chosen_tokens(engine) -> None:
    recorder = LogitsRecorder(None)
    p = SamplingParams(max_tokens=6, temperature=0.8, seed=1, logprobs=3, ignore_eos=True, logits_processors=[recorder])
    out = engine.generate([PROMPT], p, ["all8"])[0]
    assert len(out.logprobs) == 6
    for lp, token, row in zip(out.logprobs, out.token_ids, recorder.rows, strict=True):
        ref = torch.log_softmax(row, -1)
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(ref[token]), abs=1e-5)
        assert [t for t, _ in lp.top] == torch.topk(ref, 3).indices.tolist()


def test_stop_token_ids_max_tokens_and_eos(engine) -> None:
    greedy = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert greedy.finish_reason is FinishReason.LENGTH and len(greedy.token_ids) == 10
    stop_at = greedy.token_ids[4]
    first = greedy.token_ids.index(stop_at)
    stopped = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(stop_at,)))[0]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == greedy.token_ids[: first + 1]


def test_stop_string_truncates_the_text(engine) -> None:
    greedy = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert len(greedy.text) > 4
    stop = greedy.text[2:4]
    out = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,)))[0]
    assert out.finish_reason is FinishReason.STOP
    assert stop not in out.text and greedy.text.startswith(out.text)
    assert len(out.token_ids) < 12


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": ("",)}, "stop"),
        ({"min_p": 1.5}, "min_p"),
    ],
)
def test_bad_sampling_params_are_refused(kwargs, message) -> None:
    with pytest.raises(SamplingError, match=message):
        SamplingParams(**kwargs)
