"""``POST /v1/chat/completions``: the conversation, the tools the chat template describes, and how
the answer may be constrained to calls (``tool_choice``)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from loraplane.serving.http.protocol.common import MAX_TOKENS_LIMIT, MAX_TOOLS, _Strict
from loraplane.serving.http.protocol.sampling import _Sampling
from loraplane.serving.http.protocol.tool_schema import arguments_schema, calls_schema


def text_parts_only(content: object, kinds: tuple[str, ...]) -> object:
    """Content parts of the text kinds, refused by the first other part's own kind (an image, a
    file, ...) rather than by a union's attempts."""
    if isinstance(content, list):
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in kinds:
                raise ValueError(f"content[{i}]: parts of type {kind!r} are not supported; only {' or '.join(kinds)}")
    return content


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionDefinition(_Strict):
    """A function the model may be asked to call: OpenAI's ``tools[].function``."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="a JSON schema of the arguments (an object)")
    strict: bool | None = Field(default=None, description="accepted; a called function's arguments always match")


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition

    def template_tool(self) -> dict[str, Any]:
        """The tool as chat templates read it: a function without parameters takes an empty
        object (as OpenAI reads it), so a template that lists ``parameters.properties`` can."""
        function = self.function.model_dump(exclude_none=True)
        return {"type": "function", "function": {**function, "parameters": arguments_schema(self)}}


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``tool_choice`` naming the one function the answer calls."""

    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Strict):
    name: str
    arguments: str = Field(description="the arguments as JSON text")

    @model_validator(mode="before")
    @classmethod
    def _client_side_fields(cls, data: object) -> object:
        """The official client's ``parse`` helper adds ``parsed_arguments`` (the arguments it
        parsed itself); a call sent back with it is the same call."""
        return {k: v for k, v in data.items() if k != "parsed_arguments"} if isinstance(data, dict) else data


