"""Function calls as OpenAI clients ask for them: a named function or ``tool_choice: "required"``,
answered with ``message.tool_calls`` whose arguments parse and match the function's schema (on a
random tiny model, so only the constraint can make them), streamed or not; the calls and the tools'
results sent back as turns, and the tools handed to a chat template that describes them."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from engine_helpers import tiny_engine
from pydantic import BaseModel, ConfigDict

from loraplane.serving.api.app import create_app
from loraplane.serving.api.openai.tools.calls import CallStream, whole_calls
from loraplane.serving.api.openai.tools.parsers import TOOL_PARSERS, AutoAnswer
from loraplane.serving.http.loopback import serve_app

# A template that describes tools and writes calls, as Qwen's and Hermes' do (the tiny model's
# own template knows only roles and text).
TOOLS_TEMPLATE = (
    "{% if tools %}<s>system\n{% for t in tools %}{{ t['function']['name'] }}: "
    "{{ t['function']['parameters']['properties'] | list | join(',') }}\n{% endfor %}</s>\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}\n"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}call {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}{% endfor %}"
    "{% elif m['role'] == 'tool' %}result of {{ m['tool_call_id'] }}: {{ m['content'] }}"
    "{% else %}{{ m['content'] }}{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["paris", "oslo"]},
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
# A schema with named parts, as pydantic writes them: its references resolve only from its own root.
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "$defs": {"Hour": {"type": "integer", "minimum": 0, "maximum": 23}},
            "type": "object",
            "properties": {"hour": {"$ref": "#/$defs/Hour"}, "loud": {"type": "boolean"}},
            "required": ["hour", "loud"],
            "additionalProperties": False,
        },
    },
}
NO_PARAMETERS = {"type": "function", "function": {"name": "ping"}}
EMPTY_PARAMETERS = {"type": "function", "function": {"name": "reset", "parameters": {}}}  # {} would allow any value
TOOLS = [WEATHER, ALARM, NO_PARAMETERS, EMPTY_PARAMETERS]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in TOOLS}
ASK = [{"role": "user", "content": "what is the weather in paris?"}]


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("tools")
    model = root / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    (model / "chat_template.jinja").unlink(missing_ok=True)  # newer transformers keep the template here
    app = create_app(lambda: tiny_engine(model, root / "cache", {}, max_model_len=512))
    with serve_app(app) as url:
        yield url


@pytest.fixture(scope="module")
def auto_server(tiny_llama: Path, tmp_path_factory) -> Iterator[str]:
    """A server that reads Hermes' tool-call format back (``--tool-call-parser hermes``)."""
    root = tmp_path_factory.mktemp("auto-tools")
    app = create_app(lambda: tiny_engine(tiny_llama, root / "cache", {}, max_model_len=512), tool_call_parser="hermes")
    with serve_app(app) as url:
        yield url


@pytest.fixture
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


class Reset(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hard: bool


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def _valid(name: str, arguments: str) -> dict[str, Any]:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def test_a_named_function_is_called_with_arguments_that_match_its_schema(client: openai.OpenAI) -> None:
    for name in ("get_weather", "set_alarm", "ping", "reset"):
        answer = client.chat.completions.create(
            model=_model(client), messages=ASK, tools=TOOLS, tool_choice=_named(name), temperature=1.0, seed=3, n=3,
            max_tokens=60,
        )  # fmt: skip
        for choice in answer.choices:
            assert choice.finish_reason == "stop" and choice.message.content is None  # as OpenAI's forced function
            (call,) = choice.message.tool_calls
            assert call.type == "function" and call.id.startswith("chatcmpl-tool-") and call.function.name == name
            _valid(name, call.function.arguments)
        assert len({c.message.tool_calls[0].id for c in answer.choices}) == 3


def test_required_makes_one_or_more_calls_of_the_tools_offered(client: openai.OpenAI) -> None:
    seen: set[str] = set()
    for seed in range(4):
        answer = client.chat.completions.create(
            model=_model(client), messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
            max_tokens=120, n=2,
        )  # fmt: skip
        for choice in answer.choices:
            if choice.finish_reason == "length":  # cut short: the calls it finished, each whole
                assert all(_valid(c.function.name, c.function.arguments) is not None for c in choice.message.tool_calls)
                continue
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert choice.message.tool_calls
            for call in choice.message.tool_calls:
                _valid(call.function.name, call.function.arguments)
                seen.add(call.function.name)
    assert seen <= set(SCHEMAS) and seen
    single = client.chat.completions.create(
        model=_model(client), messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        temperature=1.0, seed=5, n=4, max_tokens=120,
    )  # fmt: skip
    assert all(len(c.message.tool_calls) == 1 for c in single.choices if c.finish_reason == "tool_calls")


def _streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[list[dict[str, str]], str | None]:
    """The calls a stream makes, put together by index as the official client's helpers do."""
    calls: dict[int, dict[str, str]] = {}
    reason = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        reason = choice.finish_reason or reason
        for part in choice.delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += part.id or ""
            call["name"] += (part.function.name or "") if part.function else ""
            call["arguments"] += (part.function.arguments or "") if part.function else ""
    return [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("tool_choice", [_named("get_weather"), "required"])
def test_a_streamed_call_adds_up_to_the_plain_answer(client: openai.OpenAI, tool_choice: Any) -> None:
    kwargs = {"model": _model(client), "messages": ASK, "tools": TOOLS, "tool_choice": tool_choice,
              "temperature": 0.0, "max_tokens": 120}  # fmt: skip
    plain = client.chat.completions.create(**kwargs).choices[0]
    calls, reason = _streamed(client, **kwargs)
    assert reason == plain.finish_reason
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in plain.message.tool_calls
    ]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls)


