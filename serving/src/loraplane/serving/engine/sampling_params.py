"""Per-request sampling settings, with the OpenAI/vLLM names and ranges."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# (token ids generated so far, logits [vocab]) -> logits. vLLM's per-request hook; the engine's
# tests also use it to read the raw logits without a debug switch in the engine.
LogitsProcessor = Callable[[list[int], Any], Any]


class SamplingError(ValueError):
    """A setting out of its range; ``param`` names it (the API's 400 says which field)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# Below this a temperature divides the logits into infinities: it is greedy in all but name (vLLM
# uses the same cut-off).
GREEDY_BELOW = 1e-5
SEED_RANGE = 2**64  # torch.Generator.manual_seed takes a 64-bit seed
# OpenAI's bounds for its penalties and logit biases; vLLM's repetition_penalty is a divisor > 0,
# bounded here so it cannot overflow a logit.
MAX_PENALTY = 2.0
MAX_REPETITION_PENALTY = 2.0
MIN_REPETITION_PENALTY = 0.01  # below it a positive logit divided by it overflows float32 to inf
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit on the number of biased tokens
# vLLM sets no bound; the mask is built at every step of a batch others share, so it is bounded.
MAX_ALLOWED_TOKEN_IDS = 4096
# vLLM sets no bound on bad_words either; each is matched against the output's tail at every step.
MAX_BAD_WORDS = 64
MAX_BAD_WORD_TOKENS = 64


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # vLLM's: tokens less likely than min_p x the most likely one are dropped
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's, and this many alternatives
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), as OpenAI's map
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: when given, the only tokens that may be drawn
    # vLLM's ``bad_words``, as the token sequences that spell them (``Tokenizer.bad_words_ids``):
    # a sequence's last token is ruled out wherever the output ends with the others.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    skip_special_tokens: bool = True  # vLLM's: special tokens are left out of the text
    include_stop_str_in_output: bool = False  # vLLM's: the text ends after the stop string, not before it
    # A structured-output constraint: a factory of per-sequence matchers (see structured.py).
    guide: Any = field(default=None, compare=False)
    logits_processors: Sequence[LogitsProcessor] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens")
        if not 0 <= self.temperature <= 2:
            raise SamplingError(f"temperature must be in [0, 2], got {self.temperature}", param="temperature")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if not 0 <= self.min_p <= 1:
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be 0 (off) or positive, got {self.top_k}", param="top_k")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingError(f"logprobs must be in [0, 20], got {self.logprobs}", param="logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise SamplingError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}", param="prompt_logprobs")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise SamplingError(f"{name} must be in [-2, 2], got {value}", param=name)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise SamplingError(
                f"repetition_penalty must be in [0.01, 2], got {self.repetition_penalty}", param="repetition_penalty"
            )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}", param="min_tokens"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise SamplingError(f"logit_bias may bias at most {MAX_LOGIT_BIAS_ENTRIES} tokens", param="logit_bias")
        for token, bias in self.logit_bias:
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise SamplingError(
                    f"logit_bias: token {token} must be a token id with a bias in [-100, 100], got {bias}", param="logit_bias"
                )
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS or any(t < 0 for t in self.allowed_token_ids):
            raise SamplingError(
                f"allowed_token_ids: at most {MAX_ALLOWED_TOKEN_IDS} token ids, none negative", param="allowed_token_ids"
            )
        if len(self.bad_words_token_ids) > 2 * MAX_BAD_WORDS or any(
            not 0 < len(w) <= MAX_BAD_WORD_TOKENS or min(w) < 0 for w in self.bad_words_token_ids
        ):
            raise SamplingError(
                f"bad_words: at most {MAX_BAD_WORDS} words of 1 to {MAX_BAD_WORD_TOKENS} tokens each, no token id negative",
                param="bad_words",
            )
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must not be empty", param="stop")
        if self.seed is not None and not 0 <= self.seed < SEED_RANGE:
            # Any integer is a valid seed to a client; the generator takes 64 bits of it.
            object.__setattr__(self, "seed", self.seed % SEED_RANGE)

    @property
    def penalised(self) -> bool:
        """Whether the sampler has work to do on this request's row before drawing: what reads the
        output so far, or a bias or an allowed list."""
        return self.reads_output or bool(self.logit_bias or self.allowed_token_ids)

    @property
    def reads_output(self) -> bool:
        """Whether adjusting this request's row reads the tokens generated so far (penalties,
        ``min_tokens``, bad words): what async scheduling cannot do while the last one is still on
        the device. A bias or an allowed list is the same for every step."""
        return bool(
            self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0 or self.min_tokens
            or self.bad_words_token_ids
        )  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1
