"""Request and response bodies of the OpenAI API (the subset the engine serves), as pydantic models.

Unknown fields are refused with a 400 rather than ignored: a client that sends ``suffix`` or
``best_of`` above ``n`` expecting them to work should hear that they do not. Documented OpenAI
fields that change nothing here (``user``, ``metadata``, ``store``, ...) are accepted, and so is ``null``
for any optional field: OpenAI's schema marks them nullable, and clients (and the answers they
send back as conversation turns) carry nulls for what they leave unset. The models are the
single source of truth for the OpenAPI schema FastAPI publishes.
"""

from __future__ import annotations

import functools
import json
import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from loraplane.serving.api.tool_calls import ToolAnswer, arguments_schema, calls_schema

MAX_TOKENS_LIMIT = 1 << 20
# Every stop string is searched for in the output at every step: bounded so a request cannot make
# each step of everyone's batch slow (OpenAI allows 4; vLLM users pass a few more).
MAX_STOPS = 16
MAX_STOP_CHARS = 256
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
# Every choice is a sequence in the shared batch: n and batched prompts are bounded together.
MAX_N = 16
MAX_CHOICES = 64
MAX_PROMPTS = 64
MAX_TOOLS = 128  # OpenAI's bound
# The engine's bound (sampling_params.MAX_BAD_WORDS; each word is matched at every step), restated
# here because the router, which checks bodies with these models, may not import the engine.
MAX_BAD_WORDS = 64
BadWord = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TOKEN_ID_KEY = re.compile(r"[0-9]{1,9}")


class _Strict(BaseModel):
    # As OpenAI's API: a field of the wrong JSON type (a number sent as a string, a boolean as 1)
    # is a 400 naming it, not coerced; an integer where a number is expected is a number.
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: object) -> object:
        """``"temperature": null`` means the default, as in OpenAI's API; a required field's
        null is still refused (by its own type's message)."""
        if not isinstance(data, dict):
            return data
        optional = _optional_keys(cls)
        return {k: v for k, v in data.items() if v is not None or k not in optional}


@functools.cache
def _optional_keys(model: type[BaseModel]) -> frozenset[str]:
    """The keys of a model's fields that have a default (read once per model, not per request)."""
    return frozenset(f.alias or k for k, f in model.model_fields.items() if not f.is_required())


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(default=False, description="vLLM: usage on every streamed chunk")


