"""``POST /v1/completions``: text or token-id prompts, batched, with the legacy ``logprobs`` and ``echo``."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from loraplane.serving.http.protocol.common import MAX_CHOICES, MAX_PROMPTS, MAX_TOKENS_LIMIT
from loraplane.serving.http.protocol.sampling import _Sampling

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's max_tokens for /v1/completions when the body gives none


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
