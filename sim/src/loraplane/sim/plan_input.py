"""The capacity planner's input: a base model, a budget, and the table of fine-tunes.

A YAML (or JSON) file holds the base, the budget and the planning knobs; the fine-tunes come
inline or from a CSV next to it (``name,share|rps,rank[,size_mb]``), since 500 rows read better
as a table than as YAML.
"""

from __future__ import annotations

from pathlib import Path
from typing import Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from loraplane.adapter_format.base_shape import LLAMA_TARGETS, BaseShape
from loraplane.routing.dominance import DominanceRule
from loraplane.sim.table_rows import csv_rows, validate_row


class PlanInputError(ValueError):
    """The plan input cannot be used; the message names the file (and line for CSV rows)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PlannedBase(BaseShape):
    """The base's shape plus what every adapter of the fleet targets, to size adapters from rank."""

    target_modules: list[str] = Field(default_factory=lambda: list(LLAMA_TARGETS))
    adapter_dtype_bytes: int = Field(default=2, gt=0)

    def adapter_mb(self, rank: int) -> float:
        try:
            return self.adapter_bytes(rank, self.target_modules, self.adapter_dtype_bytes) / 2**20
        except KeyError as exc:
            raise PlanInputError(str(exc.args[0])) from None


class Budget(_Strict):
    gpu_adapter_memory_gib: float = Field(gt=0, description="device memory per replica set aside for adapter slots")
    host_memory_gib: float = Field(gt=0, description="host memory per replica for the adapter cache")
    max_replicas: int = Field(gt=0)
    replica_rps: float = Field(gt=0, description="requests/s one replica sustains at the target latency")
    max_num_seqs: int = Field(default=32, gt=0, description="concurrent sequences per replica")


class Knobs(_Strict):
    dedicated_share: float = Field(
        default=DominanceRule.share,
        gt=0,
        le=1,
        description="an adapter with at least this share of the base's requests dominates it and gets a merged "
        "dedicated deployment (the operator's BaseModel dedicated.share, the same rule)",
    )
    dedicated_min_rps: float = Field(
        default=DominanceRule.min_rps, ge=0, description="and at least this many requests/s of its own"
    )
    max_dedicated: int = Field(default=DominanceRule.max_dedicated, ge=0, description="dedicated deployments at most")
    rank_cap_coverage: float = Field(
        default=0.99, gt=0, le=1, description="share of shared traffic the rank cap must serve untruncated"
    )
    headroom: float = Field(default=0.1, ge=0, lt=1, description="memory kept free in each tier")
    target_utilization: float = Field(default=0.7, gt=0, le=1)
    policy: str = "tinylfu"
    requests_to_simulate: int = Field(default=50_000, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: object) -> object:
        if isinstance(data, dict) and "merge_replica_fraction" in data:
            raise ValueError(
                "merge_replica_fraction was replaced by dedicated_share: a dedicated deployment is for an adapter "
                "that dominates the base's traffic, the rule the operator applies (docs/operator-guide.md)"
            )
        return data


class FineTune(_Strict):
    name: str = Field(min_length=1)
    share: float | None = Field(default=None, ge=0, description="fraction of total traffic")
    rps: float | None = Field(default=None, ge=0, description="requests per second")
    rank: int = Field(gt=0)
    size_mb: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_traffic_figure(self) -> Self:
        if (self.share is None) == (self.rps is None):
            raise ValueError("give exactly one of share or rps")
        return self


class PlanInput(_Strict):
    base: PlannedBase
    budget: Budget
    total_rps: float | None = Field(default=None, gt=0, description="needed when adapters give traffic as shares")
    knobs: Knobs = Knobs()
    adapters: list[FineTune] | str = Field(description="inline list, or a CSV path relative to this file")

    def fine_tunes(self) -> list[FineTune]:
        assert isinstance(self.adapters, list), "load_plan_input resolves CSV paths"
        return self.adapters


def _read_csv(path: Path) -> list[FineTune]:
    if not path.is_file():
        raise PlanInputError(f"{path}: no such adapter table")
    with path.open(newline="", encoding="utf-8") as fh:
        rows = [validate_row(FineTune, row, f"{path}:{line}", PlanInputError) for line, row in csv_rows(path, fh, PlanInputError)]
    if not rows:
        raise PlanInputError(f"{path}: the adapter table is empty")
    return rows


def load_plan_input(path: str | Path) -> PlanInput:
    path = Path(path)
    if not path.is_file():
        raise PlanInputError(f"{path}: no such file")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise PlanInputError(f"{path}: not valid YAML: {exc}") from None
    try:
        spec = PlanInput.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
        raise PlanInputError(f"{path}: {problems}") from None
    if isinstance(spec.adapters, str):
        spec = spec.model_copy(update={"adapters": _read_csv(path.parent / spec.adapters)})
    names = [f.name for f in spec.fine_tunes()]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise PlanInputError(f"{path}: adapter {dup!r} appears more than once")
    if any(f.share is not None for f in spec.fine_tunes()) and spec.total_rps is None:
        raise PlanInputError(f"{path}: adapters give traffic as shares, so total_rps is required")
    return spec
