"""Golden outputs: a few prompts an adapter ships with the answers it gave on its training base.

The file ``golden_outputs.json`` sits next to the weights. Token ids rather than text keep it
independent of tokenizer versions. Replaying it on the serving base (for instance an FP8 copy
of the training base) measures drift that the name and revision checks cannot see: how often
the serving base, forced along the golden continuation, would pick the same next token, and how
far its next-token distribution is from the recorded top log-probabilities (KL over their
support). The replay itself needs the engine; the format and the verdict live here, torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loraplane.adapter_format.digest import GOLDEN_FILE
from loraplane.adapter_format.errors import AdapterValidationError, ErrorCode
from loraplane.adapter_format.small_files import read_capped

# A replay runs on the serving engine beside real traffic: the file bounds what it may ask of it.
MAX_CASES = 256
MAX_PROMPT_TOKENS = 8192
MAX_GREEDY_TOKENS = 1024
# And all its cases together: the replay's prompt tokens and forced steps (a customer's golden
# file is a few dozen cases of a few hundred tokens), and the file's bytes before it is parsed
# (JSON parses to several times its size in Python objects; top log-probabilities for 16,384
# steps at 20 alternatives each are about 6 MiB).
MAX_REPLAY_TOKENS = 65536
MAX_FORCED_TOKENS = 16384
MAX_GOLDEN_BYTES = 16 * 2**20


class GoldenCase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[int] = Field(min_length=1, max_length=MAX_PROMPT_TOKENS)
    greedy_token_ids: list[int] = Field(min_length=1, max_length=MAX_GREEDY_TOKENS)
    top_logprobs: list[dict[int, float]] | None = Field(
        default=None, max_length=MAX_GREEDY_TOKENS,
        description="per generated step, the training base's top log-probabilities by token id",
    )  # fmt: skip

    def token_ids(self) -> set[int]:
        ids = set(self.prompt_token_ids) | set(self.greedy_token_ids)
        for step in self.top_logprobs or []:
            ids |= set(step)
        return ids


class GoldenOutputs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cases: list[GoldenCase] = Field(min_length=1, max_length=MAX_CASES)

    def check_vocabulary(self, vocab_size: int) -> None:
        """Every token id must be one of the base's: outside it, a replay would index past the
        logits (an error inside the engine) instead of refusing the file."""
        for i, case in enumerate(self.cases):
            bad = sorted(t for t in case.token_ids() if not 0 <= t < vocab_size)
            if bad:
                raise AdapterValidationError(
                    ErrorCode.BAD_CONFIG,
                    f"{GOLDEN_FILE}: case {i} names token ids {bad[:5]} outside this base's vocabulary of {vocab_size}",
                )


class DriftLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    min_token_agreement: float = Field(default=0.9, ge=0, le=1)
    max_mean_kl: float = Field(default=0.1, ge=0)


class DriftReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    cases: int
    steps: int
    token_agreement: float
    mean_kl: float | None

    def check(self, limits: DriftLimits) -> None:
        if self.token_agreement < limits.min_token_agreement:
            raise AdapterValidationError(
                ErrorCode.GOLDEN_DRIFT,
                f"golden outputs agree on {100 * self.token_agreement:.1f}% of tokens on this base, "
                f"below {100 * limits.min_token_agreement:.0f}%",
            )
        if self.mean_kl is not None and self.mean_kl > limits.max_mean_kl:
            raise AdapterValidationError(
                ErrorCode.GOLDEN_DRIFT,
                f"mean KL to the golden log-probabilities is {self.mean_kl:.3f}, above {limits.max_mean_kl}",
            )


def load_golden(folder: Path) -> GoldenOutputs | None:
    """The folder's golden outputs (None without a file), refused with ``TooLarge`` past the
    byte cap (checked before anything is parsed) or the replay's token budget."""
    path = folder / GOLDEN_FILE
    if not path.is_file():
        return None
    data = read_capped(path, MAX_GOLDEN_BYTES)
    try:
        golden = GoldenOutputs.model_validate(json.loads(data.decode("utf-8")))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValidationError) as err:
        # not UTF-8 (found by the readers' fuzz test: it was a 500), not JSON, nested past the parser, or not golden outputs
        raise AdapterValidationError(ErrorCode.BAD_CONFIG, f"{GOLDEN_FILE}: {err}") from err
    forced = sum(len(c.greedy_token_ids) for c in golden.cases)
    total = forced + sum(len(c.prompt_token_ids) for c in golden.cases)
    if forced > MAX_FORCED_TOKENS or total > MAX_REPLAY_TOKENS:
        raise AdapterValidationError(
            ErrorCode.TOO_LARGE,
            f"{GOLDEN_FILE}: the replay would force {forced} tokens after {total - forced} prompt tokens; the limits "
            f"are {MAX_FORCED_TOKENS} forced and {MAX_REPLAY_TOKENS} in all",
        )
    return golden
