"""OpenAI's function calls, made by structured output: ``tool_choice`` naming a function constrains
the answer to a JSON object of that function's arguments, and ``"required"`` to a JSON array of
one or more calls, ``[{"name": ..., "parameters": {...}}]`` (``parallel_tool_calls: false``: one).
The schemas are vLLM's; the grammar library compiles them like any ``response_format``, so any
base model and adapter answers with calls a client can parse, whether or not it was tuned for
tools. The answer's text then becomes ``message.tool_calls``.

With ``"auto"`` the model chooses between text and calls, in its own format (Hermes', Llama's,
...): a ``ToolParser`` for that format, named by the server's ``--tool-call-parser``, reads the
calls back (``AutoAnswer``); without one, such a request is a 400, as vLLM's.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraplane.serving.api.protocol import ChatTool

# Where a JSON schema keeps its named parts: each tool's are lifted to the array's root, where
# their "#/$defs/..." references resolve.
DEFINITION_KEYS = ("$defs", "definitions")
ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


def arguments_schema(tool: ChatTool) -> dict[str, Any]:
    """The JSON schema of a call's arguments: the function's ``parameters``, any object without
    (OpenAI's functions without parameters, or with ``{}``, take ``{}``: an empty schema would
    allow any JSON value, and arguments are an object)."""
    return tool.function.parameters or ANY_OBJECT


def calls_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """The JSON schema of ``"required"``'s answer: an array of at least one call (at most one
    without ``parallel``), each one tool's name and its arguments. A ``ValueError`` when two
    tools define a named part (``$defs``) differently."""
    lifted: dict[str, dict[str, Any]] = {key: {} for key in DEFINITION_KEYS}
    options = []
    for tool in tools:
        parameters = dict(arguments_schema(tool))
        for key in DEFINITION_KEYS:
            parts = parameters.pop(key, None) or {}
            if not isinstance(parts, dict):
                raise ValueError(f"tools: {tool.function.name}'s parameters.{key} is not an object of schemas")
            for name, part in parts.items():
                if lifted[key].setdefault(name, part) != part:
                    raise ValueError(f"tools: two tools define {key}/{name} differently")
        options.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update({key: parts for key, parts in lifted.items() if parts})
    return schema


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"  # vLLM's


def whole_calls(text: str) -> tuple[list[tuple[str, str]], bool]:
    """The calls of ``"required"``'s answer text so far, each its name and its arguments as the
    model wrote them, and whether the array is closed. A call still being written is not among
    them, so a stream gives each call once it is whole, and an answer cut short gives the calls
    it finished. Read by spans (``_value_end``), not by decoding and re-encoding the arguments,
    which would change their text (a number's digits, ``1e999`` to ``Infinity``) and recurse as
    deep as they nest."""
    calls: list[tuple[str, str]] = []
    at = _skip_space(text, 0)
    if not text.startswith("[", at):
        return calls, False
    at += 1
    while True:
        call = _call_at(text, _skip_space(text, at))
        if call is None:
            return calls, False
        name, arguments, at = call
        calls.append((name, arguments))
        at = _skip_space(text, at)
        if text.startswith("]", at):
            return calls, True
        if not text.startswith(",", at):
            return calls, False
        at += 1


def _call_at(text: str, at: int) -> tuple[str, str, int] | None:
    """The ``{"name": ..., "parameters": ...}`` object at ``at``, whole: its name, its
    parameters' text and where it ends; None when it is not whole yet (or not such an object)."""
    if not text.startswith("{", at):
        return None
    fields: dict[str, str] = {}
    at = _skip_space(text, at + 1)
    while not text.startswith("}", at):
        key_end = _value_end(text, at)
        if key_end is None or text[at] != '"':
            return None
        key = json.loads(text[at:key_end])
        at = _skip_space(text, key_end)
        if not text.startswith(":", at):
            return None
        start = _skip_space(text, at + 1)
        end = _value_end(text, start)
        if end is None:
            return None
        fields[key], at = text[start:end], _skip_space(text, end)
        if text.startswith(",", at):
            at = _skip_space(text, at + 1)
        elif not text.startswith("}", at):
            return None
    if "name" not in fields or "parameters" not in fields:
        return None
    name = json.loads(fields["name"])
    return (name, fields["parameters"], at + 1) if isinstance(name, str) else None


def _value_end(text: str, at: int) -> int | None:
    """Where the JSON value that starts at ``at`` ends, or None when the text ends first (a
    scalar at the very end may still be growing)."""
    if at >= len(text):
        return None
    if text[at] == '"':
        return _string_end(text, at)
    if text[at] not in "[{":  # a number, true, false or null
        end = at
        while end < len(text) and text[end] not in ",]} \t\r\n":
            end += 1
        return end if end < len(text) else None
    depth, i = 0, at
    while i < len(text):
        if text[i] == '"':
            closed = _string_end(text, i)
            if closed is None:
                return None
            i = closed
            continue
        if text[i] in "[{":
            depth += 1
        elif text[i] in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _string_end(text: str, at: int) -> int | None:
    """Past the closing quote of the string that opens at ``at``."""
    i = at + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _call(index: int, name: str, arguments: str) -> dict[str, Any]:
    return {"index": index, "id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class ToolAnswer:
    """How a request's answers become calls: of the ``named`` function, or (None) as many as
    ``"required"``'s array holds."""

    named: str | None

    def calls(self, text: str) -> list[dict[str, Any]]:
        """``message.tool_calls`` of a whole answer."""
        if self.named is not None:
            found = [(self.named, text)]
        else:
            found, _ = whole_calls(text)
        return [{k: v for k, v in _call(i, *c).items() if k != "index"} for i, c in enumerate(found)]

    def finish_reason(self, text: str, reason: str | None) -> str | None:
        """vLLM's: ``"required"``'s calls end as ``tool_calls`` (when their array was closed, not
        cut by a stop string); a named call ends as ``stop``, as OpenAI's forced function does;
        ``length`` says the calls were cut short."""
        return "tool_calls" if reason == "stop" and self.named is None and whole_calls(text)[1] else reason

    def delta_calls(self, before: str, delta: str, first: bool) -> list[dict[str, Any]]:
        """A chunk's ``delta.tool_calls``: a named call's arguments as they are written (its id
        and name in the first chunk); ``"required"``'s calls each whole once written."""
        if self.named is not None:
            if first:
                return [_call(0, self.named, delta)]
            return [{"index": 0, "function": {"arguments": delta}}] if delta else []
        done, _ = whole_calls(before)
        now, _ = whole_calls(before + delta)
        return [_call(i, *c) for i, c in enumerate(now) if i >= len(done)]


class ToolParser:
    """``tool_choice: "auto"``: the model answers in text or calls tools in its own format, which
    a parser for that format reads back (vLLM's ``--tool-call-parser``). ``parse`` splits a whole
    answer into its text (None when it is only calls) and its calls; ``visible`` is how much of
    an answer still being written may be streamed as text, holding back what may yet turn out to
    be a call. ``visible`` only grows as the answer does, so a stream's text deltas add up."""

    name = ""

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        raise NotImplementedError

    def visible(self, text: str, finished: bool) -> str:
        raise NotImplementedError

    def answered(self, text: str, finished: bool) -> str:
        """``visible``, and once finished the text ``parse`` keeps."""
        if not finished:
            return self.visible(text, finished)
        content, calls = self.parse(text)
        return text if not calls else content or ""


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class HermesParser(ToolParser):
    """Hermes' and Qwen's format: calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    after any text."""

    name = "hermes"
    START = "<tool_call>"
    CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for body in self.CALL.findall(text, start):
            try:
                call = json.loads(body)
                calls.append((str(call["name"]), _arguments(call.get("arguments", {}))))
            except (ValueError, KeyError, TypeError):  # not a call after all: the answer is text
                return text, []
        content = text[:start]
        return (content if content.strip() else None), calls

    def visible(self, text: str, finished: bool) -> str:
        start = text.find(self.START)
        if start >= 0:
            return text[:start]
        for k in range(min(len(self.START) - 1, len(text)), 0, -1):  # a tail that may begin the marker
            if self.START.startswith(text[-k:]):
                return text[:-k]
        return text


class Llama3JsonParser(ToolParser):
    """Llama 3.1's JSON tool calling: the answer is one or more ``{"name": ..., "parameters":
    {...}}`` objects (after ``<|python_tag|>`` when special tokens are kept), separated by ``;``,
    or it is text."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        body = text.strip().removeprefix(self.TAG).lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), list[tuple[str, str]](), 0
        while at < len(body):
            try:
                call, at = decoder.raw_decode(body, at)
                calls.append((str(call["name"]), _arguments(call.get("parameters", call.get("arguments", {})))))
            except (ValueError, KeyError, TypeError):
                return text, []
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return None, calls

    def visible(self, text: str, finished: bool) -> str:
        head = text.lstrip()
        if not head or head.startswith("{") or head.startswith(self.TAG) or self.TAG.startswith(head):
            return ""  # may be a call: held until the answer ends
        return text


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


@dataclass(frozen=True)
class AutoAnswer:
    """How ``"auto"``'s answers are read: text, calls, or text then calls, by ``parser``."""

    parser: ToolParser

    def message(self, text: str, echoed: str = "") -> dict[str, Any]:
        """A whole answer's chat message: its text (null when there is none) and its calls, if any."""
        content, calls = self.parser.parse(text)
        content = echoed + (content or "")
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [{k: v for k, v in _call(i, *c).items() if k != "index"} for i, c in enumerate(calls)]
        return message

    def finish_reason(self, text: str, reason: str | None) -> str | None:
        """vLLM's: ``tool_calls`` when the answer called a tool."""
        return "tool_calls" if reason is not None and self.parser.parse(text)[1] else reason

    def delta(self, before: str, now: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """A chunk's new text, and once the answer ends its calls, each whole."""
        text = self.parser.answered(now, finished)[len(self.parser.visible(before, False)) :]
        calls = self.parser.parse(now)[1] if finished else []
        return text, [_call(i, *c) for i, c in enumerate(calls)]
