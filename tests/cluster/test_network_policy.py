"""The NetworkPolicies the operator writes, read back from the cluster and decided against the
live pods, their namespaces and the ports their Services' endpoints carry (network_policy.py says
why they are decided here rather than enforced: the node's bridge CNI enforces none). A label,
port name or namespace selector that drifted would lock the router or the operator out of the
replicas, or let any pod in; the envtest checks compare manifests, this one the running stack."""

from __future__ import annotations

from typing import Any

import pytest
from kubectl import RELEASE_NS, SKIP_REASON, enabled, get, running_pods
from network_policy import admits

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(not enabled(), reason=SKIP_REASON)]


def endpoint_ports(ns: str, service: str) -> dict[str, int]:
    """The ports the Service's EndpointSlices carry, by name: what kube-proxy, and so a client, dials."""
    slices = get("endpointslices", ns, selector=f"kubernetes.io/service-name={service}")["items"]
    return {p["name"]: p["port"] for s in slices for p in s.get("ports") or []}


def test_the_policies_admit_the_stacks_own_connections_and_no_other_pod(story: dict[str, Any]) -> None:
    ns, base = story["ns"], story["base"]
    policies = get("networkpolicies", ns)["items"]
    namespaces = {n["metadata"]["name"]: n for n in get("namespaces", None)["items"]}
    serving = running_pods(ns, story["serving"])
    routers = running_pods(ns, f"loraplane.dev/base-model={base},app.kubernetes.io/component=router")
    operator = running_pods(RELEASE_NS, "app.kubernetes.io/component=operator")
    store = running_pods(RELEASE_NS, "app.kubernetes.io/component=object-store")
    assert serving and routers and len(operator) == 1 and store
    replica, router = endpoint_ports(ns, f"{base}-serving"), endpoint_ports(ns, f"{base}-router")

    def allowed(source: dict[str, Any], target: dict[str, Any], port: int) -> bool:
        return admits(policies, source, namespaces[source["metadata"]["namespace"]], target, port)

    assert len(serving) >= 2  # the examples run two replicas
    for pod, other in zip(serving, serving[1:] + serving[:1], strict=True):
        assert allowed(routers[0], pod, replica["http"])  # completions, routed
        assert allowed(operator[0], pod, replica["http"])  # the admin API: loads, pins, stats
        assert allowed(store[0], pod, replica["metrics"])  # Prometheus, from anywhere without metricsNamespaces
        assert not allowed(store[0], pod, replica["http"])  # any other pod: not past the router
        assert not allowed(other, pod, replica["http"])  # nor another replica, at this one's API
    assert allowed(store[0], routers[0], router["http"])  # the router is the front door
