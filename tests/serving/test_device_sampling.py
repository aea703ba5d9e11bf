"""Sampling on the device (``engine/device_sampling.py``), run here on CPU tensors: the same
code a GPU runs. Its draws follow the distribution the request's temperature, top-k, top-p and
min-p leave (a reference written here from the OpenAI/vLLM definitions, in numpy), a seeded
request draws the same tokens in any batch, and its log-probabilities are the host path's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from loraplane.serving.engine import device_sampling
from loraplane.serving.engine.sampler import Sampler
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.engine.sequence import Sequence

VOCAB = 24
LOGITS = torch.from_numpy(np.random.default_rng(7).normal(0, 2, VOCAB).astype(np.float32))


def seq(i: int = 0, output: int = 0, **params: Any) -> Sequence:
    s = Sequence(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=64, **params))
    s.output_token_ids.extend([4] * output)
    return s


def reference(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """The probability of each token after the filters, from their definitions."""
    z = logits.astype(np.float64) / temperature
    if top_k:
        z = np.where(z < np.sort(z)[::-1][top_k - 1], -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]  # the mass of the more likely tokens
        keep = np.zeros_like(p, dtype=bool)
        keep[order] = before < top_p
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if min_p:
        p = np.where(p < min_p * p.max(), 0.0, p)
        p /= p.sum()
    return p


def frequencies(tokens: list[int | None]) -> np.ndarray:
    assert None not in tokens
    return np.bincount(np.asarray(tokens), minlength=VOCAB) / len(tokens)


def close_in_distribution(seen: np.ndarray, expected: np.ndarray, n: int) -> None:
    """Every token within six standard errors of its probability, and none outside the support."""
    assert np.all(seen[expected == 0] == 0), (seen, expected)
    err = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(seen - expected) <= 6 * err + 1e-9), np.round(np.c_[seen, expected], 4)


FILTERS = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 1.3, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.1},
    {"temperature": 0.9, "top_k": 8, "top_p": 0.9, "min_p": 0.05},
]


@pytest.mark.parametrize("params", FILTERS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_draws_follow_the_filtered_distribution(params: dict[str, Any]) -> None:
    n = 20_000
    torch.manual_seed(0)
    drawn = device_sampling.draw(LOGITS.repeat(n, 1), [seq(i, **params) for i in range(n)])
    close_in_distribution(frequencies([d.token for d in drawn]), reference(LOGITS.numpy(), **params), n)


def test_a_seeded_row_draws_by_its_seed_and_position_whatever_shares_its_batch() -> None:
    alone = device_sampling.draw(LOGITS.unsqueeze(0), [seq(0, output=3, temperature=1.0, seed=42)])[0].token
    noise = torch.randn(4, VOCAB)
    batch = torch.cat([noise[:2], LOGITS.unsqueeze(0), noise[2:]])
    others = [seq(i, temperature=1.0, seed=i if i % 2 else None) for i in (1, 2, 3, 4)]
    crowd = device_sampling.draw(batch, [*others[:2], seq(9, output=3, temperature=1.0, seed=42), *others[2:]])
    assert crowd[2].token == alone
    # Along its positions a seed's draws follow the distribution too: the hash is noise enough.
    n = 20_000
    drawn = device_sampling.draw(LOGITS.repeat(n, 1), [seq(0, output=i, temperature=1.0, seed=42) for i in range(n)])
    close_in_distribution(frequencies([d.token for d in drawn]), reference(LOGITS.numpy(), 1.0), n)
    other_seed = device_sampling.draw(LOGITS.repeat(64, 1), [seq(0, output=i, temperature=1.0, seed=43) for i in range(64)])
    assert [d.token for d in drawn[:64]] != [d.token for d in other_seed]


def test_sampled_rows_draw_the_same_tokens_with_the_gpus_kernels() -> None:
    """The Triton kernels (in the interpreter) in place of the CPU's torch: the top-k/top-p
    cut-off's search for the sort, the seeded rows' noise for the torch hash, the race; the same
    draws, unseeded rows beside them from the same generator, greedy rows among them."""
    n = 48
    rows = torch.from_numpy(np.random.default_rng(3).normal(0, 2, (n, VOCAB)).astype(np.float32))
    filters: list[dict[str, Any]] = [
        {"top_p": 0.95},
        {"top_k": 20},
        {"min_p": 0.05, "top_p": 0.8},
        {"temperature": 0.0, "top_p": 0.5},
    ]
    seqs = [seq(i, output=i, **{"temperature": 0.9, **filters[i % 4]}, seed=(i * 2**40 + i) if i % 3 else None) for i in range(n)]

    def tokens(backend: str) -> list[int]:
        return [d.token for d in device_sampling.draw(rows, seqs, torch.Generator().manual_seed(0), backend=backend)]

    drawn = tokens("triton")
    assert drawn == tokens("cpu")
    assert [drawn[i] for i in range(3, n, 4)] == rows[3::4].argmax(dim=1).tolist(), "greedy rows with top-p: argmax"


def test_log_probabilities_are_the_host_paths() -> None:
    """Before temperature and the filters, for the chosen token and the asked-for alternatives."""
    rows = torch.stack([LOGITS, LOGITS.flip(0)])
    seqs = [seq(0, temperature=0.0, logprobs=3), seq(1, temperature=0.8, top_k=4, logprobs=0, seed=5)]
    drawn = device_sampling.draw(rows, seqs)
    host = Sampler().sample(rows[:1].clone(), [seq(0, temperature=0.0, logprobs=3)])[0]
    assert not isinstance(host, device_sampling.Drawn) and drawn[0].token == host[0]
    assert drawn[0].logprob is not None and host[1] is not None
    assert drawn[0].logprob.logprob == pytest.approx(host[1].logprob, abs=1e-6)
    assert [t for t, _ in drawn[0].logprob.top] == [t for t, _ in host[1].top]
    assert [v for _, v in drawn[0].logprob.top] == pytest.approx([v for _, v in host[1].top], abs=1e-6)
    second = drawn[1]
    assert second.token in torch.topk(LOGITS.flip(0), 4).indices.tolist()
    assert second.logprob is not None and second.logprob.top == ()
    assert second.logprob.logprob == pytest.approx(float(torch.log_softmax(LOGITS.flip(0), 0)[second.token]), abs=1e-6)


def test_a_row_whose_logits_are_not_finite_fails_alone() -> None:
    rows = torch.stack([LOGITS, torch.full((VOCAB,), float("nan")), LOGITS])
    drawn = device_sampling.draw(rows, [seq(i, temperature=1.0) for i in range(3)])
    assert drawn[1].token == device_sampling.NOT_FINITE and drawn[0].token >= 0 and drawn[2].token >= 0


def test_penalties_run_on_the_device_rows_and_a_row_with_no_token_left_fails_alone() -> None:
    """The sampler's device path (here on CPU tensors, as a GPU runs it): a penalised greedy row
    gets the token its penalties leave on top; a row whose one allowed token is a bad word gets
    OpenAI's client error, alone."""
    rows = LOGITS.repeat(3, 1)
    top = int(LOGITS.argmax())
    seqs = [
        seq(0, temperature=0.0),
        seq(1, output=0, temperature=0.0, logit_bias=((top, -100.0),)),
        seq(2, temperature=0.0, allowed_token_ids=(3,), bad_words_token_ids=((3,),)),
    ]
    out = Sampler()._sample_from_device(rows, seqs)
    second = int(torch.topk(LOGITS, 2).indices[1])
    assert out[0] == (top, None) and out[1] == (second, None)
    failure = out[2]
    assert not isinstance(failure, tuple) and failure.code == "no_token_allowed"


