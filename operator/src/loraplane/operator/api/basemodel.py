"""`BaseModel`: one base LLM, the serving replicas that hold it, and how they treat adapters."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from loraplane.admin_api import engine_sizing
from loraplane.operator.api.common import DNS_LABEL, SOURCE_URI, Condition, KubeModel, ObjectMeta, Quotas, SecretRef
from loraplane.routing.dominance import DominanceRule

# The API server's spelling of EngineSizing._host_holds_device (tests check they agree).
CPU_LORAS_RULE = "!has(self.maxCpuLoras) || self.maxCpuLoras >= self.maxLoras"
QUANTITY = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"  # bytes, as Kubernetes writes them
# A base in object storage reaches the pods through the node cache, and its identity (the model id
# adapters name) is explicit: no folder name to fall back on. The model's check and the CRD's rule.
S3_BASE_RULE = "!self.source.uri.startsWith('s3://') || (self.nodeCache.enabled && has(self.source.name))"
S3_BASE_MESSAGE = "an s3:// base needs nodeCache.enabled (the node agent copies it to each node) and source.name"
# The agents run where the selector says: without one they would land on every node of the cluster
# (copying the base to each), where GPU pods that select nodes by their resource requests never go.
NODE_CACHE_RULE = "!self.nodeCache.enabled || size(self.resources.nodeSelector) > 0"
NODE_CACHE_MESSAGE = "nodeCache.enabled needs resources.nodeSelector: the nodes that serve this base, where its agents run"
MAX_STATUS_NODES = 32
# Hysteresis needs the return line at or below the entry line. The model's check and the CRD's rule (whose
# has() lets the schema's default, {}, pass: the API server fills both fields in before it checks a real object).
DEDICATED_RULE = "!has(self.returnShare) || !has(self.share) || self.returnShare <= self.share"
DEDICATED_MESSAGE = "dedicated.returnShare must be at most dedicated.share"
MERGED_STORE_RULE = "!has(self.dedicated.mergedStore) || self.nodeCache.enabled"
MERGED_STORE_MESSAGE = (
    "dedicated.mergedStore needs nodeCache.enabled: the node agents copy each merged model to the nodes, as an s3:// base"
)
MERGED_STORE = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[A-Za-z0-9!_.*'()/-]*)?$"


class ModelSource(KubeModel):
    uri: str = Field(
        min_length=1,
        description="'embedded' (SmolLM2-135M-Instruct in the image), a path in the image, or s3://bucket/prefix",
        pattern=r"^(embedded|/.+|s3://.+|file://.+)$",
    )
    name: str | None = Field(
        default=None,
        max_length=256,
        description="the base's model id (e.g. meta-llama/Llama-3.1-8B-Instruct), also its served model name: an "
        "adapter whose base_model_name_or_path names another model is refused; default: the checkpoint's own",
    )
    revision: str | None = Field(default=None, description="commit or tag; adapters must be trained on it")
    digest: str | None = Field(
        default=None,
        pattern=r"^sha256:[0-9a-f]{64}$",
        description="an s3:// base's folder digest (loraplane digest --base): a node's copy that differs is refused",
    )
    format: Literal["safetensors", "gguf"] = "safetensors"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    quantization: Literal["fp8"] | None = Field(default=None, description="fp8: float8_e4m3fn base weights")


class EngineSizing(KubeModel, engine_sizing.EngineSizing):
    """The serving engine's sizing, with vLLM's names, defined once with the engine's own settings;
    plus the bound of each replica's adapter cache."""

    disk_cache_size: str | None = Field(
        default="20Gi",
        pattern=QUANTITY,
        description="adapter files each replica keeps on its cache volume, the least wanted evicted beyond it "
        "(a Kubernetes quantity); null: the default, since the volume is bounded either way",
    )


class Toleration(KubeModel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class ServingResources(KubeModel):
    image: str = Field(default="ghcr.io/loraplane/serving:0.1.0", min_length=1)
    gpus: int = Field(default=1, ge=0, description="nvidia.com/gpu per replica")
    cpu: str | None = Field(default=None, description="a Kubernetes quantity, e.g. '8'")
    memory: str | None = Field(default=None, description="a Kubernetes quantity, e.g. '64Gi'")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)


class NodeCache(KubeModel):
    """A cache on each serving node's disk, owned by a node agent the operator runs as a DaemonSet
    (per BaseModel: its node selector, tolerations, token and credentials). Adapters and an s3://
    base are fetched once per node and shared by every serving pod there, and survive their
    restarts. Off by default: it mounts a hostPath, which Pod Security's baseline level refuses."""

    enabled: bool = False
    host_path: str = Field(
        default="/var/lib/loraplane",
        pattern=r"^/[^.]*$",
        max_length=512,
        description="the folder on each node; this BaseModel's cache is <hostPath>/<namespace>/<name>",
    )
    size: str = Field(
        default="50Gi",
        pattern=QUANTITY,
        description="adapter files each node keeps, the least wanted evicted beyond it (size it from loraplane plan's "
        "working set); the base's copy comes on top",
    )
    image: str | None = Field(default=None, description="the agent's image; default: the serving image, already on the node")
    memory: str = Field(
        default="512Mi",
        pattern=QUANTITY,
        description="the agent's memory request and limit: it streams fetches to disk and keeps only their index",
    )


