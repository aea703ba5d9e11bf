"""The dominance rule over time: what makes an adapter dominant, what sends it back, and what never
flaps a dedicated deployment."""

from __future__ import annotations

import pytest

from loraplane.routing.dominance import DominanceRule, DominanceTracker, dedicated_replicas, shares, steady_dominant


def tail(rps: float) -> dict[str, float]:
    """The long tail: ``rps`` over ten adapters, none of them dominant."""
    return {f"t{i}": rps / 10 for i in range(10)}


RULE = DominanceRule(share=0.3, hold_seconds=60, return_share=0.2, return_seconds=120, min_rps=1.0, max_dedicated=1)


def test_a_sustained_share_makes_an_adapter_dominant_and_a_burst_does_not() -> None:
    t = DominanceTracker(RULE)
    assert t.update({"hot": 5, **tail(5)}, 0) == []  # 50%: above the line, but only just now
    assert t.update({"hot": 5, **tail(5)}, 59) == []
    assert t.pending("hot", 59) == 59
    assert t.update({"hot": 5, **tail(5)}, 60) == ["hot"]
    # A burst that dips back under the line before the hold restarts the clock.
    b = DominanceTracker(RULE)
    b.update({"hot": 5, **tail(5)}, 0)
    b.update({"hot": 1, **tail(9)}, 30)
    assert b.update({"hot": 5, **tail(5)}, 70) == [] and b.pending("hot", 70) == 0


def test_between_the_two_lines_nothing_changes_and_a_lasting_fall_returns_it() -> None:
    t = DominanceTracker(RULE)
    t.update({"hot": 5, **tail(5)}, 0)
    assert t.update({"hot": 5, **tail(5)}, 60) == ["hot"]
    assert t.update({"hot": 2.5, **tail(7.5)}, 100) == ["hot"]  # 25%: under the entry line, above the return
    assert t.pending("hot", 100) is None
    t.update({"hot": 1.5, **tail(8.5)}, 200)  # 15%: under the return line, for 0 s
    assert t.update({"hot": 1.5, **tail(8.5)}, 319) == ["hot"]
    assert t.update({"hot": 1.5, **tail(8.5)}, 320) == []


def test_an_idle_base_has_no_dominant_adapter() -> None:
    t = DominanceTracker(RULE)
    for at in (0, 100):
        assert t.update({"only": 0.1}, at) == []  # 100% of almost nothing
    assert steady_dominant(RULE, {"only": 0.1}) == [] and steady_dominant(RULE, {"only": 2}) == ["only"]


def test_the_cap_keeps_the_incumbent_and_a_newcomer_waits_for_a_free_place() -> None:
    t = DominanceTracker(RULE)
    t.update({"a": 5, "b": 4, **tail(1)}, 0)
    assert t.update({"a": 5, "b": 4, **tail(1)}, 60) == ["a"]
    # b overtakes a: a stays (still above its return line), b waits
    assert t.update({"a": 4, "b": 5, **tail(1)}, 200) == ["a"]
    t.update({"a": 1, "b": 8, **tail(1)}, 300)  # a falls to 10%
    assert t.update({"a": 1, "b": 8, **tail(1)}, 420) == ["b"]  # a returns; b, long past its hold, takes the place


def test_a_forgotten_adapter_and_a_seeded_one() -> None:
    t = DominanceTracker(RULE)
    t.seed(["hot"])  # decided before a restart: dominant until it stays under the return line
    assert t.update({"hot": 3, **tail(7)}, 0) == ["hot"]  # 30%
    assert t.update({**tail(7)}, 10) == []  # deleted
    assert t.update({"hot": 3, **tail(7)}, 20) == []  # back: starts over


def test_shares_and_replicas() -> None:
    assert shares({"a": 3, "b": 1}) == {"a": 0.75, "b": 0.25} and shares({"a": 0}) == {"a": 0.0}
    assert dedicated_replicas(0.5, 4, 8) == 2
    assert dedicated_replicas(0.3, 4, 8) == 1  # 1.2
    assert dedicated_replicas(0.9, 4, 8) == 3  # the tail keeps one
    assert dedicated_replicas(0.9, 10, 2) == 2  # the cap
    assert dedicated_replicas(0.9, 1, 8) == 0  # nothing to carve from


def test_the_return_line_must_not_be_above_the_entry_line() -> None:
    with pytest.raises(ValueError, match="return share"):
        DominanceRule(share=0.2, return_share=0.3)
