"""OpenAI's function calls, made by structured output: ``tool_choice`` naming a function constrains
the answer to a JSON object of that function's arguments, and ``"required"`` to a JSON array of
one or more calls, ``[{"name": ..., "parameters": {...}}]`` (``parallel_tool_calls: false``: one).
The schemas are vLLM's; the grammar library compiles them like any ``response_format``, so any
base model and adapter answers with calls a client can parse, whether or not it was tuned for
tools. The answer's text then becomes ``message.tool_calls``.

``"auto"`` with tools is refused at validation (see ``protocol``): the model would choose between
text and a call in its own format (Llama's, Hermes', Mistral's, ...), which only a parser for that
format could read back.
"""

from __future__ import annotations

import json
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
    (OpenAI's functions without parameters take ``{}``)."""
    return tool.function.parameters if tool.function.parameters is not None else ANY_OBJECT


def calls_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """The JSON schema of ``"required"``'s answer: an array of at least one call (at most one
    without ``parallel``), each one tool's name and its arguments. A ``ValueError`` when two
    tools define a named part (``$defs``) differently."""
    lifted: dict[str, dict[str, Any]] = {key: {} for key in DEFINITION_KEYS}
    options = []
    for tool in tools:
        parameters = dict(arguments_schema(tool))
        for key in DEFINITION_KEYS:
            for name, part in (parameters.pop(key, None) or {}).items():
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
    """The calls of ``"required"``'s answer text so far, each its name and arguments as JSON
    text, and whether the array is closed. A call still being written is not among them, so a
    stream gives each call once it is whole, and an answer cut short gives the calls it
    finished."""
    decoder, calls = json.JSONDecoder(), list[tuple[str, str]]()
    at = _skip_space(text, 0)
    if not text.startswith("[", at):
        return calls, False
    at += 1
    while True:
        at = _skip_space(text, at)
        try:
            call, at = decoder.raw_decode(text, at)
        except ValueError:
            return calls, False
        calls.append((call["name"], json.dumps(call["parameters"], ensure_ascii=False)))
        at = _skip_space(text, at)
        if text.startswith("]", at):
            return calls, True
        at += 1  # the grammar wrote a comma


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

    def finish_reason(self, reason: str | None) -> str | None:
        """vLLM's: ``"required"``'s calls end as ``tool_calls``; a named call ends as ``stop``, as
        OpenAI's forced function does; ``length`` says the calls were cut short."""
        return "tool_calls" if reason == "stop" and self.named is None else reason

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
