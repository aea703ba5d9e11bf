"""Bodies of the node agent's HTTP API (``node_cache.app``), shared by its clients: the serving
pods (acquire, release, pins) and the operator (staging, state). Requests refuse unknown fields
(a misspelt one is a 422 naming it); replies are read leniently, so an older client reads the
fields it knows."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

DIGEST = r"^sha256:[0-9a-f]{64}$"


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore")


class AcquireRequest(_Request):
    source: str = Field(min_length=1, max_length=2048)
    digest: str | None = Field(default=None, pattern=DIGEST, description="the registration's; without one, fetched")


class Acquired(_Reply):
    lease: str = Field(description="hand back to /v1/release; the folder is not evicted until then or the lease expires")
    content: str = Field(description="the folder's name under the cache's adapters/ (its content address)")
    weights_digest: str
    tier: str = Field(description="disk: already on the node; cold: fetched from the source for this call")


class ReleaseRequest(_Request):
    lease: str = Field(min_length=1, max_length=64)


class PinsRequest(_Request):
    """A serving pod's pinned sources, the whole set (a pod restarted with none clears its old ones)."""

    client: str = Field(min_length=1, max_length=253, description="the pod's name")
    sources: list[str] = Field(default_factory=list, max_length=4096)


class StagedAdapter(_Request):
    source: str = Field(min_length=1, max_length=2048)
    digest: str = Field(pattern=DIGEST)
    pinned: bool = Field(default=False, description="kept whatever the bound")


class StagedBase(_Request):
    """A checkpoint besides the node's own base, copied and published as that one is (``base_copy``):
    a dedicated deployment's merged model, which the operator's merge Job wrote once to the store."""

    source: str = Field(pattern=r"^s3://", max_length=2048)
    digest: str = Field(pattern=DIGEST)


MAX_STAGED_BASES = 16  # a base's dedicated deployments are a handful (dedicated.maxDeployments)


class StagingRequest(_Request):
    """What the operator wants on this node, most wanted first: the whole set, replacing the last."""

    adapters: list[StagedAdapter] = Field(default_factory=list, max_length=4096)
    bases: list[StagedBase] | None = Field(
        default=None,
        max_length=MAX_STAGED_BASES,
        description="merged checkpoints to hold; one staged before and missing here (or none sent) is deleted from the node",
    )


class StagedState(_Reply):
    source: str
    digest: str
    cached: bool
    error: str | None = None


class BaseState(_Reply):
    source: str
    digest: str | None = Field(default=None, description="what the node's copy hashes to, once it is there")
    ready: bool = False
    error: str | None = None


class NodeCacheState(_Reply):
    """``GET /v1/state``: what the node holds and how it has been used since the agent started."""

    node: str
    bytes: int = 0
    max_bytes: int | None = None
    entries: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    fetch_seconds_total: float = 0.0
    staged: list[StagedState] = Field(default_factory=list)
    staged_bytes: int = Field(default=0, description="bytes of the staged versions on the node, counted in order")
    staged_fit: bool = Field(default=True, description="false: the staged set is larger than the cache's bound")
    base: BaseState | None = None
    bases: list[BaseState] = Field(default_factory=list, description="the staged checkpoints (merged models)")