def test_calls_and_results_sent_back_reach_the_template(client: openai.OpenAI, server: str) -> None:
    """The answer's message, sent back as the official client gives it, then the tool's result:
    the template writes the call's arguments as an object and the result beside its call's id."""
    answer = client.chat.completions.create(
        model=_model(client), messages=ASK, tools=TOOLS, tool_choice=_named("get_weather"), max_tokens=60
    )
    message = answer.choices[0].message
    turns = [*ASK, message.model_dump(), {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]
    body = {"model": _model(client), "messages": turns, "tools": TOOLS}
    r = httpx.post(f"{server}/tokenize", json=body)
    assert r.status_code == 200, r.text
    detok = httpx.post(f"{server}/detokenize", json={"model": _model(client), "tokens": r.json()["tokens"]})
    prompt = detok.json()["prompt"]
    arguments = json.loads(message.tool_calls[0].function.arguments)
    assert f"call get_weather {json.dumps(arguments)}" in prompt  # an object, not its JSON text quoted
    assert f"result of {message.tool_calls[0].id}: sunny" in prompt
    assert "get_weather: city,unit,days\nset_alarm: hour,loud\nping: \n" in prompt  # the tools, described
    follow_up = client.chat.completions.create(
        model=_model(client), messages=turns, max_tokens=4, tools=TOOLS, tool_choice="none"
    )
    assert follow_up.choices[0].message.tool_calls is None and follow_up.choices[0].finish_reason in ("stop", "length")


def test_tool_requests_that_cannot_be_served_are_a_400_naming_the_field(server: str) -> None:
    body = {"model": httpx.get(f"{server}/v1/models").json()["data"][0]["id"], "messages": ASK, "max_tokens": 4}
    conflicting = {**ALARM, "function": {**ALARM["function"], "name": "other", "parameters": {
        **ALARM["function"]["parameters"], "$defs": {"Hour": {"type": "string"}}}}}  # fmt: skip
    for bad, field in (
        ({**body, "tools": TOOLS}, "tool_choice"),  # "auto" by default: no parser for the model's own format
        ({**body, "tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
        ({**body, "tool_choice": "required"}, "tool_choice"),
        ({**body, "tools": TOOLS, "tool_choice": _named("nope")}, "tool_choice"),
        ({**body, "tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
        ({**body, "tools": [ALARM, conflicting], "tool_choice": "required"}, "tools"),
        ({**body, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "$defs": [1]}}}],
          "tool_choice": "required"}, "tools"),
        ({**body, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
          "tool_choice": _named("f")}, "tools"),
        ({**body, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({**body, "tools": [{"type": "custom", "custom": {"name": "f"}}], "tool_choice": "none"}, "tools"),
        ({**body, "messages": [{"role": "tool", "content": "sunny"}]}, "tool_call_id"),
        ({**body, "messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "tool_calls"),
        ({**body, "messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]}, "tool_calls"),
    ):  # fmt: skip
        r = httpx.post(f"{server}/v1/chat/completions", json=bad)
        assert r.status_code == 400, (bad, r.text)
        error = r.json()["error"]
        assert field in error["message"] + (error["param"] or ""), r.text


def test_langchain_structured_output_and_forced_tools(server: str) -> None:
    """LangChain's ``with_structured_output(method="function_calling")`` forces a named function;
    ``bind_tools(tool_choice="any")`` sends ``"required"`` (one call: ``parallel_tool_calls``)."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, ConfigDict, Field

    class Weather(BaseModel):
        model_config = ConfigDict(extra="forbid")  # the schema closed, or a random model writes keys forever
        city: Literal["paris", "oslo"]
        days: int = Field(ge=1, le=7)

    model = httpx.get(f"{server}/v1/models").json()["data"][0]["id"]
    chat = ChatOpenAI(base_url=f"{server}/v1", api_key="unused", model=model, max_tokens=120, temperature=0.7, max_retries=0)
    assert isinstance(chat.with_structured_output(Weather, method="function_calling").invoke("weather?"), Weather)
    message = chat.bind_tools([Weather], tool_choice="any", parallel_tool_calls=False).invoke("weather?")
    assert message.tool_calls and all(Weather(**call["args"]) for call in message.tool_calls)


# What a Hermes-format model writes when it calls a tool after a word of text: the tiny model is
# made to write exactly this by a regular expression (vLLM's structured_outputs), so that the
# parser, not the model, is what is tested.
HERMES_ANSWER = (
    'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris", "unit": "c", "days": 2}}\n</tool_call>'
)


def _written(text: str) -> dict[str, Any]:
    return {"structured_outputs": {"regex": re.escape(text)}}


def test_auto_reads_the_models_own_calls_back(auto_server: str) -> None:
    """``tool_choice: "auto"`` on a server with a parser: the text before the call is the content,
    the call is a tool call, ``finish_reason`` is ``tool_calls``; streamed, no piece of the call's
    markup reaches the content, and the calls come in the last chunk, whole."""
    client = openai.OpenAI(base_url=f"{auto_server}/v1", api_key="unused", max_retries=0)
    kwargs = {"model": _model(client), "messages": ASK, "tools": TOOLS, "max_tokens": 200, "extra_body": _written(HERMES_ANSWER)}
    answer = client.chat.completions.create(**kwargs).choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content == "Checking."
    (call,) = answer.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "paris",
        "unit": "c",
        "days": 2,
    }
    content, reason, calls = "", None, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        assert "<" not in (delta.content or "")  # the markup is held back, never streamed as text
        content += delta.content or ""
        calls += delta.tool_calls or []
        reason = chunk.choices[0].finish_reason or reason
    assert (content, reason) == ("Checking.", "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in calls] == [(call.function.name, call.function.arguments)]
    # Text that only looks like the markup's start is text, streamed in the end.
    plain = {**kwargs, "extra_body": _written("see <tool")}
    text = client.chat.completions.create(**plain).choices[0]
    assert (text.message.content, text.message.tool_calls, text.finish_reason) == ("see <tool", None, "stop")
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **plain))
    assert streamed == "see <tool"
    # The Responses API reads the same answer as a message and a function call.
    response = client.responses.create(
        model=_model(client), input="weather?", tools=[{"type": "function", **WEATHER["function"]}], max_output_tokens=200,
        extra_body=_written(HERMES_ANSWER),
    )  # fmt: skip
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.output_text == "Checking." and response.output[1].name == "get_weather"


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("hermes", "plain text", "plain text", []),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', None, [("f", '{"a": 1}')]),
        ("hermes", 'Hi <tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}',
         "Hi ", [("f", "{}"), ("g", "{}")]),
        ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        ("llama3_json", '{"name": "f", "parameters": {"a": 1}}', None, [("f", '{"a": 1}')]),
        ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": [1]}}', None,
         [("f", "{}"), ("g", '{"b": [1]}')]),
        ("llama3_json", "The answer is {not a call}", "The answer is {not a call}", []),
        ("llama3_json", '{"name": "f"', '{"name": "f"', []),
        ("pythonic", '[get_weather(city="paris", days=3), ping()]', None,
         [("get_weather", '{"city": "paris", "days": 3}'), ("ping", "{}")]),
        ("pythonic", '<|python_start|>[f(a=[1, {"b": None}], c=True, d=-2.5)]<|python_end|>', None,
         [("f", '{"a": [1, {"b": null}], "c": true, "d": -2.5}')]),
        ("pythonic", "[f(x=__import__('os').system('id'))]", "[f(x=__import__('os').system('id'))]", []),  # not a literal
        ("pythonic", "[f(1)]", "[f(1)]", []),  # a positional argument
        ("pythonic", "[f(x=1e999)]", "[f(x=1e999)]", []),  # no JSON number
        ("pythonic", "[1, 2] are numbers", "[1, 2] are numbers", []),
        ("pythonic", "call f(x=1) later", "call f(x=1) later", []),
        ("pythonic", "[" * 5000, "[" * 5000, []),  # nested past the parser
        ("pythonic", '[f(a="é", b="\\ud800")]', None, [("f", '{"a": "\\u00e9", "b": "\\ud800"}')]),  # no UTF-8 for b
        ("pythonic", '[f(a="é")]', None, [("f", '{"a": "é"}')]),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>',
         '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>', []),  # no JSON number
    ],
)  # fmt: skip
def test_a_parser_splits_text_from_calls_and_streams_only_what_cannot_be_a_call(
    parser: str, text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    """The parsers on their own: a whole answer split into its text and calls; the text a stream
    shows at each prefix of the answer only grows, never holds markup that became a call, and
    ends at the whole answer's text."""
    read = TOOL_PARSERS[parser]()
    assert read.parse(text) == (content, calls)
    shown = [read.visible(text[:i]) for i in range(len(text) + 1)]
    final = read.answered(text, True)
    assert all(a == b[: len(a)] for a, b in itertools.pairwise([*shown, final]))
    assert final == (content or "")
    # A stream keeps one watch over the growing answer: it shows what a fresh look would.
    auto = AutoAnswer(read)
    streamed = [auto.shown(0, text[:i], False) for i in range(len(text) + 1)]
    assert list(itertools.accumulate(streamed, initial="")) == ["", *shown]
    assert shown[-1] + auto.shown(0, text, True) == final


class _Counted(str):
    """A string that counts the characters its readers look at (``find`` from where it starts,
    ``endswith`` by the suffix, a slice or an index by what it returns)."""

    looked = 0

    def find(self, sub: Any, start: Any = None, end: Any = None) -> int:  # type: ignore[override]
        _Counted.looked += len(self) - (start or 0)
        return super().find(sub, start, end)

    def endswith(self, suffix: Any, *args: Any) -> bool:  # type: ignore[override]
        _Counted.looked += len(suffix)
        return super().endswith(suffix, *args)

    def __getitem__(self, key: Any) -> str:  # type: ignore[override]
        got = super().__getitem__(key)
        _Counted.looked += len(got)
        return got


PATHOLOGICAL = [
    "<tool_call>x" + " " * 200_000 + "x",  # Python's regex backtracked over the blanks: ~9 minutes
    "<tool_call>" * 20_000,
    "Thinking" + " " * 200_000 + "<tool_c",
    " " * 200_000 + "<|python_tag|>",
    " " * 200_000 + "[f(x=1)]",
]


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("text", PATHOLOGICAL, ids=range(len(PATHOLOGICAL)))
def test_a_long_answer_is_read_and_streamed_in_time_linear_in_its_length(parser: str, text: str) -> None:
    """A tenant chooses what the model writes, and the parsers run on the server's event loop:
    an answer is read whole in one pass (in a thread, so a regression fails here instead of
    hanging), and a stream of it, 1,000 characters a chunk, looks at each character a bounded
    number of times, where a look at the whole answer per chunk is ~100 times its length."""
    read = TOOL_PARSERS[parser]()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(read.parse, text).result(timeout=30)
    auto, chunk = AutoAnswer(read), 1000
    prefixes = [_Counted(text[:i]) for i in range(0, len(text), chunk)]
    _Counted.looked = 0
    shown = "".join(auto.shown(0, prefix, False) for prefix in prefixes)
    assert _Counted.looked <= 3 * len(text) + 64 * len(prefixes)
    assert shown + auto.shown(0, text, True) == read.answered(text, True)


REQUIRED_ANSWERS = [
    '[{"name": "f", "parameters": {"a": 1}}]',
    ' [ {"parameters": {"s": "a } ] \\" [ {", "n": [1, {"b": 1e999}]}, "name": "g"} ,{"name": "f", "parameters": {}} ] ',
    '[{"name": "f", "parameters": {"t": "\\\\"}}, {"name": "h", "parameters": {"u": "\\u00e9"}}',  # not closed
    '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"b":',  # cut inside a call
    '[{"name": "f", "parameters": {"a": 1}} {"name": "g", "parameters": {}}]',  # no comma: the reading ends
    '{"name": "f", "parameters": {}}',  # not an array
    '[{"name": "f", "parameters": {}},]',  # a comma before the end
    "[]",
]


@pytest.mark.parametrize("text", REQUIRED_ANSWERS)
def test_required_calls_are_read_as_written_whatever_the_chunks(text: str) -> None:
    """``"required"``'s array read by ``CallStream``: in any chunks (one character each, or
    random pieces), the calls come once each, in order, when their object closes, with their
    arguments exactly as the model wrote them; the array is closed only by its own bracket."""
    expected, closed = whole_calls(text)
    for name, arguments in expected:
        assert arguments in text and isinstance(json.loads(arguments.replace("1e999", "1")), dict) and name
    rng = random.Random(0)
    for cuts in ([*range(len(text))], sorted(rng.sample(range(len(text)), k=min(7, len(text)))), []):
        stream, got = CallStream(), []
        for a, b in itertools.pairwise([0, *cuts, len(text)]):
            got += stream.feed(text[a:b])
        assert got == [(i, *call) for i, call in enumerate(expected)] and stream.closed == closed
    assert [len(whole_calls(t)[0]) for t in REQUIRED_ANSWERS] == [1, 2, 2, 1, 1, 0, 1, 0]
    assert [whole_calls(t)[1] for t in REQUIRED_ANSWERS] == [True, True, False, False, False, False, False, False]


def test_answers_from_the_clients_own_helpers_are_sent_back_as_they_come(client: openai.OpenAI) -> None:
    """``parse`` adds ``parsed_arguments`` to each call and ``parsed`` to the message; the stream
    helper keeps each call's ``index``. OpenAI's own examples append these messages to the
    conversation as they are."""
    tool = openai.pydantic_function_tool(Reset, name="reset")
    kwargs = {"model": _model(client), "messages": ASK, "tools": [tool], "tool_choice": _named("reset"), "max_tokens": 60,
              "temperature": 0}  # fmt: skip
    parsed = client.chat.completions.parse(**kwargs).choices[0].message
    assert isinstance(parsed.tool_calls[0].function.parsed_arguments, Reset)
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0].message
    assert streamed.tool_calls[0].function.arguments == parsed.tool_calls[0].function.arguments
    for message in (parsed, streamed):
        turns = [*ASK, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "done"}]
        follow_up = client.chat.completions.create(model=_model(client), messages=turns, max_tokens=2)  # type: ignore[arg-type]
        assert follow_up.choices[0].message.content is not None


def test_required_calls_cut_by_a_stop_string_do_not_end_as_tool_calls(client: openai.OpenAI) -> None:
    """A stop string that ends the answer before its array closes: ``stop``, with the calls that
    were whole (here none: the array's opening bracket is the stop)."""
    cut = client.chat.completions.create(
        model=_model(client), messages=ASK, tools=TOOLS, tool_choice="required", stop=["["], max_tokens=60
    ).choices[0]
    assert (cut.finish_reason, cut.message.tool_calls) == ("stop", [])


def test_responses_calls_reach_the_template_as_the_chat_turns_they_stand_for(client: openai.OpenAI) -> None:
    """A Responses conversation with a call and its result counts the tokens of the chat
    conversation with the same turns, on a template that writes calls and results: the call and
    its output reached the template as an assistant call and a tool turn."""
    arguments = '{"city": "oslo", "unit": "c", "days": 3}'
    items = [{"role": "user", "content": "weather?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
             {"type": "function_call_output", "call_id": "call_1", "output": "snow"}]  # fmt: skip
    tool = {"type": "function", **WEATHER["function"]}
    response = client.responses.create(model=_model(client), input=items, tools=[tool], tool_choice="none", max_output_tokens=2)
    turns = [{"role": "user", "content": "weather?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "snow"}]  # fmt: skip
    chat = client.chat.completions.create(model=_model(client), messages=turns, tools=TOOLS[:1], tool_choice="none", max_tokens=2)
    without_call = client.chat.completions.create(model=_model(client), messages=turns[:1], tools=TOOLS[:1],
                                                  tool_choice="none", max_tokens=2)  # fmt: skip
    assert response.usage.input_tokens == chat.usage.prompt_tokens > without_call.usage.prompt_tokens
