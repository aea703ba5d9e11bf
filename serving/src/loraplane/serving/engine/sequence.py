"""One request's tokens and progress through the engine.

``num_computed_tokens`` counts tokens whose keys and values are in the KV cache; the scheduler
advances it by the number of tokens it schedules, so prompts can be prefilled in chunks and a
preempted sequence simply restarts at zero (recompute) with its generated tokens kept.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from loraplane.serving.engine.detokenizer import Detokenizer
from loraplane.serving.engine.sampling_params import SamplingParams

_ids = itertools.count()

# An output token sampled on the device and not read back yet (async scheduling): it holds the
# token's place, so lengths, KV slots and the scheduler's arithmetic are already right, and the
# step that feeds it to the model takes its value from the device (``ModelRunner``'s feed).
PENDING = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"  # out of the batch with its blocks kept, until its adapter has a slot again
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens, most likely first
    rank: int | None = None  # 1 + how many tokens are more likely (vLLM's ``Logprob.rank``); prompt entries


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    adapter_slot: int = -1
    adapter_key: str | None = None
    tenant: str | None = None
    cache_scope: str | None = None  # only sequences of one scope share cached prompt blocks
    arrival_time: float = 0.0
    arrival_tier: str | None = None  # where the adapter was when the request arrived
    first_scheduled_time: float | None = None  # when it was first admitted into a batch (vLLM's name)
    holds_adapter: bool = False  # counted in the adapter's running sequences (protects its slot)
    adapter_lease: object | None = None  # the adapter version it holds (opaque to the scheduler)
    adapter_version: str | None = None  # the version it runs on, bound at admission (for usage records)
    adapter_digest: str | None = None
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # With params.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts
    # it) and for those not computed yet (see prompt_logprobs.py).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0  # times it was sent back to the queue to be recomputed
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    output_text: str = ""
    detokenizer: Detokenizer | None = None  # the output's text so far (set by the engine)
    leader: Sequence | None = None  # a sibling sample (n > 1) waits for this one's prompt to be cached
    matcher: Any = None  # the structured-output grammar state (an llguidance matcher), when guided
    error: str | None = None
    error_code: str | None = None  # adapter_load_failed, sampling_failed or engine_error

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` without building the whole list (the runner's per-step read)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def awaits_token(self) -> bool:
        """Whether its last token is still in flight (async scheduling): it is fed to the model
        from the device, so no step may recompute it from the host's tokens until it is read back."""
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PENDING

    @property
    def held(self) -> bool:
        """Whether its token in flight is its last (async scheduling): it reaches ``max_tokens``,
        so the sequence finishes when that token is read back and gets no step meanwhile. The
        engine refuses a prompt whose ``max_tokens`` would pass ``max_model_len``, so this
        covers the context length too."""
        return self.awaits_token and len(self.output_token_ids) >= self.params.max_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
