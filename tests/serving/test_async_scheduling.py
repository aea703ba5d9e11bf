"""Async scheduling launches step N+1 before step N's tokens are read back: the tokens in flight
feed the next step on the device, and stops are seen a step late. None of that may change what a
request gets back: every answer must equal the synchronous engine's, token for token, under
chunked prefill, a sequence cap, preemption and the length limits."""

from __future__ import annotations

import random

import pytest
from engine_helpers import tiny_engine

from loraplane.serving.engine.llm_engine import LLMEngine
from loraplane.serving.engine.outputs import RequestOutput
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.engine.sequence import FinishReason

MIX = ["qv4", "all8", None, "mlp16", "ku2", "all8", None, "qv4"]
SETTINGS = {
    "one-batch": {},
    "chunked-prefill": {"max_num_batched_tokens": 7},
    "seq-cap": {"max_num_seqs": 3},
    "preemption": {"num_kv_blocks": 24, "block_size": 4, "max_model_len": 64},
}


def _requests() -> list[tuple[list[int], str | None]]:
    rng = random.Random(11)
    return [([rng.randrange(3, 320) for _ in range(rng.randrange(2, 30))], a) for a in MIX]


def _run(engine: LLMEngine, requests, params) -> tuple[list[RequestOutput], list[RequestOutput]]:
    """(each request's final output, every output the steps reported on the way)."""
    ids = [engine.add_request(p, sp, adapter=a) for (p, a), sp in zip(requests, params, strict=True)]
    final: dict[str, RequestOutput] = {}
    seen: list[RequestOutput] = []
    while engine.has_unfinished():
        for out in engine.step():
            seen.append(out)
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids], seen


