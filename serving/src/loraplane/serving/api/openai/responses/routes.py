"""OpenAI's Responses API: ``POST /v1/responses``, streamed or not, for text and function calls.

The request runs as the chat completion it stands for (``ResponsesRequest.chat()``: the same
template, sampling, admission, quotas and usage records as ``/v1/chat/completions``); what
differs is the answer's shape: a ``response`` object whose ``output`` holds a message item (its
``output_text`` part) or one ``function_call`` item per call, and, streamed, OpenAI's typed events
(``response.created`` ... ``response.completed``), each numbered.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from loraplane.serving.api.deps import Caller, Engine, Server, ServerState
from loraplane.serving.api.metering import RequestMeter
from loraplane.serving.api.openai.completions.choices import Choices
from loraplane.serving.api.openai.completions.generation import auto_tools, failure, final, meter_for, run, sampling, templated
from loraplane.serving.api.openai.completions.logprobs import token_entries
from loraplane.serving.api.openai.completions.streaming import finish_reason
from loraplane.serving.api.openai.models_routes import resolve_model
from loraplane.serving.api.openai.responses.store import ResponseStore, StoredResponse
from loraplane.serving.api.openai.tools.calls import ToolAnswer, new_call_id, tool_answer
from loraplane.serving.api.openai.tools.parsers import AutoAnswer
from loraplane.serving.engine.outputs import RequestOutput
from loraplane.serving.engine.sequence import TokenLogprob
from loraplane.serving.http.cleanup_response import CleanupResponse
from loraplane.serving.http.disconnect import cancel_on_disconnect
from loraplane.serving.http.errors import APIError, invalid_request
from loraplane.serving.http.protocol.common import new_id, now
from loraplane.serving.http.protocol.responses import ResponsesRequest
from loraplane.serving.http.tenants import TenantConfig

router = APIRouter()

Entries = Callable[[Sequence[TokenLogprob]], list[dict[str, Any]]]


def _usage(meter: RequestMeter) -> dict[str, Any]:
    prompt_tokens, cached, completion_tokens = meter.tokens()
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message(item_id: str, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _function_call(name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": new_id("fc", "_"), "call_id": new_call_id(), "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


class ResponseShape:
    """The ``response`` object of one request, as it stands (in progress, or ended by ``out``),
    and its keeping once it has ended (``ended``) when it is stored."""

    def __init__(self, req: ResponsesRequest, rid: str, keep: Callable[[dict[str, Any]], None] | None) -> None:
        self.req, self.rid, self.created, self.keep = req, rid, now(), keep

    def ended(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        """The response as it ended (completed or incomplete), kept when stored."""
        body = self.body(status, output, usage)
        if self.keep is not None:
            self.keep(body)
        return body

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status, "model": req.model,
            "output": output, "usage": usage, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "top_logprobs": req.top_logprobs or 0,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "tool_choice": (req.tool_choice.model_dump() if not isinstance(req.tool_choice, str | None)
                            else req.tool_choice or ("auto" if req.tools else "none")),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}},
            "truncation": "disabled", "store": self.keep is not None, "background": False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None,
            "metadata": req.metadata or {}, "user": req.user, "service_tier": "default",
        }  # fmt: skip


def _going_on(store: ResponseStore, owner: str | None, req: ResponsesRequest) -> ResponsesRequest:
    """The request after the conversation of the stored response it names; an id that is not
    the caller's stored response is OpenAI's 400 ``previous_response_not_found``."""
    rid = req.previous_response_id
    stored = store.get(owner, rid) if rid is not None else None
    if stored is None:
        raise APIError(400, f"Previous response with id '{rid}' not found.", code="previous_response_not_found",
                       param="previous_response_id")  # fmt: skip
    try:
        return req.going_on_from(stored.items)
    except ValidationError as err:  # the whole conversation is checked again
        raise invalid_request(err.errors()) from None


def _keeper(store: ResponseStore, owner: str | None, req: ResponsesRequest) -> Callable[[dict[str, Any]], None]:
    """What keeps the response once it ends: its body, and its conversation as items (the items
    it went on from and its input, then its output)."""
    items = req.items()

    def keep(body: dict[str, Any]) -> None:
        store.put(owner, body, [*items, *body["output"]])

    return keep


def _stored(server: ServerState, tenant: TenantConfig | None, response_id: str) -> StoredResponse:
    stored = server.responses.get(tenant.name if tenant is not None else None, response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", code="not_found", param="response_id")


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, tenant: Caller, server: Server) -> Any:
    """A stored response of the caller's, as it ended."""
    return _stored(server, tenant, response_id).body


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(
    response_id: str, tenant: Caller, server: Server, order: Literal["asc", "desc"] = "desc",
    limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None,
) -> Any:  # fmt: skip
    """OpenAI's list of the items a stored response was given (the conversation it went on from
    included), newest first unless ``order=asc``, ``limit`` at a time after the item ``after``."""
    items = _stored(server, tenant, response_id).input_items()
    items = items[::-1] if order == "desc" else items
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise APIError(400, f"after: no input item {after!r} in response {response_id!r}", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}  # fmt: skip


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, tenant: Caller, server: Server) -> Any:
    """Forget a stored response of the caller's: it can no longer be read or gone on from."""
    if not server.responses.delete(tenant.name if tenant is not None else None, response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def _status(out: RequestOutput) -> str:
    return "incomplete" if finish_reason(out) == "length" else "completed"


@router.post("/v1/responses")
@cancel_on_disconnect
async def responses(req: ResponsesRequest, engine: Engine, tenant: Caller, server: Server, raw_request: Request) -> Any:
    owner = tenant.name if tenant is not None else None
    if req.previous_response_id is not None:
        req = _going_on(server.responses, owner, req)
    chat = req.chat()
    adapter = resolve_model(engine, chat.model, tenant)
    auto = auto_tools(server, chat)
    prompt = await templated(engine, chat, limit=engine.engine.max_model_len)
    limit = chat.max_completion_tokens or max(1, engine.engine.max_model_len - len(prompt))
    params = await sampling(engine, chat, limit, (chat.top_logprobs or 0) if chat.logprobs else None)
    rid = new_id("resp", "_")
    meter = meter_for(server, rid, "/v1/responses", req.model, adapter, tenant)
    request = await run(server, engine, [prompt], params, 1, meter, tenant, chat.cache_salt)
    keep = _keeper(server.responses, owner, req) if req.store is not False and server.responses.enabled else None
    shape, tools = ResponseShape(req, rid, keep), tool_answer(chat)
    entries = token_entries(engine, False)
    logprobs = req.logprobs()

    if not req.stream:
        (out,) = await final(request)
        status = _status(out)
        if tools is None:
            text_logprobs = entries(out.logprobs) if logprobs else None
            content, made = auto.parser.parse(out.text) if auto is not None else (out.text, [])
            output = (
                [_message(new_id("msg", "_"), status, [_text_part(content or "", text_logprobs)])] if content or not made else []
            )
            output += [_function_call(name, arguments, status) for name, arguments in made]
        else:
            # "required"'s calls are each whole; a named call cut short is as incomplete as the answer.
            made_status = status if tools.named is not None else "completed"
            output = [_function_call(name, arguments, made_status) for name, arguments in tools.made(out.text)]
        return JSONResponse(shape.ended(status, output, _usage(meter)))

    events = _stream(shape, request, tools or auto, entries if logprobs else None)
    return CleanupResponse(_sse(events), request.close, media_type="text/event-stream")


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """OpenAI's framing: each event's type on an ``event:`` line, then its data, numbered."""
    number = 0
    async for event in events:
        event["sequence_number"] = number
        number += 1
        yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


async def _stream(
    shape: ResponseShape, request: Choices, answer: ToolAnswer | AutoAnswer | None, entries: Entries | None
) -> AsyncIterator[dict[str, Any]]:
    """The typed events of a streamed response: the output item (a message, or each call) opened,
    its text or arguments in deltas, each closed whole, then the response as it ended. With
    ``"auto"``, the text that cannot be a call is streamed, and the calls come whole at the end."""
    auto = answer if isinstance(answer, AutoAnswer) else None
    tools = answer if isinstance(answer, ToolAnswer) else None
    yield {"type": "response.created", "response": shape.body("in_progress", [], None)}
    yield {"type": "response.in_progress", "response": shape.body("in_progress", [], None)}
    output: list[dict[str, Any]] = []
    text, text_logprobs, out = "", list[dict[str, Any]](), None
    message_id = new_id("msg", "_")

    def opened() -> list[dict[str, Any]]:
        """The message item's opening events, once."""
        if output:
            return []
        output.append(_message(message_id, "in_progress", []))
        return [{"type": "response.output_item.added", "output_index": 0, "item": output[0]},
                {"type": "response.content_part.added", "item_id": message_id, "output_index": 0, "content_index": 0,
                 "part": _text_part("", None)}]  # fmt: skip

    async for _, out, delta in request.deltas():
        if (err := failure(out)) is not None:
            request.close()
            error = {"code": err.code or "server_error", "message": err.message}
            yield {"type": "response.failed", "response": shape.body("failed", output, _usage(request.meter), error)}
            return
        if tools is None:
            new_text = auto.shown(0, out.text, out.finished) if auto is not None else out.text[len(text) :]
            new_logprobs = entries(out.logprobs[len(text_logprobs) :]) if entries is not None else []
            text_logprobs += new_logprobs
            if not new_text:  # the message opens with its first text (or at the end, if it has none)
                continue
            for event in opened():
                yield event
            text += new_text
            yield {"type": "response.output_text.delta", "item_id": message_id, "output_index": 0, "content_index": 0,
                   "delta": new_text, "logprobs": new_logprobs}  # fmt: skip
        else:
            async for event in _call_events(tools, output, delta):
                yield event
    assert out is not None, "a request has at least one output"
    status = _status(out)
    if tools is None:
        made = auto.parser.parse(out.text)[1] if auto is not None else []
        if output or not made:
            for event in opened():  # an answer with no text
                yield event
            part = _text_part(text, text_logprobs)
            yield {"type": "response.output_text.done", "item_id": message_id, "output_index": 0, "content_index": 0,
                   "text": text, "logprobs": text_logprobs}  # fmt: skip
            yield {"type": "response.content_part.done", "item_id": message_id, "output_index": 0, "content_index": 0,
                   "part": part}  # fmt: skip
            output[0] = _message(message_id, status, [part])
            yield {"type": "response.output_item.done", "output_index": 0, "item": output[0]}
        for name, arguments in made:
            async for event in _whole_call(output, name, arguments):
                yield event
    else:
        for index, item in enumerate(output):
            if item["status"] == "in_progress":  # a named call's arguments, closed here
                item["status"] = status
                yield {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                       "name": item["name"], "arguments": item["arguments"]}  # fmt: skip
                yield {"type": "response.output_item.done", "output_index": index, "item": item}
    ended = "response.incomplete" if status == "incomplete" else "response.completed"
    yield {"type": ended, "response": shape.ended(status, output, _usage(request.meter))}


async def _call_events(tools: ToolAnswer, output: list[dict[str, Any]], delta: str) -> AsyncIterator[dict[str, Any]]:
    """A chunk's events for function calls: a named call opened at once and its arguments
    streamed; ``"required"``'s calls each opened and closed whole once written."""
    if tools.named is not None:
        if not output:
            output.append(_function_call(tools.named, "", "in_progress"))
            yield {"type": "response.output_item.added", "output_index": 0, "item": dict(output[0])}
        if delta:
            output[0]["arguments"] += delta
            yield {"type": "response.function_call_arguments.delta", "item_id": output[0]["id"], "output_index": 0,
                   "delta": delta}  # fmt: skip
        return
    for _, name, arguments in tools.completed_calls(0, delta):
        async for event in _whole_call(output, name, arguments):
            yield event


async def _whole_call(output: list[dict[str, Any]], name: str, arguments: str) -> AsyncIterator[dict[str, Any]]:
    """A call written whole: its item opened, its arguments in one delta, and closed."""
    index = len(output)
    item = _function_call(name, arguments, "completed")
    output.append(item)
    opening = {**item, "arguments": "", "status": "in_progress"}
    yield {"type": "response.output_item.added", "output_index": index, "item": opening}
    yield {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": index, "delta": arguments}
    yield {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
           "name": name, "arguments": arguments}  # fmt: skip
    yield {"type": "response.output_item.done", "output_index": index, "item": item}
