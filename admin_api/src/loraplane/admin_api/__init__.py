"""The serving replicas' admin API as one typed contract: the request and response bodies of
``/admin/*`` and vLLM's load/unload calls, a small async client, and the statistics every reader
of those bodies computes (percentiles, counter-reset-aware rates).

The server declares these models as its ``response_model``s; the operator, the router and the
benchmark harness read replies through them instead of agreeing on dict keys. The operator and
the serving image upgrade separately, so replies are read leniently (an unknown field from a newer
replica is ignored) and requests are checked strictly by the server (a misspelt field is a 422).

Free of serving, the operator, torch and FastAPI by contract (import-linter): both sides of the
wire import it.
"""

from loraplane.admin_api.client import AdminClient, ReplicaError
from loraplane.admin_api.models import (
    VERIFY_DEADLINE_SECONDS,
    AdapterState,
    Counters,
    CountSum,
    DiskCacheStats,
    LoadLoraRequest,
    NamedAdapterState,
    Quotas,
    ReplicaStats,
    Tier,
    UnloadLoraRequest,
    VerifyRequest,
)
from loraplane.admin_api.stats import percentile, rate

__all__ = [
    "VERIFY_DEADLINE_SECONDS",
    "AdapterState",
    "AdminClient",
    "CountSum",
    "Counters",
    "DiskCacheStats",
    "LoadLoraRequest",
    "NamedAdapterState",
    "Quotas",
    "ReplicaError",
    "ReplicaStats",
    "Tier",
    "UnloadLoraRequest",
    "VerifyRequest",
    "percentile",
    "rate",
]