class AdapterStore(KubeModel):
    endpoint: str | None = Field(default=None, description="S3 endpoint URL; empty for AWS")
    region: str | None = None
    credentials_secret: SecretRef | None = Field(
        default=None, description="a Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
    )


class Routing(KubeModel):
    affinity: bool = Field(default=True, description="send an adapter's requests where it is resident")
    load_bound: float = Field(default=1.25, ge=1, le=4, description="no replica above this times the mean load")
    replicas: int = Field(default=1, ge=0, le=32, description="router replicas")


class TenantPolicy(KubeModel):
    """One tenant LoraAdapters of this base may name, and where their files may come from."""

    name: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL)
    sources: list[Annotated[str, Field(pattern=SOURCE_URI, max_length=1024)]] = Field(
        min_length=1, max_length=64, description="URI prefixes the tenant's adapters must be under, e.g. s3://adapters/acme/"
    )


class Tenancy(KubeModel):
    api_keys_secret: SecretRef | None = Field(default=None, description="a Secret whose tenants.yaml maps API keys to tenants")
    default_quotas: Quotas | None = Field(default=None, description="for each adapter of this base that sets no quotas")
    tenants: list[TenantPolicy] | None = Field(
        default=None,
        description="when set, a LoraAdapter may name only these tenants, each with its source prefixes, so a namespace "
        "user cannot publish an adapter to another tenant's key or from another tenant's files; unset: any tenant",
    )


class AutoPinning(KubeModel):
    enabled: bool = True
    hot_set_size: int | None = Field(default=None, ge=0, description="default: device slots minus headroom")
    headroom_slots: int = Field(default=1, ge=0, description="slots left for the long tail")
    hysteresis: float = Field(
        default=0.2, ge=0, le=1, description="a pinned adapter stays until its rate falls this far below the cut"
    )


class DedicatedPolicy(KubeModel):
    """When one adapter dominates this base's traffic (the lesson's decision chart: give it a merged
    dedicated deployment, keep the long tail on the shared base). The operator measures each
    adapter's share of the base's requests every sync and applies ``loraplane.routing.dominance``,
    the rule ``loraplane plan`` applies to a traffic table. ``recommend``: the adapter's
    ``DedicatedRecommended`` condition and an Event say so, with the figures and the replicas the
    rule gives; nothing is created. ``auto``: the same, and the operator runs it: a Deployment
    of the adapter merged into the base (owned by the LoraAdapter) takes those replicas out of the
    shared pool's, and gives them back when the adapter stops dominating."""

    mode: Literal["off", "recommend", "auto"] = Field(
        default="off",
        description="off: not measured; recommend: conditions and Events; auto: and a merged dedicated deployment for each "
        "dominant adapter, its replicas taken from spec.replicas",
    )
    share: float = Field(
        default=DominanceRule.share, gt=0, le=1, description="the share of the base's requests from which an adapter dominates"
    )
    hold_seconds: int = Field(
        default=int(DominanceRule.hold_seconds), ge=0, le=86400, description="held this long before it counts"
    )
    return_share: float = Field(
        default=DominanceRule.return_share, gt=0, le=1, description="below this share it stops dominating (at most share)"
    )
    return_seconds: int = Field(
        default=int(DominanceRule.return_seconds), ge=0, le=86400, description="held this long below returnShare"
    )
    min_requests_per_second: float = Field(
        default=DominanceRule.min_rps, ge=0, description="and at least this rate of its own (an idle base has none)"
    )
    max_deployments: int = Field(
        default=DominanceRule.max_dedicated, ge=0, le=16, description="dominant adapters at most, largest shares first"
    )
    max_replicas: int = Field(
        default=4, ge=1, le=256, description="a dedicated deployment's replicas at most, out of spec.replicas (never on top)"
    )
    merged_store: str | None = Field(
        default=None,
        pattern=MERGED_STORE,
        max_length=1024,
        description="s3://bucket/prefix: each adapter version is merged once, by a Job, into a checkpoint folder written "
        "here with its digest, which the node agents copy to the nodes as they copy an s3:// base (needs "
        "nodeCache.enabled; the adapter store's endpoint and credentials). Unset: each dedicated pod merges at start, "
        "on its own disk",
    )

    @model_validator(mode="after")
    def _return_below_entry(self) -> DedicatedPolicy:
        if self.return_share > self.share:
            raise ValueError(DEDICATED_MESSAGE)
        return self

    def rule(self) -> DominanceRule:
        return DominanceRule(
            share=self.share,
            hold_seconds=self.hold_seconds,
            return_share=self.return_share,
            return_seconds=self.return_seconds,
            min_rps=self.min_requests_per_second,
            max_dedicated=self.max_deployments,
        )


