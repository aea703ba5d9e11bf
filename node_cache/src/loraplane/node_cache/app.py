"""The node agent's HTTP API (FastAPI, as the replicas'), and its Prometheus series.

The serving pods' calls (acquire, release, pins) take the BaseModel's admin token, which they
hold; the operator's (staging, state) take a token of its own (``<base>-node-cache``) when one is
set, so a serving pod cannot rewrite what its node holds. The series carry no adapter or tenant
names (only the node's figures), so ``/metrics`` is open to the scraper, and ``/health`` too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from prometheus_client import CollectorRegistry, Histogram, make_asgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplane.adapter_format import AdapterValidationError
from loraplane.admin_api.auth import SignedResponses, tokens_carried
from loraplane.admin_api.body_limit import BodyLimit
from loraplane.node_cache.agent import NodeAgent, SourceNotAllowed, TooManyPinClients
from loraplane.node_cache.models import Acquired, AcquireRequest, NodeCacheState, PinsRequest, ReleaseRequest, StagingRequest


@dataclass(frozen=True)
class Credentials:
    """What a call may do: a serving pod's calls (the BaseModel's admin token, or no token set)
    and the operator's (its own node cache token)."""

    pod: bool
    operator: bool


@dataclass(frozen=True)
class AgentTokens:
    token: str | None
    operator_token: str | None
    admin_hosts: frozenset[str]


async def _credentials(request: Request) -> Credentials:
    """Which tokens the call carries, as a bearer or as a signature of this very request
    (``admin_api.auth``: the operator and the serving pods sign; the tokens never cross the wire,
    so a pod posing as the agent learns nothing it can use)."""
    t: AgentTokens = request.app.state.tokens
    found = await tokens_carried(request, [x for x in (t.token, t.operator_token) if x], t.admin_hosts)
    return Credentials(pod=not t.token or t.token in found, operator=bool(t.operator_token) and t.operator_token in found)


Caller = Annotated[Credentials, Depends(_credentials)]  # at module level: the routes' annotations are resolved here


FETCH_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)


class _Figures(Collector):
    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        a, node = self.agent, [self.agent.node]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["node"])
            g.add_metric(node, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["node"])
            c.add_metric(node, value)
            return c

        yield gauge("loraplane_node_cache_bytes", "Bytes of adapter files in the node cache", a.store.used_bytes)
        yield gauge("loraplane_node_cache_entries", "Adapter folders in the node cache", len(a.store))
        if a.store.max_bytes is not None:
            yield gauge("loraplane_node_cache_limit_bytes", "The node cache's bound", a.store.max_bytes)
        yield gauge("loraplane_node_cache_staged_bytes", "Bytes of the adapters the operator staged, on the node", a.staged_bytes)
        yield gauge(
            "loraplane_node_cache_staged_fit",
            "1 while the staged set fits the bound; 0: the hot set is larger",
            float(a.staged_fit),
        )
        yield counter("loraplane_node_cache_hits", "Serving pods' reads the node cache answered", a.hits)
        yield counter("loraplane_node_cache_misses", "Serving pods' reads fetched from object storage", a.misses)
        yield counter("loraplane_node_cache_evictions", "Adapter folders deleted to stay in the bound", a.store.evictions)
        if a.base is not None:
            yield gauge("loraplane_node_cache_base_ready", "1 once the base's verified copy is on the node", float(a.base.ready))


MAX_BODY_BYTES = 4 << 20  # a staging call for 10,000 adapters is about 2 MiB


def create_agent_app(
    agent: NodeAgent,
    token: str | None,
    registry: CollectorRegistry | None = None,
    operator_token: str | None = None,
    admin_hosts: frozenset[str] = frozenset(),
) -> FastAPI:
    """``registry``: where the fetch latency histogram and the figures go (a fresh one by default);
    ``operator_token``: what staging and state take instead of ``token``; ``admin_hosts``: the
    agent's own addresses (its pod IP and its Service's name), which a signed call must name."""
    registry = registry or CollectorRegistry()
    registry.register(_Figures(agent))
    fetches = Histogram(
        "loraplane_node_cache_fetch_seconds", "Fetches from object storage into the node cache", ["node"],
        buckets=FETCH_BUCKETS, registry=registry,
    )  # fmt: skip
    agent.on_fetch = fetches.labels(agent.node).observe
    app = FastAPI(title="loraplane node agent", docs_url=None, redoc_url=None)
    app.state.tokens = AgentTokens(token, operator_token, admin_hosts)
    app.add_middleware(SignedResponses)  # a caller knows the answer came from this base's agent
    # Outermost: a body is read (a signed call's, to check its signature) before the caller is
    # known, so nobody may send more than the largest real call (staging a node's whole hot set).
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.mount("/metrics", make_asgi_app(registry))

    def check(who: Credentials) -> None:
        if not who.pod:
            raise HTTPException(401, "the node agent needs the BaseModel's admin token")

    def check_operator(who: Credentials) -> None:
        if operator_token and not who.operator:
            raise HTTPException(401, "staging takes the operator's node cache token")
        if not operator_token:
            check(who)

    @app.get("/health")
    async def health() -> dict[str, str]:  # on the event loop: not queued behind fetches in the thread pool
        return {"status": "ok"}

    @app.post("/v1/acquire")
    def acquire(body: AcquireRequest, who: Caller) -> Acquired:
        check(who)
        try:
            return agent.acquire(body.source, body.digest)
        except SourceNotAllowed as err:
            raise HTTPException(403, {"code": "source_not_allowed", "message": str(err)}) from None
        except AdapterValidationError as err:  # the source's files are refused: the caller's to report
            raise HTTPException(422, {"code": err.code.value, "message": err.message}) from None
        except ValueError as err:  # a source no fetcher opens
            raise HTTPException(400, {"code": "bad_source", "message": str(err)}) from None
        except Exception as err:  # the store unreachable, a disk error: the caller retries with backoff
            raise HTTPException(503, {"code": "unavailable", "message": f"{type(err).__name__}: {err}"}) from None

    @app.post("/v1/release", status_code=204)
    def release(body: ReleaseRequest, who: Caller) -> Response:
        check(who)
        agent.release(body.lease)
        return Response(status_code=204)

    @app.put("/v1/pins", status_code=204)
    def pins(body: PinsRequest, who: Caller) -> Response:
        check(who)
        try:
            agent.set_pins(body.client, body.sources)
        except TooManyPinClients as err:
            raise HTTPException(429, str(err)) from None
        return Response(status_code=204)

    @app.put("/v1/staging", status_code=204)
    def staging(body: StagingRequest, who: Caller) -> Response:
        check_operator(who)
        agent.stage(body.adapters, body.bases)
        return Response(status_code=204)

    @app.get("/v1/state")
    def state(who: Caller) -> NodeCacheState:
        """The operator sees everything; a pod (the admin token) the node's figures, not the list
        of what is staged (other tenants' sources)."""
        if not operator_token or who.operator:
            check_operator(who)
            return agent.state()
        check(who)
        return agent.state().model_copy(update={"staged": []})

    return app
