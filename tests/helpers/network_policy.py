"""Ingress NetworkPolicy decided as an enforcing network plugin decides it (the API's rules:
label selectors, namespace selectors, named ports), for one connection between live pods.

The one-node cluster's bridge CNI enforces no policy, and the enforcers this machine could build
are out of reach (kube-network-policies needs the kernel's nftables queue, which this kernel
lacks; kube-router's only version served here has reported security flaws). So the cluster tests
ask this module whether the policies the operator wrote, read back from the API server, admit the
connections the running stack makes and refuse the ones they exist to stop, with the pods' real
labels, namespaces and container ports. Written here because no Python library implements the
decision; it follows the API reference of `networking.k8s.io/v1`, ingress only (the operator writes
no egress rules), ipBlock peers never matching a pod (the API says they are for cluster-external
addresses)."""

from __future__ import annotations

from typing import Any


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector over ``labels``; an empty selector selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and key in labels and labels[key] in values):
            return False
        if (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels):
            return False
    return True


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return obj["metadata"].get("labels") or {}


def _peer_matches(peer: dict[str, Any], policy_ns: str, source: dict[str, Any], source_ns: dict[str, Any]) -> bool:
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        in_namespace = selects(peer["namespaceSelector"], _labels(source_ns))
    else:
        in_namespace = source["metadata"]["namespace"] == policy_ns
    return in_namespace and selects(peer.get("podSelector"), _labels(source))


def _port_matches(rule_port: dict[str, Any], target: dict[str, Any], port: int, protocol: str) -> bool:
    if rule_port.get("protocol", "TCP") != protocol:
        return False
    wanted = rule_port.get("port")
    if wanted is None:
        return True
    if isinstance(wanted, str):  # a named port: whatever the destination pod's containers call it
        named = [p for c in target["spec"]["containers"] for p in c.get("ports") or [] if p.get("name") == wanted]
        return any(p["containerPort"] == port and p.get("protocol", "TCP") == protocol for p in named)
    return wanted <= port <= rule_port.get("endPort", wanted)


def admits(
    policies: list[dict[str, Any]],
    source: dict[str, Any],
    source_ns: dict[str, Any],
    target: dict[str, Any],
    port: int,
    protocol: str = "TCP",
) -> bool:
    """Whether a connection from pod ``source`` (in Namespace ``source_ns``) to pod ``target`` on
    ``port`` is admitted by the ingress policies of ``target``'s namespace (``policies``). A pod
    always reaches itself: the API says policy cannot block that."""
    if source["metadata"]["uid"] == target["metadata"]["uid"]:
        return True
    target_ns = target["metadata"]["namespace"]
    isolating = [
        p for p in policies
        if p["metadata"]["namespace"] == target_ns and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"].get("podSelector"), _labels(target))
    ]  # fmt: skip
    if not isolating:
        return True
    for policy in isolating:
        for rule in policy["spec"].get("ingress") or []:
            peers, ports = rule.get("from"), rule.get("ports")
            if peers and not any(_peer_matches(peer, target_ns, source, source_ns) for peer in peers):
                continue
            if ports and not any(_port_matches(p, target, port, protocol) for p in ports):
                continue
            return True
    return False
