"""Routing decisions with plain inputs: warm replicas first, device before host, the load bound
over everything, and the label each decision is counted under."""

from __future__ import annotations

import math

import pytest

from loraplane.serving.router.discovery import slice_members, static_members
from loraplane.serving.router.policy import Router
from loraplane.serving.router.table import Replica, ReplicaTable


def fleet(n: int = 3) -> list[Replica]:
    return [Replica(f"r{i}", f"http://r{i}") for i in range(n)]


def test_a_replica_holding_the_adapter_on_its_device_wins_over_host_and_ring() -> None:
    a, b, c = fleet()
    b.host.add("x")
    c.device.add("x")
    assert Router().choose("x", [a, b, c]) == (c, "device_hit")
    c.device.clear()
    assert Router().choose("x", [a, b, c]) == (b, "host_hit")


def test_a_cold_adapter_always_hashes_to_the_same_home() -> None:
    replicas = fleet()
    homes = [Router().choose("cold-adapter", replicas) for _ in range(5)]
    assert all(h == homes[0] for h in homes) and homes[0][1] == "hashed"  # type: ignore[index]


def test_a_full_warm_replica_overflows_to_the_next_one_on_the_ring() -> None:
    replicas = fleet()
    router = Router(epsilon=0.25)
    home, _ = router.choose("hot", replicas)  # type: ignore[misc]
    home.device.add("hot")
    home.in_flight = 10  # the others idle: the bound is ceil(1.25 * 11 / 3) = 5
    chosen, decision = router.choose("hot", replicas)  # type: ignore[misc]
    assert chosen is not home and decision == "overflow"


def test_one_hot_adapter_never_puts_a_replica_above_the_bound() -> None:
    replicas = fleet()
    router, table = Router(epsilon=0.25), ReplicaTable()
    for arrival in range(60):
        chosen, _ = router.choose("hot", replicas)  # type: ignore[misc]
        table.sent(chosen, "hot")
        total = sum(r.in_flight for r in replicas)
        assert chosen.in_flight <= math.ceil(1.25 * total / 3), arrival
    assert min(r.in_flight for r in replicas) > 0  # the heat spread to every replica


def test_replicas_that_list_the_adapter_are_preferred_over_ones_that_would_answer_404() -> None:
    a, b, c = fleet()
    a.registered, b.registered, c.registered = {"x"}, set(), {"y"}
    assert Router().choose("x", [a, b, c])[0] is a  # type: ignore[index]
    assert Router(policy="round-robin").choose("x", [a, b, c])[0] is a  # type: ignore[index]


def test_round_robin_takes_turns_whatever_is_warm() -> None:
    replicas = fleet()
    replicas[0].device.add("x")
    router = Router(policy="round-robin")
    assert [router.choose("x", replicas)[0].name for _ in range(4)] == ["r0", "r1", "r2", "r0"]  # type: ignore[index]


def test_nothing_up_means_no_route() -> None:
    assert Router().choose("x", []) is None


def test_membership_changes_keep_the_counts_of_replicas_that_stay() -> None:
    table = ReplicaTable()
    table.set_members({"a": "http://a", "b": "http://b"})
    table.replicas["a"].in_flight = 3
    table.set_members({"a": "http://a", "c": "http://c"})
    assert sorted(table.replicas) == ["a", "c"] and table.replicas["a"].in_flight == 3
    table.set_members({"a": "http://a2"})  # a new pod behind the name
    assert table.replicas["a"].in_flight == 0


def test_only_ready_endpoints_of_a_slice_become_replicas() -> None:
    slices = [{
        "metadata": {"name": "s1"},
        "ports": [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}],
        "endpoints": [
            {"addresses": ["10.0.0.1"], "conditions": {"ready": True}, "targetRef": {"name": "serving-0"}},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": False}, "targetRef": {"name": "serving-1"}},
            {"addresses": ["fd00::3"], "targetRef": {"name": "serving-2"}},
        ],
    }]  # fmt: skip
    assert slice_members(slices) == {"serving-0": "http://10.0.0.1:8000", "serving-2": "http://[fd00::3]:8000"}


def test_static_replicas_must_be_urls() -> None:
    assert static_members(["http://127.0.0.1:8001/"]) == {"127.0.0.1:8001": "http://127.0.0.1:8001"}
    with pytest.raises(ValueError, match="not an http"):
        static_members(["127.0.0.1:8001"])


def test_the_context_a_request_may_use_follows_the_members_as_they_are() -> None:
    """The largest context a member reports, the engine's default before any says: a replica that
    leaves, or restarts with a smaller context, no longer lets a request assume its old one."""
    from loraplane.admin_api import ReplicaStats
    from loraplane.serving.router.table import DEFAULT_MAX_MODEL_LEN

    table = ReplicaTable()
    table.set_members({"a": "http://a", "b": "http://b"})
    assert table.max_model_len == DEFAULT_MAX_MODEL_LEN
    table.apply_stats(table.replicas["a"], ReplicaStats(max_model_len=8192))
    table.apply_stats(table.replicas["b"], ReplicaStats(max_model_len=2048))
    assert table.max_model_len == 8192
    table.apply_stats(table.replicas["a"], ReplicaStats(max_model_len=1024))  # restarted with less
    assert table.max_model_len == 2048
    table.set_members({"a": "http://a"})  # b left
    assert table.max_model_len == 1024
