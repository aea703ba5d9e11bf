"""The sampling fields completions and chat share (OpenAI's and vLLM's extras), and the output
formats a request may constrain its answer to (``response_format``, vLLM's ``structured_outputs``)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from loraplane.serving.http.protocol.common import (
    MAX_BAD_WORDS,
    MAX_N,
    MAX_STOPS,
    MAX_TOKENS_LIMIT,
    TOKEN_ID_KEY,
    BadWord,
    ModelName,
    StopString,
    StreamOptions,
    _Strict,
)  # fmt: skip


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
    model: ModelName
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
