"""Kubernetes condition bookkeeping: a condition's lastTransitionTime moves only when its status
does, so `kubectl describe` shows when a thing actually changed, not when it was last looked at."""

from __future__ import annotations

import datetime as dt
from typing import Literal

from loraplane.operator.api.common import Condition

Status = Literal["True", "False", "Unknown"]


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def set_condition(
    conditions: list[Condition], type_: str, status: Status, reason: str, message: str = "", generation: int | None = None
) -> list[Condition]:
    """A new list with ``type_`` set; the others untouched and in their order."""
    old = next((c for c in conditions if c.type == type_), None)
    when = old.last_transition_time if old is not None and old.status == status else now_rfc3339()
    new = Condition(
        type=type_, status=status, reason=reason, message=message, last_transition_time=when, observed_generation=generation
    )
    if old is None:
        return [*conditions, new]
    return [new if c.type == type_ else c for c in conditions]


def condition(conditions: list[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)