def test_only_python_callables_and_grammars_keep_a_row_on_the_host() -> None:
    assert device_sampling.on_device(seq(temperature=0.7, top_p=0.9, logprobs=2, seed=1))
    assert device_sampling.on_device(seq(temperature=0.7, frequency_penalty=0.5, logit_bias=((3, 1.0),)))
    assert not device_sampling.on_device(seq(temperature=0.7, logits_processors=(lambda ids, row: row,)))


def test_unseeded_rows_repeat_with_the_engines_seed() -> None:
    """Unseeded rows draw from a generator seeded like the host path's, so a run repeats."""
    rows = LOGITS.repeat(64, 1)

    def run(seed: int) -> list[Any]:
        return Sampler(seed=seed)._sample_from_device(rows.clone(), [seq(i, temperature=1.0) for i in range(64)])

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_async_scheduling_keeps_biases_and_allowed_lists_on_the_device() -> None:
    """Under async scheduling (``Sampler.choose``, here on CPU tensors as a GPU runs it), a row
    with a ``logit_bias`` or an ``allowed_token_ids`` list is deferrable: neither reads the
    output, whose last token is still in flight. Its greedy token is the one the bias or the
    list leaves on top, and a sampled row draws only allowed tokens; rows whose adjustments read
    the output (penalties, ``min_tokens``, bad words) still wait for the read-back."""
    top, second = (int(t) for t in torch.topk(LOGITS, 2).indices)
    low = int(LOGITS.argmin())
    seqs = [
        seq(0, temperature=0.0, logit_bias=((top, -100.0),)),
        seq(1, temperature=0.0, allowed_token_ids=(low, second)),
        seq(2, temperature=0.0, logit_bias=((low, 100.0),)),
        seq(3, temperature=1.0, allowed_token_ids=(low, 5)),
        seq(4, temperature=0.0),
    ]
    assert all(device_sampling.deferrable(s) for s in seqs)
    for held in ({"frequency_penalty": 0.5}, {"min_tokens": 2}, {"bad_words_token_ids": ((3,),)}, {"repetition_penalty": 1.2}):
        assert not device_sampling.deferrable(seq(temperature=0.0, **held))
    sampler = Sampler()
    draws = [sampler._choose_on_device(LOGITS.repeat(5, 1), seqs).tolist() for _ in range(40)]
    assert {tuple(d[:3]) for d in draws} == {(second, second, low)}
    assert {d[3] for d in draws} <= {low, 5} and {d[4] for d in draws} == {top}
    assert sampler.results(draws[0], seqs)[:3] == [(second, None), (second, None), (low, None)]


