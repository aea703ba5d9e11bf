"""One usage record per request that reached a replica's engine, and one per request the router
refused at the edge: the unit a billing job counts.

``request_id`` is the id the client saw in the response body (``cmpl-…``/``chatcmpl-…``), so a
customer's dispute can be matched to a record, and the report de-duplicates on it: a segment
uploaded twice after a crash between upload and delete counts once.
"""

from __future__ import annotations

import enum
import time

from pydantic import BaseModel, ConfigDict, Field


class Outcome(enum.StrEnum):
    COMPLETED = "completed"  # finished with stop or length
    ABORTED = "aborted"  # the client went away before the end
    FAILED = "failed"  # the engine failed the request (tokens produced so far are still counted)
    REFUSED = "refused"  # the router refused it at the edge (quota, no replica); never reached an engine


class UsageRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")  # newer writers may add fields; old reports still read them

    request_id: str = Field(min_length=1)
    time: float = Field(default_factory=time.time, description="unix seconds when the request finished")
    source: str = Field(default="replica", description="'replica' or 'router'")
    replica: str = ""
    tenant: str | None = None
    model: str = Field(default="", description="the model name the client asked for")
    adapter: str | None = None
    adapter_version: str | None = None
    adapter_digest: str | None = None
    base: str | None = None
    endpoint: str = ""
    prompt_tokens: int = Field(default=0, ge=0)
    cached_prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)
    ttft_seconds: float | None = None
    duration_seconds: float = 0.0
    outcome: Outcome
    finish_reason: str | None = None
    status_code: int | None = Field(default=None, description="HTTP status of a refusal")
