"""Prometheus metrics on a port of their own, for the scraper alone.

The series name adapters and tenants, so a closed server (one with a tenants file) answers
``/metrics`` on its API port only with the admin token: a tenant's key must not list the other
tenants' adapters. Prometheus inside the cluster scrapes the metrics port instead, which carries
nothing else (no completions, no admin calls), so a NetworkPolicy can open it to the monitoring
namespace while the API port stays reachable only from the router and the operator.
prometheus_client's own threaded HTTP server serves it; nothing here is hand-written HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import Metric
from prometheus_client.registry import Collector


class Registries(Collector):
    """Everything the given registries hold at scrape time: the engine's registry exists only
    once the base has loaded, so it is looked up on each scrape rather than at start."""

    def __init__(self, registries: Callable[[], Iterable[CollectorRegistry]]) -> None:
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        for registry in self.registries():
            yield from registry.collect()


def view(registries: Callable[[], Iterable[CollectorRegistry]]) -> CollectorRegistry:
    """One registry over ``registries``, for both ``/metrics`` and the metrics port."""
    combined = CollectorRegistry(auto_describe=False)
    combined.register(Registries(registries))
    return combined


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread; returns the server
    (``shutdown()`` stops it)."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
