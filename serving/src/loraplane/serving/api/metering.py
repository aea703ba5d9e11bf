"""The server's side of billing: one ``UsageRecord`` per request that reached the engine, built
from the outputs that passed by, handed to the process's ``Metering`` exactly once.

A request with several prompts or ``n`` > 1 runs as one engine sequence per choice; its record
counts each prompt once (the samples of a prompt share its KV blocks, and OpenAI bills it once)
and every choice's completion."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from loraplane.serving.engine.outputs import RequestOutput
from loraplane.serving.engine.sequence import FinishReason
from loraplane.usage import Metering, Outcome, UsageRecord

OUTCOMES = {
    FinishReason.STOP: Outcome.COMPLETED,
    FinishReason.LENGTH: Outcome.COMPLETED,
    FinishReason.ABORT: Outcome.ABORTED,
    FinishReason.ERROR: Outcome.FAILED,
}
SEVERITY = {Outcome.COMPLETED: 0, Outcome.ABORTED: 1, Outcome.FAILED: 2}


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
    billed_as: str | None = None  # the adapter a dedicated replica's model is (its records name it, as the shared pool's do)
    started: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    settled: bool = False
    # engine request id -> (prompt index, choice index), and the latest output of each choice
    choices: dict[str, tuple[int, int]] = field(default_factory=dict)
    outputs: dict[str, RequestOutput] = field(default_factory=dict)

    def expect(self, request_id: str, prompt: int, choice: int) -> None:
        self.choices[request_id] = (prompt, choice)

    def seen(self, out: RequestOutput) -> None:
        if self.first_token is None and out.token_ids:
            self.first_token = time.monotonic()
        self.outputs[out.request_id] = out

    def tokens(self) -> tuple[int, int, int]:
        """Prompt tokens (each prompt once), cached prompt tokens (the first sample's of each
        prompt, which met the cache before its siblings shared it) and completion tokens."""
        first: dict[int, tuple[int, RequestOutput]] = {}
        for rid, out in self.outputs.items():
            prompt, choice = self.choices.get(rid, (0, 0))
            if prompt not in first or choice < first[prompt][0]:
                first[prompt] = (choice, out)
        prompt_tokens = sum(len(out.prompt_token_ids) for _, out in first.values())
        cached = sum(out.num_cached_tokens for _, out in first.values())
        return prompt_tokens, cached, sum(len(out.token_ids) for out in self.outputs.values())

    def _outcome(self) -> tuple[Outcome, RequestOutput | None]:
        """The worst of the choices' outcomes (a choice that never reported, or reported no
        finish, ended early: the client went away), and the output that decided it."""
        if len(self.outputs) < max(1, len(self.choices)):
            return Outcome.ABORTED, next(iter(self.outputs.values()), None)
        worst = max(self.outputs.values(), key=lambda o: SEVERITY[self._one(o)])
        return self._one(worst), worst

    @staticmethod
    def _one(out: RequestOutput) -> Outcome:
        return OUTCOMES.get(out.finish_reason, Outcome.ABORTED) if out.finish_reason else Outcome.ABORTED

    def _record(self) -> UsageRecord:
        now = time.monotonic()
        outcome, out = self._outcome()
        prompt_tokens, cached, completion = self.tokens()
        return UsageRecord(
            request_id=self.request_id,
            replica=self.metering.replica,
            tenant=self.tenant,
            model=self.model,
            adapter=self.billed_as or self.adapter,
            adapter_version=out.adapter_version if out else None,
            adapter_digest=out.adapter_digest if out else None,
            base=self.base,
            endpoint=self.endpoint,
            prompt_tokens=prompt_tokens,
            cached_prompt_tokens=cached,
            completion_tokens=completion,
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