class ToolCall(_Strict):
    """A call an earlier answer made, sent back in its assistant turn."""

    id: str
    type: Literal["function"]
    function: FunctionCall

    @model_validator(mode="before")
    @classmethod
    def _stream_index(cls, data: object) -> object:
        """The official client's stream helper keeps each call's ``index`` from the chunks."""
        return {k: v for k, v in data.items() if k != "index"} if isinstance(data, dict) else data

    def template_call(self) -> dict[str, Any]:
        """The call as chat templates read it: its arguments parsed, as vLLM hands them over
        (Llama's and Qwen's templates write ``arguments | tojson``); text that is not JSON
        stays text."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


# An OpenAI assistant message's fields for tools, refusals and audio, as the official client hands
# an answer back (``message.model_dump()``): null or empty in most answers, so a conversation may
# send them back as they came. Set, ``tool_calls`` are the calls an answer made; the others are
# refused as unknown.
ANSWER_ONLY_FIELDS = ("refusal", "annotations", "audio", "function_call", "tool_calls")
# What the client's ``parse`` helper adds to an answer (its own reading of the content), dropped.
CLIENT_SIDE_FIELDS = ("parsed",)


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="developer: OpenAI's newer name for system instructions, given to the chat template as system"
    )
    content: str | list[TextPart] | None = Field(
        default=None, description="text, or OpenAI content parts (text parts only); null only in an assistant turn"
    )
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, description="an assistant turn's calls")
    tool_call_id: str | None = Field(default=None, description="a tool turn's: the call it answers")

    @model_validator(mode="before")
    @classmethod
    def _answer_fields_unset(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        return {
            k: v for k, v in data.items()
            if k not in CLIENT_SIDE_FIELDS and (k not in ANSWER_ONLY_FIELDS or v not in (None, []))
        }  # fmt: skip

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: required in a {self.role} message")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only in an assistant message")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("tool_call_id: required in a tool message, and only there")
        return self

    def template_role(self) -> str:
        """The role the chat template is given: chat templates know ``system``, not ``developer``."""
        return "system" if self.role == "developer" else self.role

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: object) -> object:
        return text_parts_only(v, ("text",))

    def text(self) -> str:
        """The message's text: content parts joined with newlines, as vLLM joins them."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

    def template_message(self) -> dict[str, Any]:
        """The turn as the chat template reads it (a template that knows tools writes the calls
        and the call a result answers)."""
        message: dict[str, Any] = {"role": self.template_role(), "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.template_call() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatTemplating(_Strict):
    """A conversation and vLLM's chat-template controls: what ``/v1/chat/completions`` and
    ``/tokenize`` render through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(default=False, description="the answer goes on from the last assistant turn")
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="extra variables for the chat template (for example enable_thinking)"
    )
    add_special_tokens: bool = Field(
        default=False, description="vLLM extension: the tokenizer's BOS (and such) on top of what the template writes"
    )
    tools: list[ChatTool] | None = Field(
        default=None, max_length=MAX_TOOLS, description="functions the chat template describes to the model"
    )
    documents: list[dict[str, str]] | None = Field(
        default=None, description="vLLM extension: documents for a template that writes them (retrieval), as {title, text}"
    )
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        default=None,
        description="for a template that reads it, as vLLM hands it over (enable_thinking too, unless in chat_template_kwargs)",
    )

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, v: list[ChatTool] | None) -> list[ChatTool] | None:
        names = [t.function.name for t in v or []]
        if len(set(names)) != len(names):
            raise ValueError("two tools have the same function name")
        return v

    @model_validator(mode="after")
    def _continuation(self) -> ChatTemplating:
        if self.continue_final_message and (self.add_generation_prompt or self.messages[-1].role != "assistant"):
            raise ValueError("continue_final_message: needs add_generation_prompt false and an assistant message last")
        return self

    def template_input(self) -> dict[str, Any]:
        """``Tokenizer.chat``'s arguments: the turns and the template controls. ``reasoning_effort``
        reaches the template as vLLM hands it over: as itself, and as ``enable_thinking`` (off for
        ``"none"``) for templates that know only that switch, unless ``chat_template_kwargs`` set it."""
        variables = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            variables["reasoning_effort"] = self.reasoning_effort
            variables.setdefault("enable_thinking", self.reasoning_effort != "none")
        return {
            "messages": [m.template_message() for m in self.messages],
            "tools": [t.template_tool() for t in self.tools] if self.tools else None,
            "documents": self.documents,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "variables": variables,
            "add_special_tokens": self.add_special_tokens,
        }


class ChatCompletionRequest(_Sampling, ChatTemplating):
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    echo: bool = Field(
        default=False, description="vLLM extension: the answer after the last turn's text, when that turn is the assistant's"
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description='a named function or "required": the answer is calls; "none": text'
    )
    parallel_tool_calls: bool | None = Field(default=None, description='false: "required" makes one call')
    modalities: list[Literal["text"]] | None = Field(default=None, description="only text is served")

    @model_validator(mode="after")
    def _tool_choice_fits_tools(self) -> ChatCompletionRequest:
        choice = self.tool_choice or ("auto" if self.tools else "none")  # OpenAI's default
        if choice in ("none", "auto"):  # "auto" with tools: the server's tool-call parser, if it has one
            return self
        names = [t.function.name for t in self.tools or []]
        if not names:
            raise ValueError("tool_choice: a function call needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool is named {choice.function.name!r}")
        if super().output_constraint() is not None:
            raise ValueError("tool_choice: a function call is not combined with response_format or structured_outputs")
        self.output_constraint()  # two tools' $defs that disagree
        return self

    def auto_tools(self) -> bool:
        """Whether the model chooses between text and calls (``"auto"``, OpenAI's default with tools)."""
        return bool(self.tools) and self.tool_choice in ("auto", None)

    def output_constraint(self) -> tuple[str, str, Any] | None:
        """A function call's JSON schema (its arguments, or ``"required"``'s array of calls), or
        the output format asked for."""
        tools = self.tools or []
        if isinstance(self.tool_choice, NamedToolChoice):
            (tool,) = [t for t in tools if t.function.name == self.tool_choice.function.name]
            return "tools", "json", arguments_schema(tool)
        if self.tool_choice == "required":
            return "tools", "json", calls_schema(tools, self.parallel_tool_calls is not False)
        return super().output_constraint()

    def echoed(self) -> str:
        """The text ``echo`` puts before the answer: the last turn's, when it is the assistant's (the
        answer's own role), as vLLM's; nothing otherwise."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:  # as OpenAI and vLLM answer
            raise ValueError("top_logprobs: only allowed when logprobs is true")
        return self