class UsageRecords(KubeModel):
    """Per-request usage records: every serving pod spools them on its disk; with a bucket, closed
    segments go to ``s3://bucket/prefix/date=…/replica=…/`` through the adapter store's endpoint and
    credentials, and ``loraplane usage report`` totals them."""

    bucket: str | None = Field(default=None, max_length=63, description="export bucket; empty: records stay in each pod's spool")
    prefix: str = Field(default="usage", max_length=512, pattern=r"^[A-Za-z0-9!_.*'()/-]*$")
    segment_age_seconds: int = Field(default=60, ge=1, le=3600, description="a segment is closed and exported after this")
    fsync_interval_seconds: float = Field(
        default=1.0, ge=0, le=60, description="the most records a node crash can lose, in seconds of traffic"
    )


class BaseModelSpec(KubeModel):
    source: ModelSource
    engine: EngineSizing = Field(default_factory=EngineSizing)
    replicas: int = Field(default=1, ge=0, le=256)
    resources: ServingResources = Field(default_factory=ServingResources)
    adapter_store: AdapterStore = Field(default_factory=AdapterStore)
    routing: Routing = Field(default_factory=Routing)
    tenancy: Tenancy = Field(default_factory=Tenancy)
    auto_pinning: AutoPinning = Field(default_factory=AutoPinning)
    usage: UsageRecords = Field(default_factory=UsageRecords)
    node_cache: NodeCache = Field(default_factory=NodeCache)
    dedicated: DedicatedPolicy = Field(default_factory=DedicatedPolicy)

    @model_validator(mode="after")
    def _s3_base_through_the_node_cache(self) -> BaseModelSpec:
        if self.source.uri.startswith("s3://") and not (self.node_cache.enabled and self.source.name):
            raise ValueError(S3_BASE_MESSAGE)
        if self.node_cache.enabled and not self.resources.node_selector:
            raise ValueError(NODE_CACHE_MESSAGE)
        if self.dedicated.merged_store is not None and not self.node_cache.enabled:
            raise ValueError(MERGED_STORE_MESSAGE)
        return self


class TenantUsage(KubeModel):
    tenant: str
    requests: int = 0
    refused: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


MAX_STATUS_TENANTS = 20


class UsageStatus(KubeModel):
    """The replicas' last day per tenant (at most ``MAX_STATUS_TENANTS`` rows, the rest summed as
    ``(other)``): a dashboard's figure. Billing reads the exported records."""

    window_hours: int = 24
    tenants: list[TenantUsage] = Field(default_factory=list, max_length=MAX_STATUS_TENANTS)
    pending_segments: int = Field(default=0, description="closed segments not yet exported, all replicas")
    export_error: str | None = Field(default=None, max_length=1024)


class NodeCacheState(KubeModel):
    """One node's cache, as its agent reports it."""

    node: str
    bytes: int = 0
    max_bytes: int | None = None
    entries: int = 0
    hit_rate: float | None = Field(default=None, ge=0, le=1, description="serving pods' reads the node answered")
    staged: int = Field(default=0, description="adapters the operator staged that are on the node")
    staged_missing: int = Field(default=0, description="staged adapters not on the node (fetching, failed or no room)")
    staged_fit: bool = Field(default=True, description="false: the hot set is larger than the cache")
    base_ready: bool | None = Field(default=None, description="an s3:// base's verified copy is on the node")
    error: str | None = Field(default=None, max_length=1024)


class NodeCacheStatus(KubeModel):
    nodes: int = Field(default=0, description="nodes whose agent answered")
    nodes_with_base: int = 0
    per_node: list[NodeCacheState] = Field(default_factory=list, max_length=MAX_STATUS_NODES)


class BaseModelStatus(KubeModel):
    phase: Literal["Pending", "Progressing", "Ready", "Degraded"] = "Pending"
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = None
    replicas: int = 0
    ready_replicas: int = 0
    fingerprint: str | None = Field(default=None, description="sha256 of the base's architecture and weights")
    ready_adapters: int = 0
    pinned_adapters: list[str] = Field(default_factory=list)
    dominant_adapters: list[str] | None = Field(
        default=None, description="with dedicated.mode on: the adapters that dominate the base's traffic (served names)"
    )
    usage: UsageStatus | None = None
    node_cache: NodeCacheStatus | None = None
    dedicated_replicas: int | None = Field(
        default=None,
        description="with dedicated.mode auto: spec.replicas taken by dedicated deployments (the shared pool has the rest)",
    )


class BaseModelResource(KubeModel):
    api_version: Literal["loraplane.dev/v1alpha1"] = "loraplane.dev/v1alpha1"
    kind: Literal["BaseModel"] = "BaseModel"
    metadata: ObjectMeta
    spec: BaseModelSpec
    status: BaseModelStatus | None = None
