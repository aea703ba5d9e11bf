"""The JSON schemas a function call is constrained to (vLLM's): ``tool_choice`` naming a function
constrains the answer to an object of that function's arguments, and ``"required"`` to an array
of one or more calls. The chat request checks them when it is parsed (two tools whose ``$defs``
disagree are a 400); the server compiles them like any ``response_format``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraplane.serving.http.protocol.chat import ChatTool

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