def test_a_deferred_row_whose_adjustment_fails_gets_its_message_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure applying the biases fails only the rows that asked for them, through the token
    in flight's failure code: :meth:`Sampler.results` gives those rows the message, the others
    their tokens."""
    from loraplane.serving.engine import sampler as sampler_module

    def broken(*args: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(sampler_module, "apply_penalties", broken)
    seqs = [seq(0, temperature=0.0), seq(1, temperature=0.0, logit_bias=((3, 5.0),))]
    sampler = Sampler()
    tokens = sampler._choose_on_device(LOGITS.repeat(2, 1), seqs).tolist()
    assert tokens[0] == int(LOGITS.argmax()) and tokens[1] == device_sampling.NOT_FINITE
    good, failure = sampler.results(tokens, seqs)
    assert good == (tokens[0], None)
    assert not isinstance(failure, tuple) and "penalties failed: RuntimeError: boom" in failure.message


def test_two_steps_in_flight_give_each_failure_back_in_launch_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """With async scheduling a sequence's next step launches before its last is read back, so
    one sequence can have a failure kept for each: each read-back gets its own step's message,
    oldest first, and nothing is left behind."""
    from loraplane.serving.engine import sampler as sampler_module

    messages = iter(["first", "second"])

    def broken(*args: Any) -> None:
        raise RuntimeError(next(messages))

    monkeypatch.setattr(sampler_module, "apply_penalties", broken)
    seqs = [seq(0, temperature=0.0, logit_bias=((3, 5.0),))]
    sampler = Sampler()
    step_1 = sampler._choose_on_device(LOGITS.repeat(1, 1), seqs).tolist()
    step_2 = sampler._choose_on_device(LOGITS.repeat(1, 1), seqs).tolist()
    (one,) = sampler.results(step_1, seqs)
    (two,) = sampler.results(step_2, seqs)
    assert not isinstance(one, tuple) and one.message.endswith("RuntimeError: first")
    assert not isinstance(two, tuple) and two.message.endswith("RuntimeError: second")
    assert sampler.deferred_failures == {}
