"""OpenAI's Responses API through the official client: text answers equal to the chat
completion the request stands for, streamed as OpenAI's typed events (and through the client's
own stream helper), structured output parsed by the client, function calls and their results
sent back, log-probabilities, usage, and the fields not served refused by name."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from engine_helpers import metered_app, tiny_engine
from pydantic import BaseModel, ConfigDict, Field

from loraplane.serving.api.app import create_app
from loraplane.serving.api.openai.responses.store import ResponseStore
from loraplane.serving.http.loopback import serve_app
from loraplane.serving.http.protocol.responses import ResponsesRequest
from loraplane.serving.http.tenants import TenantConfig, Tenants

ASK = "what is a LoRA adapter?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["paris", "oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}


class Verdict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ok: bool
    tone: Literal["calm", "loud"]
    score: int = Field(ge=0, le=9)


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory) -> Iterator[tuple[str, Path]]:
    app, usage = metered_app(tiny_llama, {"qv4": tiny_adapters["qv4"]}, tmp_path_factory.mktemp("responses"))
    with serve_app(app) as url:
        yield url, usage


@pytest.fixture
def client(server: tuple[str, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def test_a_text_answer_is_the_chat_completion_it_stands_for(client: openai.OpenAI) -> None:
    """``instructions`` and ``input`` are the chat's system and user turns: greedy, the same text
    and the same token counts, on an adapter."""
    answer = client.responses.create(model="qv4", instructions="be brief", input=ASK, max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(
        model="qv4", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": ASK}],
        max_completion_tokens=12, temperature=0,
    )  # fmt: skip
    assert answer.object == "response" and answer.id.startswith("resp_") and answer.model == "qv4"
    assert answer.store is True and answer.previous_response_id is None  # kept, as OpenAI's default
    assert answer.output_text == chat.choices[0].message.content
    (message,) = answer.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert answer.usage.total_tokens == answer.usage.input_tokens + answer.usage.output_tokens
    # reasoning.effort is chat's reasoning_effort, for the template (this one reads no such variable).
    effort = client.responses.create(
        model="qv4", instructions="be brief", input=ASK, max_output_tokens=12, temperature=0, reasoning={"effort": "low"}
    )
    assert effort.reasoning.effort == "low" and effort.output_text == answer.output_text
    as_chat = ResponsesRequest.model_validate({"model": "qv4", "input": ASK, "reasoning": {"effort": "high"}}).chat()
    assert as_chat.reasoning_effort == "high"
    if chat.choices[0].finish_reason == "length":  # cut at max_output_tokens, as OpenAI says it
        assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    else:
        assert answer.status == "completed" and answer.incomplete_details is None


def test_each_response_is_billed_once_as_the_responses_api(client: openai.OpenAI, server: tuple[str, Path]) -> None:
    """The usage record of a Responses request, streamed or not: one, under its own endpoint,
    with the tokens its ``usage`` reported."""
    plain = client.responses.create(model="qv4", input=ASK, max_output_tokens=5, extra_body={"ignore_eos": True})
    streamed = list(client.responses.create(model="qv4", input=ASK, max_output_tokens=4, stream=True))[-1].response
    time.sleep(0.2)  # the spool's flush interval
    records = [json.loads(line) for f in sorted(server[1].glob("*.jsonl*")) for line in f.read_text().splitlines() if line]
    for answer in (plain, streamed):
        (mine,) = [r for r in records if r["request_id"] == answer.id]
        assert (mine["endpoint"], mine["adapter"]) == ("/v1/responses", "qv4")
        assert (mine["prompt_tokens"], mine["completion_tokens"]) == (answer.usage.input_tokens, answer.usage.output_tokens)


def test_an_answer_cut_at_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    answer = client.responses.create(model="qv4", input=ASK, max_output_tokens=3, extra_body={"ignore_eos": True})
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert answer.usage.output_tokens == 3 and answer.output[0].status == "incomplete"


def test_a_stream_is_openais_typed_events_and_adds_up_to_the_plain_answer(client: openai.OpenAI) -> None:
    kwargs = {"model": "qv4", "input": ASK, "max_output_tokens": 12, "temperature": 0}
    plain = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if plain.status == "completed" else "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == plain.usage.output_tokens
    assert _through_helper(client, **kwargs).output_text == plain.output_text


def _through_helper(client: openai.OpenAI, **kwargs: object) -> openai.types.responses.Response:
    """The response as the client's stream helper puts it together (the helper checks each
    event's place: its output index, item and content part)."""
    with client.responses.stream(**kwargs) as stream:  # type: ignore[call-overload]
        last = list(stream)[-1]
    assert last.type in ("response.completed", "response.incomplete")
    return last.response


