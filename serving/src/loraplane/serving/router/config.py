"""The router's settings: where the replicas are, how to route, how quickly to notice change."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: list[str] = Field(default_factory=list, description="static replica URLs")
    service: str | None = Field(default=None, description="discover replicas from this Service's EndpointSlices")
    namespace: str = "default"
    policy: Literal["affinity", "round-robin"] = "affinity"
    epsilon: float = Field(default=0.25, ge=0, description="no replica above (1+epsilon) x the mean in-flight load")
    stats_interval: float = Field(default=1.0, gt=0, description="seconds between reads of each replica's stats")
    connect_timeout: float = Field(default=2.0, gt=0, description="a replica that does not accept by then is down")

    @model_validator(mode="after")
    def _one_source(self) -> RouterConfig:
        if bool(self.replicas) == bool(self.service):
            raise ValueError("give either replica URLs or a Service to discover them from, not both")
        return self
