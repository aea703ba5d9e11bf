"""The server's side of billing: one ``UsageRecord`` per request that reached the engine, built
from the outputs that passed by, handed to the process's ``Metering`` exactly once."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from loraplane.serving.engine.llm_engine import RequestOutput
from loraplane.serving.engine.sequence import FinishReason
from loraplane.usage import Metering, Outcome, UsageRecord

OUTCOMES = {
    FinishReason.STOP: Outcome.COMPLETED,
    FinishReason.LENGTH: Outcome.COMPLETED,
    FinishReason.ABORT: Outcome.ABORTED,
    FinishReason.ERROR: Outcome.FAILED,
}


@dataclass
class RequestMeter:
    """One request's figures as its outputs pass by; ``settle`` builds its record exactly once."""

    metering: Metering
    request_id: str
    endpoint: str
    model: str
    adapter: str | None
    tenant: str | None
    base: str
    started: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last: RequestOutput | None = None
    settled: bool = False

    def seen(self, out: RequestOutput) -> None:
        if self.first_token is None and out.token_ids:
            self.first_token = time.monotonic()
        self.last = out

    def _record(self) -> UsageRecord:
        """No finish reason yet means the stream ended early: the client went away."""
        out, now = self.last, time.monotonic()
        outcome = OUTCOMES.get(out.finish_reason, Outcome.ABORTED) if out is not None and out.finish_reason else Outcome.ABORTED
        return UsageRecord(
            request_id=self.request_id,
            replica=self.metering.replica,
            tenant=self.tenant,
            model=self.model,
            adapter=self.adapter,
            adapter_version=out.adapter_version if out else None,
            adapter_digest=out.adapter_digest if out else None,
            base=self.base,
            endpoint=self.endpoint,
            prompt_tokens=len(out.prompt_token_ids) if out else 0,
            cached_prompt_tokens=out.num_cached_tokens if out else 0,
            completion_tokens=len(out.token_ids) if out else 0,
            ttft_seconds=None if self.first_token is None else self.first_token - self.started,
            duration_seconds=now - self.started,
            outcome=outcome,
            finish_reason=out.finish_reason.value if out is not None and out.finish_reason else None,
        )

    async def settle(self) -> None:
        if not self.settled:
            self.settled = True
            await self.metering.record(self._record())

    def settle_nowait(self) -> None:
        if not self.settled:
            self.settled = True
            self.metering.record_nowait(self._record())
