"""The sums a bill is made of, counted from records the same way wherever they are summed (a
replica's rollup, the report's rows, the operator's status)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from loraplane.usage.record import Outcome, UsageRecord


class Totals(BaseModel):
    model_config = ConfigDict(extra="ignore")

    requests: int = 0  # reached an engine (completed, aborted or failed)
    refused: int = 0
    aborted: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def count(self, record: UsageRecord) -> None:
        if record.outcome is Outcome.REFUSED:
            self.refused += 1
        else:
            self.requests += 1
            self.aborted += record.outcome is Outcome.ABORTED
            self.failed += record.outcome is Outcome.FAILED
        self.prompt_tokens += record.prompt_tokens
        self.cached_prompt_tokens += record.cached_prompt_tokens
        self.completion_tokens += record.completion_tokens

    def add(self, other: Totals) -> None:
        for name in Totals.model_fields:
            setattr(self, name, getattr(self, name) + getattr(other, name))