class JsonSchema(_Strict):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's structured output: ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format.json_schema.schema: required when type is json_schema")
        return self


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one constraint on the output's text, a JSON schema
    (an object, or its text), a regular expression, one of a list of strings, a grammar (Lark or
    llama.cpp's GBNF, as vLLM's guidance backend takes it) or any JSON object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, min_length=1)
    choice: list[str] | None = Field(default=None, min_length=1, max_length=1024)
    grammar: str | None = Field(default=None, min_length=1)
    json_object: bool | None = None
    # vLLM's options that change nothing here: JSON is written without free whitespace already,
    # and there is one grammar backend to fall back from.
    disable_any_whitespace: bool = False
    disable_fallback: bool = False

    @field_validator("json_", mode="after")
    @classmethod
    def _schema_text(cls, v: dict[str, Any] | str | None) -> dict[str, Any] | None:
        if not isinstance(v, str):
            return v
        try:
            schema = json.loads(v)
        except ValueError:
            raise ValueError("not a JSON schema: the text is not JSON") from None
        if not isinstance(schema, dict):
            raise ValueError("not a JSON schema: an object is expected")
        return schema

    def _given(self) -> list[tuple[str, Any]]:
        """The constraints set, as the grammar compiler's kind and spec (json_object: a JSON
        schema of None, any JSON object)."""
        kinds: list[tuple[str, Any]] = [
            ("json", self.json_), ("regex", self.regex), ("choice", self.choice), ("grammar", self.grammar)
        ]  # fmt: skip
        given = [(kind, spec) for kind, spec in kinds if spec is not None]
        return [*given, ("json", None)] if self.json_object else given

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        if len(self._given()) != 1:
            raise ValueError("structured_outputs: exactly one of json, regex, choice, grammar or json_object")
        return self

    def constraint(self) -> tuple[str, Any]:
        """The grammar compiler's kind and spec (see ``structured.Grammars.compile``)."""
        (given,) = self._given()
        return given


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0, description="vLLM extension; 0 is off")
    min_p: float = Field(default=0.0, ge=0, le=1, description="vLLM extension: drop tokens below min_p x the top one's")
    ignore_eos: bool = Field(default=False, description="vLLM extension: generate max_tokens whatever the model says")
    seed: int | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N, description="choices per prompt; they share the prompt's KV blocks")
    best_of: int | None = Field(default=None, description="accepted only equal to n: no hidden samples are drawn")
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=2, description="vLLM extension; 1 is off")
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT, description="vLLM extension")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, max_length=MAX_STOPS, description="vLLM extension"
    )
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, min_length=1, description="vLLM extension: the only tokens that may be drawn (bounded by the engine)"
    )
    bad_words: list[BadWord] | None = Field(
        default=None, max_length=MAX_BAD_WORDS,
        description="vLLM extension: words never generated, at the text's start or after a space",
    )  # fmt: skip
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        default=None, max_length=300, description="token id (as a string) -> bias added to its logit"
    )
    skip_special_tokens: bool = Field(default=True, description="vLLM extension: special tokens left out of the text")
    include_stop_str_in_output: bool = Field(default=False, description="vLLM extension: the text ends after the stop")
    return_tokens_as_token_ids: bool = Field(
        default=False, description="vLLM extension: log-probabilities name tokens as 'token_id:{id}'"
    )
    return_token_ids: bool = Field(
        default=False, description="vLLM extension: choices carry token_ids, and the prompt's prompt_token_ids"
    )
    truncate_prompt_tokens: int | None = Field(
        default=None, ge=-1, description="vLLM extension: keep the prompt's last k tokens (-1: max_model_len)"
    )
    truncation_side: Literal["left", "right"] | None = Field(
        default=None, description="vLLM extension: truncate_prompt_tokens keeps the last tokens (left, the default) or the first"
    )
    prompt_logprobs: int | None = Field(
        default=None, ge=0, le=20,
        description="vLLM extension: each prompt token's log-probability, rank and this many alternatives",
    )  # fmt: skip
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(default=None, description="vLLM extension")
    cache_salt: str | None = Field(
        default=None, min_length=1, max_length=256,
        description="vLLM extension: only requests of the same tenant with the same salt share cached prompt blocks",
    )  # fmt: skip
    priority: int = Field(
        default=0, description="vLLM extension: only 0 here; requests are scheduled by their tenants' fair shares"
    )
    # OpenAI fields that change nothing a model computes here: accepted, as OpenAI's own server does.
    user: str | None = None
    safety_identifier: str | None = Field(default=None, description="OpenAI's successor to user")
    prompt_cache_key: str | None = Field(default=None, description="OpenAI's cache hint; here caching is by tenant and salt")
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")  # as OpenAI and vLLM answer
        return self

    @field_validator("priority")
    @classmethod
    def _no_priorities(cls, v: int) -> int:
        if v != 0:  # as vLLM answers where priority scheduling is off
            raise ValueError("only 0: this server schedules requests by their tenants' fair shares, not by priority")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_a_token(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be -1 (the model's context) or at least 1")
        return v

    @model_validator(mode="after")
    def _one_output_format(self) -> _Sampling:
        if self.structured_outputs is not None and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("structured_outputs: not together with a response_format other than text")
        return self

    def output_constraint(self) -> tuple[str, str, Any] | None:
        """What the output is constrained to, if anything: the field that asked, and the grammar
        compiler's kind and spec."""
        if self.structured_outputs is not None:
            return ("structured_outputs", *self.structured_outputs.constraint())
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        schema = fmt.json_schema.schema_ if fmt.type == "json_schema" and fmt.json_schema is not None else None
        return "response_format", "json", schema

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> _Sampling:
        # No chunk carries them. vLLM refuses a positive value with stream and lets 0 through
        # (to give nothing); 0 is refused here too rather than accepted and ignored.
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available when stream is true")
        return self

    @model_validator(mode="after")
    def _best_of_is_n(self) -> _Sampling:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: only best_of equal to n ({self.n}) is supported")
        return self

    @field_validator("bad_words")
    @classmethod
    def _words_spell_something(cls, v: list[str] | None) -> list[str] | None:
        for i, word in enumerate(v or []):
            if not word.strip():
                raise ValueError(f"bad_words[{i}]: a word must have more than whitespace")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        seen: set[int] = set()
        for key in v or {}:
            if not TOKEN_ID_KEY.fullmatch(key):  # ASCII digits only: str.isdigit() takes "²", which int() refuses
                raise ValueError(f"logit_bias: key {key!r} is not a token id")
            if int(key) in seen:  # "01" and "1": one token biased twice, past the bound
                raise ValueError(f"logit_bias: token {int(key)} is given twice")
            seen.add(int(key))
        return v

    def bias_list(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), v) for k, v in (self.logit_bias or {}).items())

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="text, token ids, or a list of either (one choice per prompt and per n)"
    )
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS_LIMIT, description="0 only with echo: the prompt alone")
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = Field(default=False, description="the prompt before the completion (and with logprobs, its tokens' entries)")
    add_special_tokens: bool = Field(default=True, description="vLLM extension: the tokenizer's BOS (and such) on text prompts")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: object) -> object:
        """OpenAI's four prompt shapes, with an error that names the one expected rather than
        the union's four attempts."""
        shape = "a string, a list of strings, a list of token ids or a list of lists of token ids"
        if isinstance(v, str):
            if not v:
                raise ValueError("must not be empty")
            return v
        if not isinstance(v, list) or not v:
            raise ValueError(f"must be {shape}, and not empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            if any(t < 0 for t in v):
                raise ValueError("token ids must not be negative")
            return v
        if len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
        for i, item in enumerate(v):
            ok = (isinstance(item, str) and item) or (
                isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in item)
            )
            if not ok or type(item) is not type(v[0]):
                raise ValueError(f"[{i}]: must be {shape}; each entry non-empty and of one kind")
        return v

    @model_validator(mode="after")
    def _bounded_choices(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 only with echo, which returns the prompt alone")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ValueError(f"prompt: the number of prompts times n must be at most {MAX_CHOICES}")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string, or one list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)  # type: ignore[arg-type]


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

    def tool_answer(self) -> ToolAnswer | None:
        """How the answers become calls (None: they are text)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return ToolAnswer(self.tool_choice.function.name)
        return ToolAnswer(None) if self.tool_choice == "required" else None

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


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose KV came from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


def new_id(prefix: str, sep: str = "-") -> str:
    """An id as OpenAI spells its kind's: ``chatcmpl-…``, and the Responses API's ``resp_…``."""
    return f"{prefix}{sep}{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "loraplane"
    root: str | None = Field(default=None, description="what it is served from: the base's source, an adapter's URI")
    parent: str | None = None
    max_model_len: int | None = Field(default=None, description="vLLM's field: prompt and completion tokens together")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# vLLM's /tokenize and /detokenize ------------------------------------------------------------


class TokenizeCompletionRequest(_Strict):
    model: str
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplating):
    """A conversation as ``/v1/chat/completions`` would template it."""

    model: str
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str
