"""`LoraAdapter`: one customer fine-tune of a BaseModel, from its object-store URI and digest to the
slots that serve it."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from loraplane.adapter_format.names import ADAPTER_NAME_PATTERN
from loraplane.operator.api.common import DNS_LABEL, SOURCE_URI, Condition, KubeModel, ObjectMeta, Quotas

SOURCE_SCHEMES = ("s3", "file")
# A "." or ".." path segment: `s3://adapters/acme/../globex/x` would pass a prefix check for
# acme and read globex's files wherever the path is normalised (file://, some S3 servers). The
# same expression is the CRD's CEL rule (RE2) and the model's check.
DOT_SEGMENT = r"://(.*/)?[.][.]?(/|$)"
DOT_SEGMENT_RULE = f"!self.uri.matches('{DOT_SEGMENT}')"
DOT_SEGMENT_MESSAGE = "spec.source.uri may not contain . or .. path segments"


class AdapterSource(KubeModel):
    uri: str = Field(description="s3://bucket/prefix or file:///path: a PEFT folder", pattern=SOURCE_URI, max_length=2048)
    digest: str = Field(
        description="the adapter digest, as `loraplane digest FOLDER` prints it: sha256 over adapter_config.json, "
        "adapter_model.safetensors and golden_outputs.json (docs/gitops.md, Digests); the weights file's sha256 alone "
        "only where the BaseModel sets requireAdapterDigest: false",
        pattern=r"^sha256:[0-9a-f]{64}$",
    )

    @field_validator("uri")
    @classmethod
    def _no_dot_segments(cls, uri: str) -> str:
        if re.search(DOT_SEGMENT, uri):
            raise ValueError(DOT_SEGMENT_MESSAGE)
        return uri


class QualityGate(KubeModel):
    """Replay the adapter's golden outputs on the serving base before it takes traffic."""

    min_token_agreement: float = Field(default=0.9, ge=0, le=1)
    max_mean_kl: float = Field(default=0.1, ge=0)


class LoraAdapterSpec(KubeModel):
    base_model: str = Field(min_length=1, max_length=253, description="a BaseModel in this namespace")
    source: AdapterSource
    tenant: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL)
    served_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=ADAPTER_NAME_PATTERN,
        description="the model name clients send; default: the object's name (either must be a name replicas accept)",
    )
    rank: int | None = Field(
        default=None, ge=1, le=512, description="declared; checked against the files (with rank_pattern, the largest module rank)"
    )
    target_modules: list[str] | None = Field(default=None, description="declared; checked against the files")
    pinned: bool = Field(default=False, description="keep resident in device slots on every replica")
    prefetch: bool = Field(default=True, description="stage into every replica's host memory when Ready")
    rank_policy: Literal["Reject", "Truncate"] = Field(default="Reject", description="above the base's maxLoraRank")
    quotas: Quotas | None = None
    quality_gate: QualityGate | None = None


class ReplicaPlacement(KubeModel):
    replica: str
    tier: Literal["device", "host", "loading", "cold", "failed"]


class AdapterMetrics(KubeModel):
    requests_per_second: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    device_hit_rate: float | None = Field(default=None, ge=0, le=1)
    host_hit_rate: float | None = Field(default=None, ge=0, le=1)
    cold_loads: int = 0
    load_latency_mean_ms: float | None = Field(default=None, description="host or cold load into a device slot")
    load_latency_p50_ms: float | None = Field(default=None, description="over each replica's latest 64 loads")
    load_latency_p99_ms: float | None = Field(default=None, description="over each replica's latest 64 loads")
    last_updated: str | None = Field(default=None, json_schema_extra={"format": "date-time"})


class MergedModel(KubeModel):
    """A merged checkpoint in the object store: the adapter version in it and the folder's digest,
    which the node agents check their copies against."""

    uri: str = Field(max_length=2048)
    digest: str = Field(max_length=71, description="sha256:<hex> over the folder's files, as loraplane digest --base prints it")
    adapter_digest: str = Field(description="the adapter version merged")


class LoraAdapterStatus(KubeModel):
    phase: Literal["Pending", "Staging", "Ready", "Failed"] = "Pending"
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = None
    serving_digest: str | None = Field(default=None, description="the version taking new requests")
    serving_uri: str | None = Field(default=None, description="where that version was fetched from")
    promoting_digest: str | None = Field(default=None, description="a new version being validated and staged")
    adapter_digest: str | None = Field(
        default=None,
        description="the adapter digest of the version checked last (config, weights and golden outputs): the form "
        "to declare in spec.source.digest",
    )
    rank: int | None = None
    size_bytes: int | None = None
    pinned: bool = False
    nodes_cached: int | None = Field(default=None, description="nodes whose cache holds the serving version")
    replicas: list[ReplicaPlacement] = Field(default_factory=list)
    metrics: AdapterMetrics | None = None
    served_from: Literal["shared", "dedicated"] | None = Field(
        default=None,
        description="with its BaseModel's dedicated.mode auto, once it has dominated: dedicated while pods of its merged "
        "deployment are ready (the router sends its requests there), shared otherwise; unset: the shared pool",
    )
    dedicated_replicas: int | None = Field(
        default=None, description="its dedicated deployment's replicas: wanted, out of the BaseModel's spec.replicas"
    )
    dedicated_ready_replicas: int | None = Field(default=None, description="of those, ready")
    merged_model: MergedModel | None = Field(
        default=None,
        description="with dedicated.mergedStore: the last version merged into the base (written once by its merge Job), "
        "which its dedicated pods serve",
    )


class LoraAdapterResource(KubeModel):
    api_version: Literal["loraplane.dev/v1alpha1"] = "loraplane.dev/v1alpha1"
    kind: Literal["LoraAdapter"] = "LoraAdapter"
    metadata: ObjectMeta
    spec: LoraAdapterSpec
    status: LoraAdapterStatus | None = None