def _params(reference: list[list[int]]) -> list[SamplingParams]:
    """Greedy requests that end every way: on a stop token met mid-answer (the one the plain
    run gave fourth), on ``max_tokens`` of different lengths, on EOS; one with a penalty, whose
    steps must run synchronously."""
    out = []
    for i, tokens in enumerate(reference):
        stop = [tokens[3]] if i % 2 == 0 else []
        out.append(
            SamplingParams(
                max_tokens=6 + i, temperature=0, stop_token_ids=stop, ignore_eos=i != 3,
                repetition_penalty=1.3 if i == 5 else 1.0,
            )
        )  # fmt: skip
    return out


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_async_answers_equal_sync(tiny_llama, tiny_adapters, settings, tmp_path) -> None:
    requests = _requests()
    plain = tiny_engine(tiny_llama, tmp_path / "plain", tiny_adapters, **settings)
    reference, _ = _run(plain, requests, [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * len(requests))
    params = _params([o.token_ids for o in reference])

    sync_engine = tiny_engine(tiny_llama, tmp_path / "sync", tiny_adapters, **settings)
    want, _ = _run(sync_engine, requests, params)
    engine = tiny_engine(tiny_llama, tmp_path / "async", tiny_adapters, async_scheduling=True, **settings)
    launches = 0
    launch = engine.runner.launch

    def counted(*args, **kwargs):
        nonlocal launches
        launches += 1
        return launch(*args, **kwargs)

    engine.runner.launch = counted  # type: ignore[method-assign]
    got, seen = _run(engine, requests, params)

    assert launches > 0, "no step was launched ahead"
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert g.token_ids == w.token_ids, f"request {i} ({MIX[i]})"
        assert (g.finish_reason, g.text) == (w.finish_reason, w.text), f"request {i}"
    assert {o.finish_reason for o in got} >= {FinishReason.STOP, FinishReason.LENGTH}
    # No placeholder of a token in flight ever reaches a caller, and every block came back.
    assert all(t >= 0 for o in seen for t in o.token_ids)
    assert engine.in_flight is None
    assert engine.blocks.num_free == engine.blocks.num_blocks
    if "num_kv_blocks" in settings:
        assert engine.scheduler.num_preemptions > 0


def test_biases_and_allowed_lists_launch_ahead(tiny_llama, tmp_path) -> None:
    """A ``logit_bias`` or an ``allowed_token_ids`` list reads no output, so its rows are launched
    ahead like plain ones (no step waits for a read-back), with the synchronous engine's tokens;
    a penalty beside them still runs its steps synchronously."""
    requests = [(list(range(40, 52)), None), ([7, 8, 9], None), (list(range(100, 108)), None)]
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reference, _ = _run(tiny_engine(tiny_llama, tmp_path / "plain"), requests, [plain] * 3)
    first = reference[0].token_ids[0]
    params = [
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias=((first, -100.0), (5, 30.0))),
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, allowed_token_ids=(11, 12, 13)),
        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logit_bias=((9, 2.0),)),
    ]
    for penalised in (False, True):
        if penalised:
            params[2] = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, frequency_penalty=0.5)
        want, _ = _run(tiny_engine(tiny_llama, tmp_path / f"sync{penalised}"), requests, params)
        engine = tiny_engine(tiny_llama, tmp_path / f"async{penalised}", async_scheduling=True)
        calls = {"run": 0, "launch": 0}
        for name in calls:
            original = getattr(engine.runner, name)

            def counted(*args, _name=name, _original=original, _calls=calls, **kwargs):
                _calls[_name] += 1
                return _original(*args, **kwargs)

            setattr(engine.runner, name, counted)
        got, _ = _run(engine, requests, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert got[0].token_ids[0] != first and set(got[1].token_ids) <= {11, 12, 13}
        assert calls["launch"] > 0
        assert (calls["run"] > 0) == penalised, calls


def test_async_on_the_graphs_path(tiny_llama, tiny_adapters, tmp_path) -> None:
    """The CUDA code path through Triton's interpreter: decode graphs and prompt graphs (replayed
    on the CPU), whose static input ids the tokens in flight are written into after their copy."""
    requests = [(list(range(40, 60)), "qv4"), ([7, 8, 9], None), (list(range(100, 112)), "all8")]
    params = [
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
    ]
    settings = {"kernel_backend": "triton", "max_num_batched_tokens": 16}
    want, _ = _run(tiny_engine(tiny_llama, tmp_path / "sync", tiny_adapters, **settings), requests, params)
    engine = tiny_engine(tiny_llama, tmp_path / "async", tiny_adapters, async_scheduling=True, **settings)
    got, _ = _run(engine, requests, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    graphs, prompt_graphs = engine.runner.graphs, engine.runner.prompt_graphs
    assert graphs is not None and graphs.graphs and prompt_graphs is not None and prompt_graphs.graphs


def test_length_limit_and_abort_in_flight(tiny_llama, tmp_path) -> None:
    """A request whose token in flight reaches ``max_model_len`` gets no further step (its next
    position is past the model's context), and one aborted while a token is in flight ends with
    only the tokens it was given."""
    engine = tiny_engine(tiny_llama, tmp_path, async_scheduling=True, max_model_len=32)
    full = engine.add_request(list(range(5, 25)), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    cut = engine.add_request(list(range(30, 40)), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    outputs: dict[str, RequestOutput] = {}
    for _ in range(4):
        for out in engine.step():
            outputs[out.request_id] = out
    assert engine.in_flight is not None
    engine.abort(cut)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    assert outputs[full].finish_reason is FinishReason.LENGTH and len(outputs[full].token_ids) == 12
    aborted = engine.requests.get(cut)
    assert aborted is None  # forgotten once finished
    assert all(t >= 0 for t in outputs[cut].token_ids)
    assert engine.blocks.num_free == engine.blocks.num_blocks
    # A request held at its length limit gets no step past it: 12 tokens, 12 launches (the prompt's
    # and 11 decodes), none at position ``max_model_len``.
    launch, launches = engine.runner.launch, []
    engine.runner.launch = lambda *a, **k: (launches.append(1), launch(*a, **k))[1]  # type: ignore[method-assign]
    (alone,) = engine.generate([list(range(5, 25))], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert len(alone.token_ids) == 12 and len(launches) == 12
    engine.runner.launch = launch  # type: ignore[method-assign]
    # A lone request that stops on a token: the step launched past its stop is dropped, not left in flight.
    (first,) = engine.generate([[40, 41, 42]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    stop = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[first.token_ids[2]])
    (stopped,) = engine.generate([[40, 41, 42]], stop)
    end = first.token_ids.index(first.token_ids[2]) + 1
    assert stopped.token_ids == first.token_ids[:end] and stopped.finish_reason is FinishReason.STOP
    assert engine.in_flight is None


def test_a_sibling_sample_shares_the_prompt_in_flight(tiny_llama, tmp_path) -> None:
    """An ``n`` > 1 sibling (``after``) is admitted once its leader's prompt is computed and
    shares those blocks through the prefix cache; under async scheduling the blocks are keyed
    when the prompt's step is launched, not a step later when it is read back."""
    prompt = list(range(50, 90))  # ten blocks of four
    hits = []
    for overlapped in (False, True):
        engine = tiny_engine(tiny_llama, tmp_path / str(overlapped), async_scheduling=overlapped)
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        engine.add_request(prompt, params, request_id="lead")
        engine.add_request(prompt, params, request_id="follow", after="lead")
        outputs: dict[str, RequestOutput] = {}
        while engine.has_unfinished():
            outputs |= {o.request_id: o for o in engine.step()}
        assert outputs["lead"].token_ids == outputs["follow"].token_ids
        hits.append((engine.blocks.prefix_hits, outputs["follow"].num_cached_tokens))
    assert hits[1] == hits[0] and hits[0][0] > 0


def test_a_sequence_preempted_with_its_token_in_flight_waits_for_it(tiny_llama, tmp_path) -> None:
    """Preempted (as fair-share preemption does) while its last token is in flight, a sequence
    is recomputed only once that token is read back: its recompute, chunked, would otherwise
    stop short of the token in flight and fail the whole step. Its answer is unchanged."""
    prompts = [list(range(10, 30)), list(range(40, 45))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    settings = {"max_num_batched_tokens": 7, "enable_prefix_caching": False}  # the recompute is chunked, not cached
    want = tiny_engine(tiny_llama, tmp_path / "sync", **settings).generate(prompts, params)
    engine = tiny_engine(tiny_llama, tmp_path / "async", async_scheduling=True, **settings)
    ids = [engine.add_request(p, params) for p in prompts]
    final: dict[str, RequestOutput] = {}
    preempted = False
    while engine.has_unfinished():
        final |= {o.request_id: o for o in engine.step() if o.finished}
        seq = engine.requests.get(ids[0])
        if not preempted and seq is not None and seq.awaits_token and len(seq.output_token_ids) >= 3:
            engine.scheduler.running.remove(seq)
            engine.scheduler._preempt(seq)
            preempted = True
    assert preempted
    assert [final[i].error for i in ids] == [None, None]
    assert [final[i].token_ids for i in ids] == [o.token_ids for o in want]


def test_a_failed_launch_fails_its_step_alone(tiny_llama, tmp_path) -> None:
    """A launch that raises fails the sequences of its step, after the step before is read back:
    one that stopped there ends with its stop, and every request gets one final output."""
    engine = tiny_engine(tiny_llama, tmp_path, async_scheduling=True)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    (ref,) = engine.generate([[40, 41, 42]], greedy)
    end = ref.token_ids.index(ref.token_ids[2])  # the stop is met at this output position
    stopping = engine.add_request([40, 41, 42], SamplingParams(**{**greedy.__dict__, "stop_token_ids": [ref.token_ids[2]]}))
    running = engine.add_request([7, 8, 9, 10], greedy)
    launch, calls = engine.runner.launch, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == end + 2:  # the step launched while the stop token is in flight
            raise RuntimeError("injected")
        return launch(*args, **kwargs)

    engine.runner.launch = failing  # type: ignore[method-assign]
    finals: list[RequestOutput] = []
    while engine.has_unfinished():
        finals += [o for o in engine.step() if o.finished]
    assert sorted(o.request_id for o in finals) == sorted([stopping, running])
    by_id = {o.request_id: o for o in finals}
    assert by_id[stopping].finish_reason is FinishReason.STOP and by_id[stopping].error is None
    assert by_id[stopping].token_ids == ref.token_ids[: end + 1]
    assert by_id[running].error_code == "engine_error" and "injected" in by_id[running].error


def test_async_refuses_interjection(tiny_llama, tmp_path) -> None:
    with pytest.raises(ValueError, match="fair_interjection"):
        tiny_engine(tiny_llama, tmp_path, async_scheduling=True, fair_scheduling=True, fair_interjection=True)


def test_the_openai_api_answers_alike_with_async_scheduling(tiny_llama, tiny_adapters, tmp_path) -> None:
    """Through the server and the official client, concurrent requests (streamed and not, on
    adapters and the base, a stop string, a seeded sample) get the answers the synchronous
    engine gives; a seeded sample repeats."""
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from engine_helpers import Built

    from loraplane.serving.api.app import create_app
    from loraplane.serving.http.loopback import serve_app

    adapters = {"qv4": tiny_adapters["qv4"], "all8": tiny_adapters["all8"]}
    calls = [
        {"model": "qv4", "prompt": "the quick brown fox", "max_tokens": 12},
        {"model": "all8", "prompt": "a platform team serves", "max_tokens": 9, "stream": True},
        {"model": tiny_llama.name, "prompt": "many fine tunes of one base", "max_tokens": 14},
        {"model": "all8", "prompt": "the quick brown fox", "max_tokens": 16, "stop": ["e"]},
        {"model": "qv4", "prompt": "seeded", "max_tokens": 8, "temperature": 0.9, "seed": 7},
        {"model": "qv4", "prompt": "seeded", "max_tokens": 8, "temperature": 0.9, "seed": 7},
    ]

    def answers(async_scheduling: bool) -> list[tuple[str, str | None]]:
        built = Built(
            lambda: tiny_engine(tiny_llama, tmp_path / str(async_scheduling), adapters, async_scheduling=async_scheduling)
        )
        with serve_app(create_app(built)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

            def call(kwargs: dict) -> tuple[str, str | None]:
                kwargs = {"temperature": 0, **kwargs}
                if kwargs.get("stream"):
                    chunks = [c for c in client.completions.create(**kwargs) if c.choices]
                    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
                out = client.completions.create(**kwargs)
                return out.choices[0].text, out.choices[0].finish_reason

            with ThreadPoolExecutor(len(calls)) as pool:
                return list(pool.map(call, calls))

    sync, overlapped = answers(False), answers(True)
    assert overlapped == sync  # the seeded samples too: on a CPU both draw on the host
    assert overlapped[3][1] == "stop" and "e" not in overlapped[3][0]
    assert overlapped[4] == overlapped[5] and overlapped[4][0]
