"""OpenAI's Responses API request (``POST /v1/responses``), as far as a text model serves it.

A request is the conversation and the settings a chat completion takes, spelled differently:
``instructions`` and ``input`` items are chat turns, a function tool is a chat tool, ``text.format``
is a ``response_format``. Validation builds that chat request (``chat()``), so both routes share
one set of rules, bounds and error messages, and the router's edge checks a Responses body as a
replica does.

Stored responses (``store``, ``previous_response_id``) are the route's (``response_store``).
Not served, each a 400 naming the field: ``conversation``, background runs, tools other than
functions, non-text inputs, reasoning summaries, and ``truncation: "auto"``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, PrivateAttr, Tag, ValidationError, field_validator, model_validator

from loraplane.serving.http.protocol.chat import ChatCompletionRequest, text_parts_only
from loraplane.serving.http.protocol.common import ModelName, _Strict, new_id

# The vLLM sampling fields a Responses body may carry as well (vLLM's own Responses request takes them).
VLLM_SAMPLING = (
    "top_k", "min_p", "repetition_penalty", "seed", "stop", "ignore_eos", "cache_salt", "priority", "structured_outputs",
)  # fmt: skip
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# The chat request's fields by their names here, for errors found there.
CHAT_NAMES = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens"}


class _SentBack(_Strict):
    """An item as the client's own objects dump it: the fields OpenAI adds over time come back
    as null, and a null is taken as absent whether or not the field is known here."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_absent(cls, data: object) -> object:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class InputText(_SentBack):
    """A text part: the caller's (``input_text``) or an earlier answer's (``output_text``, sent
    back as the SDK dumps it, with its annotations and log-probabilities)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_SentBack):
    """A turn: OpenAI's easy input message, or an earlier answer's message item sent back."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: object) -> object:
        return text_parts_only(v, ("input_text", "output_text"))

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_SentBack):
    """A call an earlier answer made."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_SentBack):
    """The caller's result of a call."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


def _item_kind(item: object) -> str:
    kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    return kind if isinstance(kind, str) else "message"  # OpenAI's easy input message has no type


# Told apart by their type, so a bad item's error names what is wrong with it, not the three
# attempts a plain union makes.
InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """``text.format``: plain text, any JSON object, or documents of a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = Field(default=None, description="only the default")


class Reasoning(_Strict):
    """``reasoning``: the effort, handed to the chat template as chat's ``reasoning_effort``.
    Summaries need a reasoning parser, which this server does not have."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: None = Field(default=None, description="only null: no reasoning is read out of the answer")
    generate_summary: None = Field(default=None, description="only null (summary's older name)")


class ResponsesRequest(_Strict):
    model: ModelName
    input: list[InputItem] = Field(min_length=1, description="text (the user's turn), or the conversation's items")
    instructions: str | None = Field(default=None, description="a system turn before the input")
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = Field(default=None, description=f"{LOGPROBS_INCLUDE!r} gives log-probabilities")
    stream: bool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled"] | None = Field(default=None, description='only "disabled": a prompt too long is a 400')
    store: bool | None = Field(default=None, description="false: not kept (OpenAI's default is true)")
    background: Literal[False] | None = None
    reasoning: Reasoning | None = Field(default=None, description="its effort reaches the chat template")
    previous_response_id: str | None = Field(
        default=None, min_length=1, max_length=256, description="a stored response of the caller's to go on from"
    )
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    # vLLM's sampling extensions, checked by the chat request they are handed to.
    top_k: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    seed: Any = None
    stop: Any = None
    ignore_eos: Any = None
    structured_outputs: Any = None
    cache_salt: Any = None
    priority: Any = None

    _chat: ChatCompletionRequest = PrivateAttr()

    @field_validator("input", mode="before")
    @classmethod
    def _text_is_a_turn(cls, v: object) -> object:
        """Text is the user's turn; it must say something."""
        if isinstance(v, str):
            if not v:
                raise ValueError("must not be empty")
            return [{"role": "user", "content": v}]
        return v

    @model_validator(mode="after")
    def _as_chat(self) -> ResponsesRequest:
        try:
            self._chat = ChatCompletionRequest.model_validate(self._chat_body())
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in self._own_names(first["loc"]))
            message = first["msg"].removeprefix("Value error, ")
            raise ValueError(f"{where}: {message}" if where else message) from None
        return self

    def _own_names(self, loc: tuple[Any, ...]) -> tuple[Any, ...]:
        """A chat field's place in this request: ``messages.3`` is ``input.2`` after
        ``instructions``, ``response_format`` is ``text.format``, ..."""
        if not loc:
            return loc
        head, *rest = loc
        if head == "messages" and rest and isinstance(rest[0], int):
            rest[0] -= 1 if self.instructions else 0
        return (CHAT_NAMES.get(head, head), *rest)

    def going_on_from(self, previous: list[dict[str, Any]]) -> ResponsesRequest:
        """This request after a stored conversation's items (``previous_response_id``): the same
        request with those items before its input, checked again as a whole."""
        body = self.model_dump(by_alias=True, exclude_unset=True)
        return ResponsesRequest.model_validate({**body, "input": [*previous, *body["input"]]})

    def items(self) -> list[dict[str, Any]]:
        """The input as items, as a stored response keeps them and ``input_items`` lists them:
        each with its type, id and status, a message's text as parts (``input_text``, or an
        answer's ``output_text``). An item sent with an id keeps it."""
        return [_stored_item(item) for item in self.input]

    def chat(self) -> ChatCompletionRequest:
        """The same request as a chat completion: the turns, tools and settings it stands for."""
        return self._chat

    def logprobs(self) -> bool:
        """Log-probabilities are given when ``include`` asks for them (``top_logprobs`` says how many alternatives)."""
        return LOGPROBS_INCLUDE in (self.include or [])

    def _chat_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self._messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
            "user": self.user,
            "safety_identifier": self.safety_identifier,
            "prompt_cache_key": self.prompt_cache_key,
            "metadata": self.metadata,
            "service_tier": self.service_tier,
            "reasoning_effort": self.reasoning.effort if self.reasoning is not None else None,
            **{k: getattr(self, k) for k in VLLM_SAMPLING},
        }
        if self.logprobs():
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.tools is not None:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})} for t in self.tools
            ]
        choice = self.tool_choice
        body["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}} if isinstance(choice, NamedFunction) else choice
        )
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        return body

    def _messages(self) -> list[dict[str, Any]]:
        """The chat turns: the instructions as the system's, then each item; an earlier answer's
        consecutive calls are one assistant turn, each result a tool turn."""
        turns: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        for item in self.input:
            if isinstance(item, MessageItem):
                turns.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
                if turns and turns[-1]["role"] == "assistant" and turns[-1].get("tool_calls"):
                    turns[-1]["tool_calls"].append(call)
                else:
                    turns.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                turns.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return turns


def _stored_item(item: MessageItem | FunctionCallItem | FunctionCallOutputItem) -> dict[str, Any]:
    data = item.model_dump(by_alias=True, exclude_none=True)
    data["status"] = item.status or "completed"
    if isinstance(item, MessageItem):
        answer = item.role == "assistant"
        if isinstance(item.content, str):
            part: dict[str, Any] = {"type": "output_text" if answer else "input_text", "text": item.content}
            data["content"] = [{**part, "annotations": []} if answer else part]
        data.update(type="message", id=item.id or new_id("msg", "_"))
    else:
        data["id"] = item.id or new_id("fc" if isinstance(item, FunctionCallItem) else "fco", "_")
    return data
