"""Each policy's eviction order on small hand-made traces, and the tier's guarantees."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.eviction import LFUAgingPolicy, Tier, TierFullError, make_policy


def replay(policy: str, stream: str, capacity: int) -> tuple[list[str], Tier]:
    """Replay a stream of one-letter keys; returns the keys evicted, in order, and the tier."""
    evicted: list[str] = []
    tier = Tier(capacity, make_policy(policy, future=list(stream)), on_evict=evicted.append)
    for key in stream:
        tier.touch(key)
    return evicted, tier


def test_lru_evicts_least_recently_used() -> None:
    evicted, tier = replay("lru", "ABCAD", 3)
    assert evicted == ["B"]  # A was used again after B and C
    assert sorted(tier.keys()) == ["A", "C", "D"]


def test_lfu_evicts_least_frequent_then_least_recent() -> None:
    evicted, _ = replay("lfu", "AABBCD", 3)
    assert evicted == ["C"]  # A and B were asked for twice, C once
    evicted, _ = replay("lfu", "AAABCCD", 3)
    assert evicted == ["B"]


def test_lfu_aging_lets_a_formerly_hot_key_go() -> None:
    policy = LFUAgingPolicy(aging_period=4)
    tier = Tier(2, policy)
    for key in "AAAA":  # A: 4, halved to 2 at the 4th access
        tier.touch(key)
    assert policy.frequency("A") == 2
    for key in "BBBBCCCC":  # B then C each outgrow A's decayed count
        tier.touch(key)
    assert "A" not in tier and "C" in tier


def test_tinylfu_refuses_a_one_hit_wonder() -> None:
    evicted, tier = replay("tinylfu", "AABBX", 2)
    assert evicted == [] and "X" not in tier  # X was seen once, both residents twice
    evicted, tier = replay("tinylfu", "AABBXXX", 2)
    assert evicted == ["A"] and "X" in tier  # the third X outweighs A's two hits


def test_belady_evicts_the_key_needed_furthest_ahead() -> None:
    # at D: A is next needed at 4, B at 5, C at 6, and D never again: D is not kept at all
    evicted, tier = replay("belady", "ABCDABC", 3)
    assert evicted == [] and "D" not in tier
    # D needed again at once: C (needed last) makes room
    evicted, _ = replay("belady", "ABCDDABC", 3)
    assert evicted == ["C"]


def test_belady_must_be_fed_its_own_stream() -> None:
    tier = Tier(2, make_policy("belady", future=["A", "B"]))
    tier.touch("A")
    with pytest.raises(RuntimeError, match="not the stream"):
        tier.touch("C")


@pytest.mark.parametrize("policy", ["lru", "lfu", "tinylfu", "demand"])
def test_pinned_and_in_use_keys_are_never_evicted(policy: str) -> None:
    busy = {"B"}
    tier = Tier(3, make_policy(policy), in_use=busy.__contains__)
    for key in "ABC":
        tier.insert(key)
    tier.pin("A")
    for key in "DEFGH":
        tier.insert(key)
    assert "A" in tier and "B" in tier
    busy.clear()
    tier.insert("I")
    assert "A" in tier and "B" not in tier


def test_tier_full_of_protected_keys_refuses_with_a_reason() -> None:
    tier = Tier(2, make_policy("lru"))
    for key in "AB":
        tier.insert(key)
        tier.pin(key)
    with pytest.raises(TierFullError, match="pinned or in use"):
        tier.insert("C")
    assert not tier.touch("C")  # a request still gets served, by bypass
    assert sorted(tier.keys()) == ["A", "B"]


def test_sized_entries_share_one_capacity() -> None:
    """Unified paging: a rank-64 adapter takes the room of eight rank-8 ones."""
    tier = Tier(16, make_policy("lru"))
    for i in range(8):
        tier.insert(f"r8-{i}", size=2)
    evicted = tier.insert("r64", size=8)
    assert evicted == [f"r8-{i}" for i in range(4)]
    assert tier.used == 16


def test_unknown_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="lru, lfu, tinylfu, demand, belady"):
        make_policy("fifo")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 7), max_size=80), st.integers(1, 5))
def test_belady_hits_at_least_as_often_as_any_online_policy(stream: list[int], capacity: int) -> None:
    def hits(policy: str) -> int:
        tier = Tier(capacity, make_policy(policy, future=stream))
        return sum(tier.touch(k) for k in stream)

    best = hits("belady")
    for policy in ("lru", "lfu", "tinylfu", "demand"):
        assert hits(policy) <= best


def test_has_room_says_whether_an_insert_would_succeed() -> None:
    """What placement asks before starting a drain: room is free, or a key neither pinned nor in
    use can go. It agrees with ``insert`` and evicts nothing itself."""
    busy: set[str] = set()
    tier = Tier(2, make_policy("lru"), in_use=busy.__contains__)
    assert tier.has_room(2) and not tier.has_room(3)
    tier.insert("A")
    tier.insert("B")
    assert tier.has_room()  # B can go
    busy.add("B")
    tier.pin("A")
    assert not tier.has_room() and sorted(tier.keys()) == ["A", "B"]
    with pytest.raises(TierFullError):
        tier.insert("C")
    busy.clear()
    assert tier.has_room() and tier.insert("C") == ["B"]
