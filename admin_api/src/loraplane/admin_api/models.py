"""Request and response bodies of the replicas' admin API.

Field names are the wire format the operator, the router and the benchmarks read; renaming one is
a breaking change to the contract between separately upgraded images, and
``tests/admin_api/test_contract.py`` compares them with the server's OpenAPI schema.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field


class Tier(enum.StrEnum):
    """Where an adapter is now: the residency tiers, plus loading and failed."""

    COLD = "cold"  # registered; its files are on the node's disk or in object storage
    LOADING = "loading"
    HOST = "host"
    DEVICE = "device"
    FAILED = "failed"


class _Request(BaseModel):
    """A request body: the server refuses unknown fields, so a misspelt one is a 422 naming it."""

    model_config = ConfigDict(extra="forbid")


class _Reply(BaseModel):
    """A response body: read leniently, so an operator older than the replica it calls still reads
    the fields it knows."""

    model_config = ConfigDict(extra="ignore")


class Quotas(_Request):
    """An adapter's own quotas, as its registration carries them; the router enforces them at
    the edge as well, read back from the replicas' stats. The CRDs' ``quotas`` fields are this
    model in camelCase (``operator/api/common.py``), so the two cannot disagree."""

    max_concurrent: int | None = Field(default=None, ge=1, description="requests in flight at once; beyond: 429")
    tokens_per_minute: int | None = Field(default=None, ge=1, description="prompt + completion tokens; beyond: 429")


class LoadLoraRequest(_Request):
    """vLLM's ``/v1/load_lora_adapter`` body, plus the registration fields of our tiers
    (``/admin/adapters`` takes the same body)."""

    lora_name: str
    lora_path: str = Field(description="local folder, file:// or s3:// URI")
    digest: str | None = None
    tenant: str | None = None
    allow_rank_truncation: bool = False
    version: str | None = Field(default=None, max_length=128, description="a label for this revision, e.g. a date")
    quotas: Quotas | None = Field(default=None, description="this adapter's own concurrency and token quotas")
    # vLLM's fields, accepted so tools written for its endpoint work: a load under a served name
    # always replaces it in place (our promotion), and ids are ours to assign.
    load_inplace: bool = Field(default=False, description="vLLM: replace a loaded adapter of this name")
    lora_int_id: int | None = Field(default=None, description="vLLM: accepted and ignored")


class UnloadLoraRequest(_Request):
    lora_name: str = Field(min_length=1, description="an empty name is a 400, as vLLM answers it")
    lora_int_id: int | None = Field(default=None, description="vLLM: accepted and ignored")


# How long a replica may take over one /admin/verify (fetch, validation and the replay together):
# the replica gives up at this, and its callers wait for it rather than giving up first (a caller
# that stops waiting cancels the replay; another asking for the same version shares it).
VERIFY_DEADLINE_SECONDS = 300.0


class VerifyRequest(_Request):
    """A candidate version to replay its golden outputs on this base before anyone registers it."""

    lora_path: str = Field(description="local folder, file:// or s3:// URI")
    digest: str | None = None
    allow_rank_truncation: bool = False
    min_token_agreement: float = Field(default=0.9, ge=0, le=1)
    max_mean_kl: float = Field(default=0.1, ge=0)


class CountSum(_Reply):
    count: int = 0
    sum: float = 0.0


class Counters(_Reply):
    """An adapter's or a tenant's counters since its replica started. They restart with the
    replica, so a reader computing a rate must take a decrease as a restart (see ``stats.rate``)."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    device_hits: int = Field(default=0, description="requests that found the adapter on the device")
    host_hits: int = Field(default=0, description="requests that found it in host memory")
    cold_loads: int = Field(default=0, description="requests that had to wait for a load from disk or storage")
    load_seconds: dict[str, CountSum] = Field(
        default_factory=dict, description="loads by where they read from: host, disk (the node's cache) or cold"
    )
    queue_wait_seconds: CountSum = Field(default_factory=CountSum)
    recent_load_ms: list[float] = Field(default_factory=list, description="the latest loads' durations")

    @property
    def arrivals(self) -> int:
        return self.device_hits + self.host_hits + self.cold_loads

    @property
    def loads(self) -> int:
        return sum(v.count for v in self.load_seconds.values())

    @property
    def load_seconds_total(self) -> float:
        return sum(v.sum for v in self.load_seconds.values())

    def plus(self, other: Counters) -> Counters:
        """Two replicas' counters together (recent loads pooled)."""
        return self._combine(other, 1)

    def since(self, earlier: Counters) -> Counters:
        """What happened between an earlier reading and this one (recent loads: this one's)."""
        return self._combine(earlier, -1)

    def _combine(self, other: Counters, sign: int) -> Counters:
        def cs(a: CountSum | None, b: CountSum | None) -> CountSum:
            a, b = a or CountSum(), b or CountSum()
            return CountSum(count=a.count + sign * b.count, sum=a.sum + sign * b.sum)

        scalars = ("requests", "prompt_tokens", "completion_tokens", "device_hits", "host_hits", "cold_loads")
        return Counters(
            **{k: getattr(self, k) + sign * getattr(other, k) for k in scalars},
            load_seconds={
                t: cs(self.load_seconds.get(t), other.load_seconds.get(t))
                for t in sorted({*self.load_seconds, *other.load_seconds})
            },
            queue_wait_seconds=cs(self.queue_wait_seconds, other.queue_wait_seconds),
            recent_load_ms=self.recent_load_ms + other.recent_load_ms if sign > 0 else list(self.recent_load_ms),
        )


class AdapterState(Counters):
    """One adapter on one replica: its registration, where it is now, and its counters."""

    tenant: str | None = None
    version: str | None = None
    source: str = ""
    tier: Tier = Tier.COLD
    pinned: bool = False
    running: int = Field(default=0, description="sequences using it now")
    rank: int | None = None
    digest: str | None = None
    quotas: Quotas | None = None


class NamedAdapterState(AdapterState):
    """``/admin/adapters/{name}`` and the registration and pin calls' answer."""

    name: str


class DiskCacheStats(_Reply):
    bytes: int = 0
    max_bytes: int | None = None
    entries: int = 0
    evictions: int = 0


class ReplicaStats(_Reply):
    """``/admin/stats``: every adapter the replica knows, per-tenant counters and queue depths."""

    adapters: dict[str, AdapterState] = Field(default_factory=dict)
    tenants: dict[str, Counters] = Field(default_factory=dict)
    preemptions: int = 0
    waiting: int = Field(default=0, description="requests queued in the engine, which the router reads")
    running: int = 0
    parked: int = Field(
        default=0, description="requests out of the batch, their KV kept, until their adapter's next turn or a free place"
    )
    parks: int = Field(
        default=0,
        description="requests parked so far: to hand a device slot to a waiting adapter, or to give back the place an "
        "interjection took beside a full batch",
    )
    interjections: int = Field(
        default=0,
        description="forward passes run between the layers of another step so far: the prompts of tenants below their "
        "fair share, run before a burster's step ends (fair_interjection)",
    )
    device_prefetches: int = Field(
        default=0, description="adapters copied into a device slot ahead of their queued request's turn, beside a running step"
    )
    disk_cache: DiskCacheStats = Field(default_factory=DiskCacheStats)
    max_model_len: int | None = Field(
        default=None, description="the replica's context: what the router reserves a request's tokens against"
    )
    dedicated_model: str | None = Field(
        default=None,
        description="set when the replica's base is an adapter merged into the base (a dedicated deployment): the one "
        "model it serves, whose requests the router sends here first and nothing else",
    )
