"""OpenAI's function calls, made by structured output: ``tool_choice`` naming a function constrains
the answer to a JSON object of that function's arguments, and ``"required"`` to a JSON array of
one or more calls, ``[{"name": ..., "parameters": {...}}]`` (``parallel_tool_calls: false``: one).
The schemas are vLLM's (``http.protocol.tool_schema``); the grammar library compiles them like any ``response_format``, so any
base model and adapter answers with calls a client can parse, whether or not it was tuned for
tools. The answer's text then becomes ``message.tool_calls``.

With ``"auto"`` the model chooses between text and calls in its own format, which
``parsers`` reads back.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from loraplane.serving.http.protocol.chat import ChatCompletionRequest, NamedToolChoice


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"  # vLLM's


def whole_calls(text: str) -> tuple[list[tuple[str, str]], bool]:
    """The calls of ``"required"``'s answer text so far, each its name and its arguments as the
    model wrote them, and whether the array is closed. A call still being written is not among
    them, so an answer cut short gives the calls it finished."""
    stream = CallStream()
    calls = [(name, arguments) for _, name, arguments in stream.feed(text)]
    return calls, stream.closed


class CallStream:
    """``"required"``'s array read as it is written, chunk by chunk: each character is looked at
    once (its depth, and whether it is inside a string) and each call is read once, when its
    object closes, so a stream costs the event loop its answer's length, not that length times
    the number of chunks, which would stall every other stream on a long answer. A call is read
    by spans (``_call_at``), not by decoding and re-encoding its arguments, which would change
    their text (a number's digits, ``1e999`` to ``Infinity``) and recurse as deep as they nest.
    Anything but calls separated by commas (and whitespace) inside the array ends the reading
    there."""

    def __init__(self) -> None:
        self.count = 0  # the calls read so far
        self.closed = False  # the array's closing bracket was written
        self._depth = 0
        self._in_string = self._escaped = self._broken = False
        self._after_call = False  # the last thing in the array was a call (not "[" or a comma)
        self._call: list[str] | None = None  # the pieces of the call being written, from its "{"

    def feed(self, delta: str) -> list[tuple[int, str, str]]:
        """The calls ``delta`` completes, each with its index in the array."""
        done: list[tuple[int, str, str]] = []
        start = 0  # where the call being written starts in this delta
        for i, ch in enumerate(delta):
            if self._broken or self.closed:
                break
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch in " \t\r\n":
                continue
            elif self._depth == 0:
                self._depth, self._broken = 1, ch != "["
            elif self._depth == 1:  # between calls: a call, then a comma or the end, and so on
                if ch == "," and self._after_call:
                    self._after_call = False
                elif ch == "]" and self._after_call:
                    self._depth, self.closed = 0, True
                elif ch == "{" and not self._after_call:
                    self._depth, self._call, start = 2, [], i
                else:
                    self._broken = True
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1:
                    call = _call_at("".join(self._call or []) + delta[start : i + 1], 0)
                    self._call, self._broken, self._after_call = None, call is None, True
                    if call is not None:
                        done.append((self.count, call[0], call[1]))
                        self.count += 1
        if self._call is not None:
            self._call.append(delta[start:])
        return done


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


def message_calls(calls: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """A whole answer's ``message.tool_calls``: each call with its own id (a stream's chunks add
    each call's ``index``)."""
    return [{k: v for k, v in call_entry(i, *c).items() if k != "index"} for i, c in enumerate(calls)]


def call_entry(index: int, name: str, arguments: str) -> dict[str, Any]:
    return {"index": index, "id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class ToolAnswer:
    """How a request's answers become calls: of the ``named`` function, or (None) as many as
    ``"required"``'s array holds. One per request: a stream reads each choice's array as it
    goes."""

    named: str | None
    _streams: dict[int, CallStream] = field(default_factory=dict, repr=False, compare=False)

    def made(self, text: str) -> list[tuple[str, str]]:
        """A whole answer's calls, each its name and its arguments' text."""
        return [(self.named, text)] if self.named is not None else whole_calls(text)[0]

    def calls(self, text: str) -> list[dict[str, Any]]:
        """``message.tool_calls`` of a whole answer."""
        return message_calls(self.made(text))

    def finish_reason(self, text: str, reason: str | None) -> str | None:
        """vLLM's: ``"required"``'s calls end as ``tool_calls`` (when their array was closed, not
        cut by a stop string); a named call ends as ``stop``, as OpenAI's forced function does;
        ``length`` says the calls were cut short."""
        return "tool_calls" if reason == "stop" and self.named is None and whole_calls(text)[1] else reason

    def completed_calls(self, choice: int, delta: str) -> list[tuple[int, str, str]]:
        """The calls of ``"required"``'s array that a choice's chunk completes, each with its
        index (chat's and the Responses API's streams both ask it), read by the choice's own
        ``CallStream``."""
        return self._streams.setdefault(choice, CallStream()).feed(delta)

    def delta_calls(self, choice: int, delta: str, first: bool) -> list[dict[str, Any]]:
        """A chunk's ``delta.tool_calls``: a named call's arguments as they are written (its id
        and name in the first chunk); ``"required"``'s calls each whole once written."""
        if self.named is not None:
            if first:
                return [call_entry(0, self.named, delta)]
            return [{"index": 0, "function": {"arguments": delta}}] if delta else []
        return [call_entry(i, name, arguments) for i, name, arguments in self.completed_calls(choice, delta)]


def tool_answer(req: ChatCompletionRequest) -> ToolAnswer | None:
    """How a request's answers become calls (None: they are text)."""
    if isinstance(req.tool_choice, NamedToolChoice):
        return ToolAnswer(req.tool_choice.function.name)
    return ToolAnswer(None) if req.tool_choice == "required" else None
