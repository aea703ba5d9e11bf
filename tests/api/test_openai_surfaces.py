"""What ordinary OpenAI clients send, through the official client: batched prompts, n > 1,
penalties and biases, structured output, stop strings in streams, log-probabilities as OpenAI
shows them, nulls and answers sent back as turns, context-length errors and vLLM's tokenizer
routes."""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from engine_helpers import metered_app
from transformers import AutoTokenizer

from loraplane.serving.http.loopback import serve_app

APPS: dict[str, object] = {}
PROMPTS = ["the quick brown fox", "a platform team", "serves many fine-tunes"]
CHOICE_SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "tone": {"enum": ["calm", "loud"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["ok", "tone", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory) -> Iterator[tuple[str, Path]]:
    app, usage = metered_app(tiny_llama, {"qv4": tiny_adapters["qv4"]}, tmp_path_factory.mktemp("surfaces"))
    with serve_app(app) as url:
        APPS[url] = app
        yield url, usage


@pytest.fixture
def client(server: tuple[str, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def _base(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_a_list_of_prompts_gives_one_choice_each_in_order(client: openai.OpenAI) -> None:
    batch = client.completions.create(model="qv4", prompt=PROMPTS, max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    singles = [client.completions.create(model="qv4", prompt=p, max_tokens=6, temperature=0) for p in PROMPTS]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    ids = client.completions.create(model="qv4", prompt=[[5, 17, 42], [9, 9]], max_tokens=3, temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    one = client.completions.create(model="qv4", prompt=[5, 17, 42], max_tokens=3, temperature=0)
    assert one.choices[0].text == ids.choices[0].text


def test_n_samples_are_indexed_distinct_reproducible_and_bill_the_prompt_once(client: openai.OpenAI, server) -> None:
    kwargs = {"model": "qv4", "prompt": PROMPTS[:2], "max_tokens": 8, "temperature": 1.0, "seed": 11, "n": 3,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    first = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == list(range(6))
    texts = [c.text for c in first.choices]
    assert len(set(texts[:3])) > 1  # the samples of one prompt differ
    assert [c.text for c in client.completions.create(**kwargs).choices] == texts  # and a seed reproduces them all
    single = client.completions.create(model="qv4", prompt=PROMPTS[0], max_tokens=8)
    single2 = client.completions.create(model="qv4", prompt=PROMPTS[1], max_tokens=8)
    assert first.usage.prompt_tokens == single.usage.prompt_tokens + single2.usage.prompt_tokens
    assert first.usage.completion_tokens == 6 * 8
    # One usage record for the request, its prompts counted once, every choice's completion.
    _, usage = server
    records = [json.loads(line) for f in sorted(usage.glob("*.jsonl*")) for line in f.read_text().splitlines() if line]
    mine = [r for r in records if r["request_id"] == first.id]
    assert len(mine) == 1 and mine[0]["completion_tokens"] == 48 and mine[0]["prompt_tokens"] == first.usage.prompt_tokens


def test_n_streamed_interleaves_choices_that_add_up_to_the_plain_answer(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "tell me about adapters"}]
    kwargs = {"model": _base(client), "messages": messages, "max_tokens": 10, "temperature": 0.9, "seed": 5, "n": 2}
    plain = client.chat.completions.create(**kwargs)
    text: dict[int, str] = defaultdict(str)
    finished: dict[int, str | None] = {}
    roles = set()
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add(choice.index)
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert dict(text) == {c.index: c.message.content for c in plain.choices}
    assert set(finished) == roles == {0, 1}


def test_penalties_and_bias_are_applied(client: openai.OpenAI) -> None:
    base = {"model": "qv4", "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "logprobs": 0,
            "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}}  # fmt: skip
    plain = client.completions.create(**base).choices[0].logprobs.tokens
    penalised = client.completions.create(**base, frequency_penalty=2.0, presence_penalty=2.0).choices[0].logprobs.tokens
    assert len(set(plain)) < len(plain) and len(set(penalised)) == len(penalised)  # it loops; penalised, it does not
    biased = client.completions.create(**base, logit_bias={"77": 100}).choices[0].logprobs.tokens
    assert len(set(biased)) == 1 and len(biased) == 24
    assert biased[0] == "token_id:77"
    repeated = client.completions.create(**{**base, "extra_body": {**base["extra_body"], "repetition_penalty": 1.8}})
    assert repeated.choices[0].logprobs.tokens != plain


@pytest.mark.parametrize(
    ("field", "value"),
    [("frequency_penalty", 2.5), ("presence_penalty", -2.5), ("logit_bias", {"77": 101}), ("logit_bias", {"x": 1}),
     ("logit_bias", {"999999": 1}), ("n", 17), ("repetition_penalty", 0), ("min_tokens", -1), ("prompt", []),
     ("prompt", ["ok", ""]), ("response_format", {"type": "json_schema"}), ("suffix", "x"), ("best_of", 2),
     ("logit_bias", {"²": 1}), ("logit_bias", {"01": 60, "1": 60}), ("repetition_penalty", 1e-40),
     ("prompt_logprobs", 21), ("prompt_logprobs", -1), ("allowed_token_ids", []), ("allowed_token_ids", [999999]),
     ("priority", 1), ("max_tokens", "2"), ("temperature", "0.5"), ("echo", 1), ("n", True), ("stream", "false")],
)  # fmt: skip
def test_bad_values_are_a_400_naming_the_field(server, field: str, value: object) -> None:
    body = {"model": "qv4", "prompt": "hi", "max_tokens": 2, field: value}
    r = httpx.post(f"{server[0]}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (
        field in error["message"]
        or (error["param"] or "").startswith(field)
        or (field == "logit_bias" and "token" in error["message"])
    )


def test_documented_openai_fields_that_change_nothing_are_accepted(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=_base(client), messages=[{"role": "user", "content": "hi"}], max_completion_tokens=2,
        user="u-1", metadata={"team": "search"}, store=False, service_tier="auto", modalities=["text"],
        safety_identifier="hashed-u-1", prompt_cache_key="support-bot", extra_body={"priority": 0},
    )  # fmt: skip
    assert out.choices[0].message.content is not None


def test_json_schema_output_validates_and_mixes_with_plain_requests(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": CHOICE_SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "judge this"}]
    out = client.chat.completions.create(model="qv4", messages=messages, max_tokens=40, temperature=1.0, seed=2, n=4,
                                         response_format=fmt)  # fmt: skip
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), CHOICE_SCHEMA)
        assert choice.finish_reason == "stop"
    # Where the schema allows fewer tokens than top_logprobs asks, the others show as -9999.0 (JSON has
    # no -inf; this was a 500 before).
    scored = client.chat.completions.create(model="qv4", messages=messages, max_tokens=40, temperature=0, logprobs=True,
                                            top_logprobs=5, response_format=fmt)  # fmt: skip
    jsonschema.validate(json.loads(scored.choices[0].message.content), CHOICE_SCHEMA)
    assert -9999.0 in [t.logprob for e in scored.choices[0].logprobs.content for t in e.top_logprobs]
    anything = client.completions.create(model=_base(client), prompt="{", max_tokens=60, temperature=0,
                                         extra_body={"response_format": {"type": "json_object"}})  # fmt: skip
    text = anything.choices[0].text
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # the tiny model may not close its object in 60 tokens; what it wrote is still a JSON prefix
        assert text.startswith("{")


def test_a_schema_the_library_cannot_compile_is_a_400_with_its_message(server) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    r = httpx.post(f"{server[0]}/v1/completions", json={"model": "qv4", "prompt": "hi", "response_format": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "nope" in r.json()["error"]["message"]


def test_a_stop_string_never_reaches_a_stream(client: openai.OpenAI) -> None:
    """A stop string picked from the middle of the greedy answer: the stream stops before it, and
    no chunk carries its beginning."""
    kwargs = {"model": "qv4", "prompt": PROMPTS[1], "max_tokens": 30, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kwargs).choices[0].text
    assert len(full) > 12
    stop = full[8:12]
    cut = full[: full.find(stop)]
    chunks = [c.choices[0].text for c in client.completions.create(**kwargs, stop=[stop], stream=True) if c.choices]
    assert "".join(chunks) == cut
    sent = ""
    for piece in chunks:
        sent += piece
        assert cut.startswith(sent)  # nothing sent was taken back


def test_streamed_log_probabilities_add_up_to_the_plain_ones(client: openai.OpenAI) -> None:
    kwargs = {"model": "qv4", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "logprobs": 2, "n": 2}
    plain = client.completions.create(**kwargs)
    tokens: dict[int, list[str]] = defaultdict(list)
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            tokens[choice.index] += choice.logprobs.tokens if choice.logprobs else []
    assert dict(tokens) == {c.index: c.logprobs.tokens for c in plain.choices}
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model="qv4", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=1
    )
    streamed = [
        entry.token
        for chunk in client.chat.completions.create(
            model="qv4", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=1, stream=True
        )
        for choice in chunk.choices
        if choice.logprobs and choice.logprobs.content
        for entry in choice.logprobs.content
    ]
    assert streamed == [entry.token for entry in chat.choices[0].logprobs.content]


def test_a_client_that_leaves_before_its_stream_starts_releases_every_choice(server, monkeypatch) -> None:
    """The client times out while its n=4 choices wait for their first tokens: the request's
    pending count, quota slot and sequences are released although no body byte was ever sent."""
    url, _ = server
    app = APPS[url]
    state = app.state.server  # type: ignore[attr-defined]
    engine = state.engine.engine
    real_step = engine.step

    def slow_step():  # type: ignore[no-untyped-def]
        time.sleep(0.05)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    body = {"model": "qv4", "prompt": PROMPTS[0] * 20, "max_tokens": 50, "n": 4, "stream": True, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.02))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (state.pending.total or engine.has_unfinished()):
        time.sleep(0.1)
    assert state.pending.total == 0 and not state.pending.by_tenant and not engine.has_unfinished()


def test_log_probabilities_carry_token_text_offsets_and_bytes(client: openai.OpenAI, tiny_llama: Path) -> None:
    """Tokens as text (" the", never the vocabulary's "Ġthe"), each one's ``text_offset`` in the
    choice's text (streamed or not), and in chat each token's own bytes: a byte that is only part
    of a character shows as U+FFFD and keeps its byte, so a client can join the pieces."""
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    word = next(i for piece, i in sorted(tok.get_vocab().items()) if piece.startswith("Ġ") and len(piece) >= 3)
    text = tok.decode([word])
    kwargs = {"model": "qv4", "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0, "logprobs": 1,
              "logit_bias": {str(word): 100}, "extra_body": {"ignore_eos": True}}  # fmt: skip
    plain = client.completions.create(**kwargs).choices[0]
    assert plain.text == text * 3 and plain.logprobs.tokens == [text] * 3
    assert plain.logprobs.text_offset == [0, len(text), 2 * len(text)]
    offsets = [
        o for c in client.completions.create(**kwargs, stream=True) if c.choices for o in c.choices[0].logprobs.text_offset
    ]
    assert offsets == plain.logprobs.text_offset
    lead = tok.convert_tokens_to_ids("Ã")  # byte 0xC3: the first byte of "é"
    chat = client.chat.completions.create(
        model="qv4", messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0, logprobs=True,
        top_logprobs=1, logit_bias={str(lead): 100}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for entry in chat.choices[0].logprobs.content:
        assert (entry.token, entry.bytes) == ("\ufffd", [0xC3])
        assert [(t.token, t.bytes) for t in entry.top_logprobs] == [("\ufffd", [0xC3])]


def test_nulls_developer_turns_and_answers_sent_back_are_accepted(server, client: openai.OpenAI) -> None:
    """OpenAI's schema marks optional fields nullable, and a conversation sends the client's own
    answer object back as a turn (its tool and refusal fields null): all of it is a plain request."""
    first = client.chat.completions.create(model="qv4", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    body = {
        "model": "qv4", "max_tokens": 3, "temperature": None, "top_p": None, "n": None, "stream": None, "seed": None,
        "stop": None, "logprobs": None, "top_logprobs": None, "presence_penalty": None, "response_format": None,
        "messages": [{"role": "developer", "content": "answer briefly"}, {"role": "user", "content": "hi", "name": None},
                     first.choices[0].message.model_dump(), {"role": "user", "content": "and then?"}],
    }  # fmt: skip
    r = httpx.post(f"{server[0]}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > first.usage.prompt_tokens
    no_tools = {**body, "tools": [], "tool_choice": "none", "parallel_tool_calls": False, "n": 2, "best_of": 2}
    assert httpx.post(f"{server[0]}/v1/chat/completions", json=no_tools).status_code == 200  # a framework with no tools
    for bad, field in (
        ({**body, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # "auto": no parser
        ({**body, "tool_choice": "required"}, "tool_choice"),
        ({**body, "n": 2, "best_of": 3}, "best_of"),
        ({**body, "top_logprobs": 2}, "top_logprobs"),
        ({**body, "messages": [{"role": "user", "content": None}]}, "content"),
        ({**body, "model": None}, "model"),
        ({**body, "messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "c"}]}]}, "tool_calls"),
    ):
        r = httpx.post(f"{server[0]}/v1/chat/completions", json=bad)
        assert r.status_code == 400 and field in r.json()["error"]["message"] + (r.json()["error"]["param"] or ""), r.text


def test_context_overflow_is_openais_context_length_exceeded(client: openai.OpenAI) -> None:
    """Clients match OpenAI's code and wording ("maximum context length") to trim and retry."""
    for kwargs in ({"prompt": "the quick brown fox", "max_tokens": 250}, {"prompt": "the quick brown fox " * 200}):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="qv4", **kwargs)
        assert err.value.code == "context_length_exceeded" and "maximum context length is 256 tokens" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="qv4", messages=[{"role": "user", "content": "fox " * 400}])
    assert err.value.code == "context_length_exceeded"


def test_vllms_tokenizer_routes_match_what_generation_counts(server, client: openai.OpenAI, tiny_llama: Path) -> None:
    url = server[0]
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    counted = httpx.post(f"{url}/tokenize", json={"model": "qv4", "prompt": PROMPTS[0], "return_token_strs": True}).json()
    assert counted["tokens"] == tok.encode(PROMPTS[0]) and counted["count"] == len(counted["tokens"])
    assert counted["max_model_len"] == 256 and counted["token_strs"] == tok.convert_ids_to_tokens(counted["tokens"])
    back = httpx.post(f"{url}/detokenize", json={"model": "qv4", "tokens": counted["tokens"]}).json()
    assert back["prompt"] == tok.decode(counted["tokens"])
    messages = [{"role": "user", "content": "tell me about adapters"}]
    chat = httpx.post(f"{url}/tokenize", json={"model": "qv4", "messages": messages}).json()
    used = client.chat.completions.create(model="qv4", messages=messages, max_tokens=1).usage.prompt_tokens
    assert chat["count"] == used
    assert httpx.post(f"{url}/tokenize", json={"model": "nope", "prompt": "hi"}).status_code == 404
    r = httpx.post(f"{url}/detokenize", json={"model": "qv4", "tokens": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert {m.id: m.model_extra["max_model_len"] for m in client.models.list().data} == {_base(client): 256, "qv4": 256}
    assert httpx.get(f"{url}/version").json()["version"]


def test_vllms_chat_template_controls(server) -> None:
    """A developer turn is templated as a system turn; continue_final_message goes on from the
    last assistant turn; chat_template_kwargs reach the template, but never its call's own
    arguments (a template of the caller's own among them)."""
    url = server[0]

    def rendered(**body: object) -> httpx.Response:
        return httpx.post(f"{url}/tokenize", json={"model": "qv4", **body})

    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the quick"}]
    as_system = rendered(messages=[{"role": "system", "content": "be brief"}, *turns]).json()["tokens"]
    assert rendered(messages=[{"role": "developer", "content": "be brief"}, *turns]).json()["tokens"] == as_system
    going_on = rendered(messages=turns, add_generation_prompt=False, continue_final_message=True).json()["tokens"]
    text = httpx.post(f"{url}/detokenize", json={"model": "qv4", "tokens": going_on}).json()["prompt"]
    assert text.endswith("assistant\nthe quick")
    assert rendered(messages=turns, continue_final_message=True).status_code == 400  # with add_generation_prompt
    assert (
        rendered(messages=turns, chat_template_kwargs={"enable_thinking": False}).json()["tokens"]
        == rendered(messages=turns).json()["tokens"]
    )
    r = rendered(messages=turns, chat_template_kwargs={"tokenize": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "qv4", "messages": turns, "chat_template_kwargs": {"chat_template": "{{ raise_exception('no') }}"}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_vllms_text_controls_reach_the_engine(client: openai.OpenAI) -> None:
    kwargs = {"model": "qv4", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0}
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[4:6]
    kept = client.completions.create(**kwargs, stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == full[: full.find(stop) + len(stop)]
    # min_p 1 keeps only the most likely token: sampling at any temperature is then greedy.
    sampled = client.completions.create(**{**kwargs, "temperature": 1.5}, extra_body={"ignore_eos": True, "min_p": 1.0})
    assert sampled.choices[0].text == full


def test_echo_returns_the_prompt_and_its_log_probabilities_as_harnesses_score_them(server, client: openai.OpenAI) -> None:
    """OpenAI's echo: the prompt before the completion; with logprobs, the prompt's entries first
    (the first null). With max_tokens 0 the prompt alone, as lm-evaluation-harness asks to score a
    text: the entries of a greedy answer, sent back as part of a prompt, are the log-probabilities
    the answer was generated with."""
    plain = client.completions.create(model="qv4", prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})  # fmt: skip
    echoed = client.completions.create(model="qv4", prompt=PROMPTS[0], max_tokens=5, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text
    prompt_ids = httpx.post(f"{server[0]}/tokenize", json={"model": "qv4", "prompt": PROMPTS[0]}).json()["tokens"]
    answer_ids = [int(t.removeprefix("token_id:")) for t in plain.choices[0].logprobs.tokens]
    as_ids = {"model": "qv4", "prompt": prompt_ids + answer_ids, "max_tokens": 0, "echo": True, "logprobs": 1,
              "extra_body": {"return_tokens_as_token_ids": True}}  # fmt: skip
    scored = client.completions.create(**as_ids)
    choice = scored.choices[0]
    assert choice.finish_reason == "length" and choice.text == PROMPTS[0] + plain.choices[0].text
    lp = choice.logprobs
    assert lp.tokens == [f"token_id:{t}" for t in prompt_ids + answer_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    tail = lp.token_logprobs[len(prompt_ids) :]
    assert tail == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    streamed = list(client.completions.create(**as_ids, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    assert [t for c in streamed if c.choices for t in c.choices[0].logprobs.tokens] == lp.tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="qv4", prompt=PROMPTS[0], max_tokens=0)
    assert "max_tokens" in err.value.message


def test_vllms_prompt_logprobs_score_each_prompt_token_with_its_rank(server, client: openai.OpenAI, tiny_llama: Path) -> None:
    """vLLM's ``prompt_logprobs``: per completion choice (once per chat response), a map per prompt
    token from token id to its log-probability, rank and text, the prompt's token first and then
    the k most likely, the first token null. A greedy answer sent back as part of a prompt scores
    rank 1 at each of its tokens, with the log-probabilities it was generated with."""
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    plain = client.completions.create(model="qv4", prompt=PROMPTS[1], max_tokens=5, temperature=0, logprobs=0,
                                      extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})  # fmt: skip
    prompt_ids = httpx.post(f"{server[0]}/tokenize", json={"model": "qv4", "prompt": PROMPTS[1]}).json()["tokens"]
    answer_ids = [int(t.removeprefix("token_id:")) for t in plain.choices[0].logprobs.tokens]
    ids = prompt_ids + answer_ids
    body = {"model": "qv4", "prompt": ids, "max_tokens": 1, "n": 2, "prompt_logprobs": 2, "echo": True, "logprobs": 1}
    r = httpx.post(f"{server[0]}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    first, second = (c["prompt_logprobs"] for c in r.json()["choices"])
    assert first == second and len(first) == len(ids) and first[0] is None
    for token, entry in zip(ids[1:], first[1:], strict=True):
        keys = list(entry)
        assert keys[0] == str(token) and len(entry) in (2, 3)  # the prompt's token, then the top 2
        ranked = sorted((v["rank"], v["logprob"]) for k, v in entry.items() if k != str(token) or v["rank"] <= 2)
        assert [rank for rank, _ in ranked] == [1, 2] and ranked[0][1] >= ranked[1][1]
        assert entry[str(token)]["rank"] >= 1 and entry[str(token)]["decoded_token"] == tok.decode([token])
    echo = r.json()["choices"][0]["logprobs"]  # echo's own entries keep logprobs=1's one alternative
    assert all(t is None or len(t) <= 2 for t in echo["top_logprobs"])
    assert [e[str(t)]["logprob"] for t, e in zip(ids[1:], first[1:], strict=True)] == echo["token_logprobs"][1 : len(ids)]
    answer = first[len(prompt_ids) :]
    assert [e[str(t)]["rank"] for t, e in zip(answer_ids, answer, strict=True)] == [1] * len(answer_ids)
    assert [e[str(t)]["logprob"] for t, e in zip(answer_ids, answer, strict=True)] == pytest.approx(
        plain.choices[0].logprobs.token_logprobs, abs=1e-4
    )
    several = {"model": "qv4", "prompt": [ids, ids[:3]], "max_tokens": 1, "prompt_logprobs": 0}
    per_prompt = httpx.post(f"{server[0]}/v1/completions", json=several).json()["choices"]
    assert [len(c["prompt_logprobs"]) for c in per_prompt] == [len(ids), 3]
    # The same tokens scored in another batch: the same entries, the log-probabilities within float
    # rounding (a GEMM over more rows may round differently: seen on an AVX2-only CPU in float32).
    alone = [{str(t): first[i][str(t)]} for i, t in enumerate(ids[1:3], start=1)]
    batched = per_prompt[1]["prompt_logprobs"][1:]
    assert [{k: {**v, "logprob": None} for k, v in e.items()} for e in batched] == [
        {k: {**v, "logprob": None} for k, v in e.items()} for e in alone
    ]
    assert [v["logprob"] for e in batched for v in e.values()] == pytest.approx(
        [v["logprob"] for e in alone for v in e.values()], abs=1e-4
    )
    chat = httpx.post(f"{server[0]}/v1/chat/completions", json={"model": "qv4", "max_tokens": 2, "prompt_logprobs": 0,
                                                                 "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert chat.status_code == 200, chat.text
    scored = chat.json()["prompt_logprobs"]
    assert len(scored) == chat.json()["usage"]["prompt_tokens"] and scored[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in scored[1:])
    streamed = {**body, "n": 1, "stream": True}
    refused = httpx.post(f"{server[0]}/v1/completions", json=streamed)
    assert refused.status_code == 400 and "prompt_logprobs" in refused.json()["error"]["message"]


def test_vllms_return_token_ids_give_the_prompt_and_answer_as_ids(server, client: openai.OpenAI, tiny_llama: Path) -> None:
    """vLLM's ``return_token_ids``: each choice's generated ids (which decode to its text) and the
    prompt's ids (what ``/tokenize`` gives), on completions in each choice and on chat once per
    response; streamed, the prompt's ids come in the first chunk and each chunk carries its new ids,
    which add up to the plain answer's."""
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    url = server[0]
    ids = httpx.post(f"{url}/tokenize", json={"model": "qv4", "prompt": PROMPTS[2]}).json()["tokens"]
    body = {"model": "qv4", "prompt": PROMPTS[2], "max_tokens": 6, "n": 2, "seed": 5, "return_token_ids": True,
            "ignore_eos": True}  # fmt: skip
    plain = httpx.post(f"{url}/v1/completions", json=body).json()["choices"]
    assert [c["prompt_token_ids"] for c in plain] == [ids, ids]
    assert all(len(c["token_ids"]) == 6 and tok.decode(c["token_ids"]) == c["text"] for c in plain)
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    got: dict[int, list[int]] = defaultdict(list)
    for chunk in chunks:
        (c,) = chunk["choices"]
        assert c.get("prompt_token_ids", ids) == ids and ("prompt_token_ids" in c) == (c["index"] not in got)
        got[c["index"]] += c["token_ids"]
    assert [got[0], got[1]] == [c["token_ids"] for c in plain]

    chat = {"model": "qv4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True}  # fmt: skip
    answer = httpx.post(f"{url}/v1/chat/completions", json=chat).json()
    templated = httpx.post(f"{url}/tokenize", json={"model": "qv4", "messages": chat["messages"]}).json()["tokens"]
    assert answer["prompt_token_ids"] == templated and len(templated) == answer["usage"]["prompt_tokens"]
    (choice,) = answer["choices"]
    assert tok.decode(choice["token_ids"]) == choice["message"]["content"] and len(choice["token_ids"]) == 4
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**chat, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == templated and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**chat, "stream": True, "n": 2, "seed": 1}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    heads = [c["choices"][0]["index"] for c in chunks if "prompt_token_ids" in c]
    assert sorted(heads) == [0, 1] and all(c["prompt_token_ids"] == templated for c in chunks if "prompt_token_ids" in c)
    without = httpx.post(f"{url}/v1/chat/completions", json={**chat, "return_token_ids": False}).json()
    assert "prompt_token_ids" not in without and "token_ids" not in without["choices"][0]


def test_vllms_chat_echo_puts_the_assistants_last_turn_before_its_answer(client: openai.OpenAI) -> None:
    """vLLM's chat ``echo``: going on from an assistant turn, the answer starts with that turn's
    text, streamed or not; after a user turn there is nothing to echo."""
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the quick"}]
    kwargs = {"model": "qv4", "messages": turns, "max_tokens": 4, "temperature": 0}
    going_on = {"ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True}
    answer = client.chat.completions.create(**kwargs, extra_body=going_on).choices[0].message.content
    echoed = client.chat.completions.create(**kwargs, extra_body={**going_on, "echo": True}).choices[0].message.content
    assert answer and echoed == "the quick" + answer
    stream = client.chat.completions.create(**kwargs, stream=True, extra_body={**going_on, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == echoed
    after_user = {**kwargs, "messages": turns[:1]}
    plain = client.chat.completions.create(**after_user, extra_body={"ignore_eos": True}).choices[0].message.content
    assert (
        client.chat.completions.create(**after_user, extra_body={"ignore_eos": True, "echo": True}).choices[0].message.content
        == plain
    )


def test_vllms_structured_outputs_hold_the_text_to_a_regex_a_choice_or_a_grammar(server, client: openai.OpenAI) -> None:
    """vLLM's ``structured_outputs``: the sampled text (at temperature 1, so not the model's own
    habit) matches the regular expression, is one of the choices, is a sentence of the grammar
    (GBNF or Lark) or a document of the JSON schema given as text; each ends with ``stop``."""
    url = server[0]
    kwargs = {"model": "qv4", "prompt": PROMPTS[0], "max_tokens": 48, "temperature": 1.0, "seed": 3, "n": 3}
    gbnf = 'root ::= ("yes" | "no") " " [0-9] [0-9]?'
    lark = 'start: WORD "," WORD\nWORD: /[a-c]{2}/'
    cases = [
        ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        ({"choice": ["calm", "loud", "very loud"]}, lambda t: t in ("calm", "loud", "very loud")),
        ({"grammar": gbnf}, lambda t: re.fullmatch(r"(yes|no) [0-9][0-9]?", t)),
        ({"grammar": lark}, lambda t: re.fullmatch(r"[a-c]{2},[a-c]{2}", t)),
        ({"json": json.dumps(CHOICE_SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), CHOICE_SCHEMA) is None),
        ({"json": CHOICE_SCHEMA}, lambda t: jsonschema.validate(json.loads(t), CHOICE_SCHEMA) is None),
    ]
    for constraint, holds in cases:
        r = client.completions.create(**kwargs, extra_body={"structured_outputs": constraint})
        for choice in r.choices:
            assert choice.finish_reason == "stop" and holds(choice.text), (constraint, choice.text)
    # Any object: the random model's keys may run past max_tokens; what it wrote is then an object's start.
    anything = client.completions.create(**kwargs, extra_body={"structured_outputs": {"json_object": True}})
    for choice in anything.choices:
        assert isinstance(json.loads(choice.text), dict) if choice.finish_reason == "stop" else choice.text.startswith("{")
    chat = client.chat.completions.create(model="qv4", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          extra_body={"structured_outputs": {"choice": ["up", "down"]}})  # fmt: skip
    assert chat.choices[0].message.content in ("up", "down")
    for bad, words in [
        ({"regex": "(", "choice": ["a"]}, "exactly one"),
        ({"regex": "("}, "regular expression"),
        ({"grammar": "root ::= nothing"}, "grammar"),
        ({"json": "{not json"}, "JSON"),
        ({"structural_tag": "x"}, "structural_tag"),
    ]:
        r = httpx.post(f"{url}/v1/completions", json={**kwargs, "structured_outputs": bad})
        assert r.status_code == 400 and words in r.json()["error"]["message"], (bad, r.text)
        assert (r.json()["error"]["param"] or "").startswith("structured_outputs"), r.text
    both = {**kwargs, "structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}
    r = httpx.post(f"{url}/v1/completions", json=both)
    assert r.status_code == 400 and "structured_outputs" in r.json()["error"]["message"]


def test_vllms_truncate_prompt_tokens_keeps_the_prompts_last_tokens_or_first(server) -> None:
    """vLLM's ``truncate_prompt_tokens``: a prompt longer than the context is answered from its last
    k tokens (the ids the model was given, echoed and counted), where without it the request is a
    400; chat truncates the templated conversation; -1 keeps the context; more than the context
    is a 400 naming the field."""
    url = server[0]
    long = " ".join(PROMPTS * 60)  # far beyond the fixture's 256-token context
    whole = httpx.post(f"{url}/tokenize", json={"model": "qv4", "prompt": long}).json()["tokens"]
    assert len(whole) > 256
    body = {"model": "qv4", "prompt": long, "max_tokens": 2, "return_token_ids": True, "echo": True}
    refused = httpx.post(f"{url}/v1/completions", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(f"{url}/v1/completions", json={**body, "truncate_prompt_tokens": 9}).json()
    assert r["choices"][0]["prompt_token_ids"] == whole[-9:] and r["usage"]["prompt_tokens"] == 9
    kept = httpx.post(f"{url}/detokenize", json={"model": "qv4", "tokens": whole[-9:]}).json()["prompt"]
    assert r["choices"][0]["text"].startswith(kept)
    ids = httpx.post(f"{url}/v1/completions", json={**body, "prompt": whole[:40], "truncate_prompt_tokens": 5}).json()
    assert ids["choices"][0]["prompt_token_ids"] == whole[35:40]
    # vLLM's truncation_side "right" keeps the first tokens instead, text or ids.
    for prompt in (long, whole[:40]):
        first = httpx.post(f"{url}/v1/completions", json={**body, "prompt": prompt, "truncate_prompt_tokens": 6,
                                                          "truncation_side": "right"}).json()  # fmt: skip
        assert first["choices"][0]["prompt_token_ids"] == whole[:6]
    context = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert context.status_code == 400 and context.json()["error"]["code"] == "context_length_exceeded"  # 256 + 1
    messages = [{"role": "user", "content": long}]
    templated = httpx.post(f"{url}/tokenize", json={"model": "qv4", "messages": messages}).json()["tokens"]
    chat = {"model": "qv4", "messages": messages, "max_tokens": 2, "return_token_ids": True, "truncate_prompt_tokens": 7}
    assert httpx.post(f"{url}/v1/chat/completions", json=chat).json()["prompt_token_ids"] == templated[-7:]
    right = {**chat, "truncation_side": "right"}
    assert httpx.post(f"{url}/v1/chat/completions", json=right).json()["prompt_token_ids"] == templated[:7]
    for bad in (0, 257, -2):
        r = httpx.post(f"{url}/v1/completions", json={**body, "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def _a_one_token_word(tokenizer, ids: list[int]) -> tuple[int, str]:
    """The first of ``ids`` that is a whole word as vLLM reads ``bad_words``: the word's own
    tokens, or (when that is one token too) its tokens after a space; and where it stands."""
    for k, token in enumerate(ids):
        word = tokenizer.decode([token]).strip()
        bare = tokenizer.encode(word, add_special_tokens=False) if word else []
        spaced = tokenizer.encode(" " + word, add_special_tokens=False) if word else []
        if bare == [token] or (len(bare) == 1 and spaced == [token]):
            return k, word
    raise AssertionError("the answer has no one-token word")


def test_bad_words_are_never_written_where_the_answer_would_write_them(client, server, tiny_llama: Path) -> None:
    """vLLM's ``bad_words``: a word the greedy answer writes, banned, is not written; the answer
    is the same up to where it stood and goes another way there. Through the official client's
    ``extra_body`` on chat too. An empty or blank word, or too many, is a 400 naming the field."""
    url = server[0]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    body = {"model": "qv4", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    alone = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["token_ids"]
    k, word = _a_one_token_word(tokenizer, alone)
    banned = httpx.post(f"{url}/v1/completions", json={**body, "bad_words": [word]})
    assert banned.status_code == 200, banned.text
    ids = banned.json()["choices"][0]["token_ids"]
    assert ids[:k] == alone[:k] and alone[k] not in ids
    messages = [{"role": "user", "content": PROMPTS[2]}]
    chat = dict(model="qv4", messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    text = client.chat.completions.create(**chat).choices[0].message.content
    answer = tokenizer.encode(text, add_special_tokens=False)
    k, word = _a_one_token_word(tokenizer, answer)
    other = client.chat.completions.create(**{**chat, "extra_body": {"ignore_eos": True, "bad_words": [word]}})
    assert other.choices[0].message.content != text
    for bad in ([""], [" \n"], ["w"] * 65, ["\u4e00" * 30]):  # the last: 90 byte-level tokens
        r = httpx.post(f"{url}/v1/completions", json={**body, "bad_words": bad})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("bad_words"), r.text


def test_allowed_token_ids_hold_the_answer_and_ruled_out_tokens_show_as_vllm_shows_them(server, tiny_llama: Path) -> None:
    """vLLM's ``allowed_token_ids`` through the API: a sampled answer draws only from the list;
    the alternatives its log-probabilities show beyond the list are -9999.0 (JSON has no -inf;
    vLLM's value), streamed or not, on completions and chat. Settings that leave no token at all
    (end-of-sequence alone before min_tokens) are the caller's 400, not token 0."""
    url, allowed = server[0], [40, 41, 90]
    body = {"model": "qv4", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 1.0, "seed": 4, "logprobs": 5,
            "allowed_token_ids": allowed, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert set(choice["token_ids"]) <= set(allowed)
    shown = [v for top in choice["logprobs"]["top_logprobs"] for v in top.values()]
    assert -9999.0 in shown and all(v >= -9999.0 for v in shown)
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: {")]
    assert lines and not any("Infinity" in line for line in lines)
    streamed = [t for line in lines for t in json.loads(line[6:])["choices"][0]["token_ids"]]
    assert streamed == choice["token_ids"]
    chat = {"model": "qv4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True,
            "top_logprobs": 5, "allowed_token_ids": allowed, "ignore_eos": True}  # fmt: skip
    answer = httpx.post(f"{url}/v1/chat/completions", json=chat)
    assert answer.status_code == 200, answer.text
    entries = answer.json()["choices"][0]["logprobs"]["content"]
    assert all(e["logprob"] > -9999.0 and min(t["logprob"] for t in e["top_logprobs"]) == -9999.0 for e in entries)
    eos = AutoTokenizer.from_pretrained(str(tiny_llama)).eos_token_id
    none_left = httpx.post(
        f"{url}/v1/completions", json={**body, "allowed_token_ids": [eos], "min_tokens": 2, "ignore_eos": False}
    )
    assert none_left.status_code == 400 and none_left.json()["error"]["code"] == "no_token_allowed", none_left.text
    assert "allowed_token_ids" in none_left.json()["error"]["message"]