def test_structured_output_is_parsed_by_the_client(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model="qv4", input="judge this", text_format=Verdict, temperature=1.0, max_output_tokens=60)
    assert isinstance(parsed.output_parsed, Verdict)
    loose = client.responses.create(model="qv4", input="json please", text={"format": {"type": "json_object"}},
                                    max_output_tokens=60)  # fmt: skip
    if loose.status == "completed":
        assert isinstance(json.loads(loose.output_text), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_function_calls_and_their_results_sent_back(client: openai.OpenAI, stream: bool) -> None:
    kwargs = {"model": "qv4", "input": "weather in paris?", "tools": [WEATHER], "max_output_tokens": 80, "temperature": 1.0,
              "parallel_tool_calls": False}  # fmt: skip
    for tool_choice in ({"type": "function", "name": "get_weather"}, "required"):
        if stream:
            answer = _through_helper(client, tool_choice=tool_choice, **kwargs)
        else:
            answer = client.responses.create(tool_choice=tool_choice, **kwargs)
        calls = [item for item in answer.output if item.type == "function_call"]
        assert calls and all(c.name == "get_weather" and c.call_id for c in calls)
        for call in calls if answer.status == "completed" else calls[:-1]:
            jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    conversation = [{"role": "user", "content": "weather in paris?"}, *[c.model_dump() for c in calls],
                    *[{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls]]  # fmt: skip
    follow_up = client.responses.create(model="qv4", input=conversation, tools=[WEATHER], tool_choice="none", max_output_tokens=4)
    assert follow_up.output[0].type == "message" and follow_up.usage.input_tokens > answer.usage.input_tokens
    # And an earlier answer's message item, sent back as the client holds it.
    text = client.responses.create(model="qv4", input=ASK, max_output_tokens=4)
    again = [{"role": "user", "content": ASK}, *[m.model_dump() for m in text.output], {"role": "user", "content": "more"}]
    assert client.responses.create(model="qv4", input=again, max_output_tokens=4).output_text is not None


@pytest.mark.parametrize("stream", [False, True])
def test_previous_response_id_goes_on_from_the_stored_conversation(client: openai.OpenAI, stream: bool) -> None:
    """OpenAI's stored conversations: a response going on from another reads the same prompt as
    the whole conversation sent again (its instructions not carried over), greedy the same
    answer; a call and its result go on the same way. Streamed responses are kept too, and read
    back as the stream ended them."""
    first_kwargs = {"model": "qv4", "instructions": "be brief", "input": ASK, "max_output_tokens": 6, "temperature": 0}
    first = _through_helper(client, **first_kwargs) if stream else client.responses.create(**first_kwargs)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    kwargs = {"model": "qv4", "input": "and why?", "max_output_tokens": 6, "temperature": 0}
    going_on = client.responses.create(previous_response_id=first.id, **kwargs)
    turns = [{"role": "user", "content": ASK}, *[m.model_dump() for m in first.output], {"role": "user", "content": "and why?"}]
    whole = client.responses.create(**{**kwargs, "input": turns})
    assert going_on.previous_response_id == first.id and going_on.output_text == whole.output_text
    assert going_on.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    # OpenAI's list of what each was given, the conversation it went on from included: each item
    # with its id, the same id all along the chain; newest first unless asked, a page at a time.
    (asked,) = client.responses.input_items.list(first.id).data
    given = client.responses.input_items.list(going_on.id, order="asc").data
    assert [i.id for i in given] == [asked.id, first.output[0].id, given[2].id] and given[2].role == "user"
    assert [i.content[0].text for i in given] == [ASK, first.output_text, "and why?"]
    page = client.responses.input_items.list(going_on.id, limit=2)
    assert [i.id for i in page.data] == [given[2].id, given[1].id] and page.has_more
    rest = client.responses.input_items.list(going_on.id, limit=2, after=page.last_id)
    assert [i.id for i in rest.data] == [asked.id] and not rest.has_more
    # A chain: the third reads the first two turns through the second alone.
    third = client.responses.create(previous_response_id=going_on.id, **{**kwargs, "input": "go on"})
    again = [*turns, *[m.model_dump() for m in going_on.output], {"role": "user", "content": "go on"}]
    assert third.usage.input_tokens == client.responses.create(**{**kwargs, "input": again}).usage.input_tokens
    # A call kept, its result sent on its own.
    call = client.responses.create(model="qv4", input="weather?", tools=[WEATHER], max_output_tokens=60,
                                   tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    (made,) = call.output
    result = [{"type": "function_call_output", "call_id": made.call_id, "output": "sunny"}]
    after = client.responses.create(model="qv4", previous_response_id=call.id, input=result, tools=[WEATHER],
                                    tool_choice="none", max_output_tokens=4)  # fmt: skip
    sent = client.responses.create(model="qv4", input=[{"role": "user", "content": "weather?"}, made.model_dump(), *result],
                                   tools=[WEATHER], tool_choice="none", max_output_tokens=4)  # fmt: skip
    assert after.usage.input_tokens == sent.usage.input_tokens


def test_stored_responses_are_read_deleted_and_kept_only_when_asked(client: openai.OpenAI) -> None:
    kept = client.responses.create(model="qv4", input=ASK, max_output_tokens=4)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="qv4", input="more", previous_response_id=kept.id, max_output_tokens=4)
    error = refused.value.body
    assert error["code"] == "previous_response_not_found" and error["param"] == "previous_response_id"
    unkept = client.responses.create(model="qv4", input=ASK, max_output_tokens=4, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(unkept.id)


def test_a_tenant_cannot_read_continue_or_delete_anothers_response(tiny_llama: Path, tmp_path: Path) -> None:
    tenants = Tenants([TenantConfig(name="a", api_keys=["key-a"]), TenantConfig(name="b", api_keys=["key-b"])])
    app = create_app(lambda: tiny_engine(tiny_llama, tmp_path / "cache", {}, max_model_len=256), tenants=tenants)
    with serve_app(app) as url:
        a, b = (openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) for key in ("key-a", "key-b"))
        base = a.models.list().data[0].id
        mine = a.responses.create(model=base, input=ASK, max_output_tokens=4)
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.delete(mine.id)
        with pytest.raises(openai.BadRequestError):
            b.responses.create(model=base, input="more", previous_response_id=mine.id, max_output_tokens=4)
        assert a.responses.retrieve(mine.id).output_text == mine.output_text  # still there, untouched


def test_the_store_keeps_what_was_used_last_and_a_flood_pushes_out_its_own() -> None:
    """Bounded by count and bytes (of the JSON kept). When full, the tenant holding the most gives
    up its least recently used response, so one tenant's flood never empties a quieter one's."""
    store = ResponseStore(max_responses=4, max_bytes=20_000)
    body = lambda rid: {"id": rid, "output": []}  # noqa: E731
    for rid in ("r1", "r2", "r3"):
        assert store.put("t", body(rid), [{"role": "user", "content": rid}])
    assert store.get("t", "r1") is not None and store.get("u", "r1") is None  # r1 used: r2 is t's oldest
    store.put("quiet", body("q1"), [])
    store.put("t", body("r4"), [])  # five: t holds the most, its oldest goes
    assert [store.get("t", r) is not None for r in ("r1", "r2", "r3", "r4")] == [True, False, True, True]
    for i in range(50):
        store.put("t", body(f"flood{i}"), [])
    assert store.get("quiet", "q1") is not None and len(store) == 4
    big = [{"role": "user", "content": "x" * 6_000}]
    for rid in ("b1", "b2", "b3", "b4"):
        store.put("t", body(rid), big)  # over the bytes bound: t's oldest go first
    assert store.bytes <= 20_000 and store.get("t", "b4") is not None and store.get("quiet", "q1") is not None
    assert not store.put("t", body("huge"), [{"content": "x" * 30_000}])  # over the bound alone: not kept
    assert not ResponseStore(max_responses=0).put("t", body("off"), [])
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi", "logprobs": [{}]}]}
    store.put("t", body("lp"), [answer])  # the conversation needs no log-probabilities
    assert store.get("t", "lp").items == [{**answer, "content": [{"type": "output_text", "text": "hi"}]}]


def test_log_probabilities_when_included(client: openai.OpenAI) -> None:
    answer = client.responses.create(
        model="qv4", input=ASK, max_output_tokens=6, top_logprobs=2, include=["message.output_text.logprobs"]
    )
    entries = answer.output[0].content[0].logprobs
    assert len(entries) == answer.usage.output_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    assert "".join(e.token for e in entries) == answer.output_text
    # As OpenAI and vLLM: top_logprobs alone asks for nothing; include does.
    plain = client.responses.create(model="qv4", input=ASK, max_output_tokens=6, top_logprobs=2)
    assert plain.output[0].content[0].logprobs == []


def test_what_is_not_served_is_a_400_naming_the_field(server: tuple[str, Path]) -> None:
    body = {"model": "qv4", "input": ASK, "max_output_tokens": 4}
    for bad, field in (
        ({**body, "previous_response_id": "resp_1"}, "previous_response_id"),  # never issued
        ({**body, "reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
        ({**body, "truncation": "auto"}, "truncation"),
        ({**body, "background": True}, "background"),
        ({**body, "tools": [{"type": "web_search"}]}, "tools"),
        ({**body, "tools": [WEATHER]}, "tool_choice"),  # "auto": no parser for the model's own call format
        ({**body, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({**body, "temperature": 3}, "temperature"),
        ({**body, "input": ""}, "input"),
        ({**body, "top_k": "5"}, "top_k"),
        ({**body, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({**body, "max_output_tokens": 0}, "max_output_tokens"),
        (
            {**body, "instructions": "be brief", "input": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]},
            "input.1",
        ),
    ):
        r = httpx.post(f"{server[0]}/v1/responses", json=bad)
        assert r.status_code == 400, (bad, r.text)
        error = r.json()["error"]
        assert field in error["message"] + (error["param"] or ""), r.text
    assert httpx.post(f"{server[0]}/v1/responses", json={**body, "model": "nope"}).status_code == 404
