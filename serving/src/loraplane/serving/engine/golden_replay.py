"""Replay an adapter's golden outputs on the serving base and measure the drift.

Teacher forcing through a logits processor: at every step the processor measures the raw logits
and then forces the golden token, so one early disagreement does not derail the rest of the
comparison. Agreement is the share of steps whose argmax is the golden token; KL compares the
recorded top log-probabilities with the serving base's, both renormalised over the recorded
tokens. Each step keeps those two figures, not its logits: a vocabulary-sized row per forced
step would be gigabytes for a large golden file at a 128k vocabulary, on the replica that
serves traffic beside the replay.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from loraplane.adapter_format.golden import DriftReport, GoldenCase, GoldenOutputs
from loraplane.serving.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine replays through this module at load time; only the type is needed here
    from loraplane.serving.engine.llm_engine import LLMEngine


class ForcedPath:
    """One golden case's logits processor: per step, whether the base's argmax is the golden token
    and the KL to the recorded top log-probabilities (where the file has them); then the golden
    token is forced."""

    def __init__(self, case: GoldenCase) -> None:
        self.golden, self.top = case.greedy_token_ids, case.top_logprobs
        self.agreed: list[bool] = []
        self.kls: list[float] = []

    def __call__(self, tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
        step = len(tokens)
        self.agreed.append(int(torch.argmax(logits)) == self.golden[step])
        if self.top is not None and step < len(self.top):
            self.kls.append(_kl(self.top[step], logits))
        forced = torch.full_like(logits, float("-inf"))
        forced[self.golden[step]] = 0.0
        return forced


def _kl(reference: dict[int, float], logits: torch.Tensor) -> float:
    ids = list(reference)
    p = torch.softmax(torch.tensor([reference[i] for i in ids], dtype=torch.float64), dim=0)
    q = torch.softmax(logits[ids].double(), dim=0)  # renormalised over the reference's tokens: the full softmax cancels
    return float((p * (p.clamp_min(1e-300).log() - q.clamp_min(1e-300).log())).sum())


def forced_requests(golden: GoldenOutputs, vocab_size: int) -> tuple[list[ForcedPath], list[SamplingParams]]:
    """One teacher-forced request per golden case: run them on any engine, then :func:`drift`.
    ``AdapterValidationError`` when the file names token ids this base does not have."""
    golden.check_vocabulary(vocab_size)
    paths = [ForcedPath(case) for case in golden.cases]
    params = [
        SamplingParams(max_tokens=len(case.greedy_token_ids), temperature=0, ignore_eos=True, logits_processors=[path])
        for case, path in zip(golden.cases, paths, strict=True)
    ]
    return paths, params


def drift(golden: GoldenOutputs, paths: list[ForcedPath]) -> DriftReport:
    steps = sum(len(path.agreed) for path in paths)
    agree = sum(sum(path.agreed) for path in paths)
    kls = [kl for path in paths for kl in path.kls]
    mean_kl = sum(kls) / len(kls) if kls else None
    if mean_kl is not None and not math.isfinite(mean_kl):
        mean_kl = float("inf")
    return DriftReport(cases=len(golden.cases), steps=steps, token_agreement=agree / max(steps, 1), mean_kl=mean_kl)


def replay_golden(engine: LLMEngine, adapter: str | None, golden: GoldenOutputs) -> DriftReport:
    """Synchronously, on an engine nobody else is stepping (loading at startup, tests)."""
    paths, params = forced_requests(golden, engine.base.config.vocab_size)
    engine.generate([case.prompt_token_ids for case in golden.cases], params, [adapter] * len(golden.cases))
    return drift(golden, paths)
