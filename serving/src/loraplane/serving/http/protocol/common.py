"""What every OpenAI body here shares: strict parsing (unknown fields refused with a 400, a wrong
JSON type named rather than coerced, ``null`` as unset for optional fields), the bounds a request
is held to, usage blocks, ids and model cards.

Unknown fields are refused rather than ignored: a client that sends ``suffix`` or ``best_of`` above
``n`` expecting them to work should hear that they do not. Documented OpenAI fields that change
nothing here (``user``, ``metadata``, ``store``, ...) are accepted, and so is ``null`` for any
optional field: OpenAI's schema marks them nullable, and clients (and the answers they send back
as conversation turns) carry nulls for what they leave unset. The models of this package are the
single source of truth for the OpenAPI schema FastAPI publishes; the router checks bodies with
them too, so nothing here imports the engine.
"""

from __future__ import annotations

import functools
import re
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
# A served model's name: an adapter's is a DNS-style name, a base's an id or a path. Bounded, since
# a refused request's usage record carries what it named.
MAX_MODEL_NAME = 1024
ModelName = Annotated[str, Field(max_length=MAX_MODEL_NAME)]


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
