"""Per-request sampling settings, with the OpenAI/vLLM names and ranges."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# (token ids generated so far, logits [vocab]) -> logits. vLLM's per-request hook; the engine's
# tests also use it to read the raw logits without a debug switch in the engine.
LogitsProcessor = Callable[[list[int], Any], Any]


class SamplingError(ValueError):
    pass


# Below this a temperature divides the logits into infinities: it is greedy in all but name (vLLM
# uses the same cut-off).
GREEDY_BELOW = 1e-5
SEED_RANGE = 2**64  # torch.Generator.manual_seed takes a 64-bit seed


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    logits_processors: Sequence[LogitsProcessor] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.temperature <= 2:
            raise SamplingError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must not be empty")
        if self.seed is not None and not 0 <= self.seed < SEED_RANGE:
            # Any integer is a valid seed to a client; the generator takes 64 bits of it.
            object.__setattr__(self, "seed", self.seed % SEED_RANGE)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1
