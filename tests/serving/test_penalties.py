"""Penalties, logit biases, min_tokens and shared-prompt samples, in the engine's batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import tiny_engine
from transformers import RepetitionPenaltyLogitsProcessor

from loraplane.serving.engine.llm_engine import RequestError
from loraplane.serving.engine.penalties import apply_penalties
from loraplane.serving.engine.sampling_params import SamplingError, SamplingParams
from loraplane.serving.engine.sequence import FinishReason, Sequence

PROMPT = [5, 17, 42, 99, 7, 3, 11, 60, 23]


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory):
    return tiny_engine(tiny_llama, tmp_path_factory.mktemp("penalties"), tiny_adapters)


def _seq(prompt: list[int], output: list[int], **params: object) -> Sequence:
    seq = Sequence("r", list(prompt), SamplingParams(max_tokens=64, **params))  # type: ignore[arg-type]
    seq.output_token_ids = list(output)
    return seq


def test_frequency_and_presence_penalties_follow_openais_formula() -> None:
    """OpenAI's documented rule: logit -= count * frequency_penalty + (count > 0) * presence_penalty."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    seqs = [
        _seq([1, 2], [4, 4, 4, 9], frequency_penalty=0.5, presence_penalty=0.25),
        _seq([1, 2], [4, 7], frequency_penalty=-1.0),
        _seq([1, 2], [4, 4]),  # no penalty: its row must not move
    ]
    expected = logits.clone()
    for row, seq in zip(expected, seqs[:2], strict=False):
        for token in set(seq.output_token_ids):
            count = seq.output_token_ids.count(token)
            row[token] -= count * seq.params.frequency_penalty + seq.params.presence_penalty
    got = apply_penalties(logits.clone(), seqs, eos_ids=())
    torch.testing.assert_close(got, expected)


def test_repetition_penalty_matches_transformers() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 40) * 3
    seqs = [_seq([3, 5, 8], [8, 13], repetition_penalty=1.3), _seq([2, 2, 30], [1], repetition_penalty=0.7)]
    got = apply_penalties(logits.clone(), seqs, eos_ids=())
    for row, seq in zip(range(2), seqs, strict=True):
        ref = RepetitionPenaltyLogitsProcessor(seq.params.repetition_penalty)(
            torch.tensor([seq.token_ids]), logits[row : row + 1].clone()
        )
        torch.testing.assert_close(got[row : row + 1], ref)


def test_logit_bias_forces_a_token_and_min_tokens_holds_back_eos(engine) -> None:
    eos = next(iter(engine.eos_ids))
    forced = engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias=((77, 100.0),)))[0]
    assert forced.token_ids == [77] * 6
    # EOS made overwhelming: it still cannot come before min_tokens, and ends the request right after.
    out = engine.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0, min_tokens=5, logit_bias=((eos, 100.0),)))[0]
    assert out.token_ids[:5] == [t for t in out.token_ids[:5] if t != eos] and len(out.token_ids) == 6
    assert out.token_ids[-1] == eos and out.finish_reason is FinishReason.STOP


def test_penalties_change_only_the_rows_that_ask(engine) -> None:
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = engine.generate([PROMPT], plain)[0].token_ids
    penalised = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0)
    batch = engine.generate([PROMPT, PROMPT, PROMPT[:4]], [penalised, plain, penalised], [None, None, "qv4"])
    assert batch[1].token_ids == alone
    repeats = lambda ids: len(ids) - len(set(ids))  # noqa: E731
    assert repeats(batch[0].token_ids) == 0  # presence 2 on a random model: every token once


def test_allowed_token_ids_hold_their_rows_alone(engine) -> None:
    """vLLM's ``allowed_token_ids``: sampled at temperature 1, a row draws only from its list, while
    a row without one in the same batch answers exactly as it does alone."""
    plain = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    alone = engine.generate([PROMPT], plain)[0].token_ids
    limited = [
        SamplingParams(max_tokens=10, temperature=1.0, seed=s, ignore_eos=True, allowed_token_ids=(40, 41, 90)) for s in range(3)
    ]
    batch = engine.generate([PROMPT] * 4, [*limited, plain], [None, "qv4", None, None])
    assert all(set(out.token_ids) <= {40, 41, 90} for out in batch[:3])
    assert len({t for out in batch[:3] for t in out.token_ids}) > 1  # sampled among them, not one forced token
    assert batch[3].token_ids == alone
    with pytest.raises(RequestError, match="allowed_token_ids"):
        engine.generate([PROMPT], SamplingParams(max_tokens=2, allowed_token_ids=(10**6,)))


def test_bad_words_answer_as_transformers_does(engine, tiny_llama: Path) -> None:
    """vLLM's ``bad_words`` as token sequences: each greedy answer equals transformers' with the
    same ``bad_words_ids`` (its ``NoBadWordsLogitsProcessor``), for a one-token word, a two-token
    and a three-token word taken from the unconstrained answer (so each is about to be written),
    in one batch with a plain row that answers as it does alone."""
    from transformers import AutoModelForCausalLM

    steps = 12
    plain = SamplingParams(max_tokens=steps, temperature=0, min_tokens=steps)
    alone = engine.generate([PROMPT], plain)[0].token_ids
    words = [(alone[0],), tuple(alone[3:5]), tuple(alone[6:9])]
    assert PROMPT[-1] not in (alone[3], alone[6])  # no word begins in the prompt (vLLM reads the output only)
    params = [SamplingParams(max_tokens=steps, temperature=0, min_tokens=steps, bad_words_token_ids=(w,)) for w in words]
    *got, beside = (o.token_ids for o in engine.generate([PROMPT] * 4, [*params, plain]))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    for word, answer in zip(words, got, strict=True):
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([PROMPT]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                bad_words_ids=[list(word)], pad_token_id=0,
            )[0, len(PROMPT) :].tolist()  # fmt: skip
        assert answer == ref != alone, word
        assert not any(tuple(answer[i : i + len(word)]) == word for i in range(steps))
    assert beside == alone


def test_out_of_range_values_are_refused() -> None:
    for bad in ({"frequency_penalty": 2.5}, {"presence_penalty": -3}, {"repetition_penalty": 0}, {"min_tokens": 65},
                {"logit_bias": ((3, 101.0),)}, {"logit_bias": ((-1, 1.0),)}, {"allowed_token_ids": (-1,)},
                {"allowed_token_ids": tuple(range(4097))}, {"bad_words_token_ids": ((),)},
                {"bad_words_token_ids": ((1, -2),)}, {"bad_words_token_ids": ((1,),) * 129}):  # fmt: skip
        with pytest.raises(SamplingError):
            SamplingParams(max_tokens=64, **bad)  # type: ignore[arg-type]


def test_samples_of_one_prompt_share_its_kv_blocks(engine) -> None:
    """n > 1: the second sample waits for the first's prompt and reads its full blocks from the
    prefix cache, so only the last partial block is computed again."""
    prompt = [9, *range(30, 52)]  # 23 tokens: 5 full blocks of 4
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3, ignore_eos=True)
    engine.add_request(prompt, params, request_id="lead")
    engine.add_request(prompt, SamplingParams(**{**params.__dict__, "seed": 4}), request_id="follow", after="lead")
    done = {}
    while len(done) < 2:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    block = engine.config.block_size
    assert done["lead"].num_cached_tokens == 0
    assert done["follow"].num_cached_tokens == (len(prompt) - 1) // block * block
    assert done["lead"].token_ids != done["follow"].token_ids
