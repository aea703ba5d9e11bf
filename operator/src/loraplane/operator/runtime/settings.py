"""The operator's own settings, from the environment (the chart sets them from values and a Secret)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from loraplane.operator.runtime.admission import ClusterPolicy


class OperatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LORAPLANE_")

    allowed_sources: list[str] | None = Field(
        default=None,
        description='URI prefixes (JSON list) every LoraAdapter\'s source must be under, e.g. ["s3://adapters/"]; unset: any',
    )
    allowed_endpoints: list[str] | None = Field(
        default=None,
        description="S3 endpoints (JSON list) a BaseModel's adapterStore may name: the operator fetches from them from "
        "inside the cluster; AWS's own (an empty endpoint) always goes; unset: any",
    )
    tenant_per_namespace: bool = Field(
        default=False,
        description="where a BaseModel lists no tenants, a LoraAdapter's tenant must be its namespace's name, so a "
        "namespace user cannot publish to another tenant's key",
    )
    metrics_namespaces: list[str] | None = Field(
        default=None,
        description="namespaces (JSON list) whose pods may scrape the serving and router pods' metrics port; unset: any pod",
    )
    operator_namespace: str | None = Field(
        default=None, description="the operator's own namespace (the chart sets it); serving pods' NetworkPolicy admits it"
    )
    sync_interval: float = Field(default=10.0, gt=0, description="seconds between a BaseModel's sync with its replicas")
    metrics_interval: float = Field(default=30.0, ge=0, description="at most one metrics write per adapter per this many seconds")
    metrics_refresh: float = Field(
        default=300.0, gt=0, description="after this many seconds any changed figure is written, however small the change"
    )
    webhook_port: int | None = Field(default=None, description="serve the validating webhook on this port (kopf, self-signed)")
    webhook_host: str | None = Field(default=None, description="the hostname the API server reaches the webhook at")
    webhook_service: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9-]+/[a-z0-9-]+$",
        description="namespace/name of the Service in front of the webhook (the chart sets it): the configuration names "
        "it instead of a URL, since the API server resolves no cluster DNS; overrides webhook_host",
    )
    retry_delay: float = Field(default=5.0, gt=0, description="seconds before retrying a step that waits on something")
    resync_interval: float = Field(
        default=30.0, gt=0, description="seconds an adapter left unfinished and unchanged waits before it is handled again"
    )

    def policy(self, namespace: str) -> ClusterPolicy:
        """The allow-lists and tenant binding as they apply to an adapter in ``namespace``."""
        tenant = namespace if self.tenant_per_namespace else None
        return ClusterPolicy(self.allowed_sources, self.allowed_endpoints, tenant)
