"""``--step-trace``: where a live server's time goes, one JSON line per event.

Prometheus histograms say how long first tokens took; they cannot say why. This record can: a
line per request the engine queues (its adapter, tenant and prompt length) and a line per
forward pass (when it began, how long it took, how many decodes, prompts and prompt tokens it
carried, its adapters, whether it ran between another step's layers, and whose first tokens it
gave). ``benchmarks/step_trace_report.py`` reads it: a fit of each step's length to what it
carried, how many steps a new request waited for its first, and its time to first token as the
engine saw it. ``make demo`` writes one beside its report.

Times are ``time.monotonic()`` seconds, the clock of ``Sequence.arrival_time``. Lines are written
as they happen (line-buffered, so nothing waits for a close) from the engine thread, so a trace
costs one small write per step; it is off unless asked for.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from loraplane.serving.engine.sequence import Sequence


class StepTrace:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._out = path.open("w", buffering=1, encoding="utf-8")  # started anew: one server's run

    def _write(self, event: dict[str, Any]) -> None:
        self._out.write(json.dumps(event, separators=(",", ":")) + "\n")

    def arrival(self, seq: Sequence) -> None:
        self._write({
            "event": "arrival", "t": seq.arrival_time, "request": seq.request_id, "adapter": seq.adapter,
            "tenant": seq.tenant, "prompt_tokens": len(seq.prompt_token_ids),
        })  # fmt: skip

    @staticmethod
    def prompt_chunks(items: list[tuple[Sequence, int]]) -> list[int]:
        """The tokens of each prompt chunk among ``items``, read before the pass computes them: a
        row is a decode only when its sequence's prompt is already computed and it computes one
        token (a one-token prompt, or a cached prompt's last token, is a prompt chunk)."""
        return [n for s, n in items if n > 1 or s.num_computed_tokens < len(s.prompt_token_ids)]

    def step(
        self,
        start: float,
        items: list[tuple[Sequence, int]],
        prompts: list[int],
        first_tokens: list[str],
        *,
        interjection: bool,
        failed: bool = False,
    ) -> None:
        """A forward pass that began at ``start`` over ``items`` (sequence, tokens computed),
        ``prompts`` its prompt chunks (``prompt_chunks``), that gave ``first_tokens`` (their
        request ids) or ``failed``. An interjection runs inside the step whose layers it ran
        between, so that step's length includes it."""
        self._write({
            "event": "step", "t": start, "ms": round(1e3 * (time.monotonic() - start), 3), "interjection": interjection,
            "decodes": len(items) - len(prompts), "prompts": len(prompts), "prompt_tokens": sum(prompts),
            "adapters": sorted({s.adapter for s, _ in items if s.adapter is not None}), "first_tokens": first_tokens,
            "failed": failed,
        })  # fmt: skip
