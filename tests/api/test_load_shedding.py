"""The server's bound on pending requests, shared between tenants (no server needed)."""

from __future__ import annotations

import random

from loraplane.serving.api.load_shedding import PendingRequests


def test_one_tenant_alone_is_shed_at_the_limit() -> None:
    pending = PendingRequests(4)
    assert all(pending.admit("a", 1) for _ in range(4))
    assert not pending.admit("a", 1)
    pending.release("a", 1)
    assert pending.admit("a", 1)
    empty = PendingRequests(4)
    assert empty.admit("a", 9)  # larger than the limit: it runs when nothing else is pending
    assert not empty.admit("a", 1)


def test_a_burster_that_filled_the_bound_does_not_shed_a_neighbour_below_its_share() -> None:
    pending = PendingRequests(8)
    while pending.admit("burst", 1):
        pass
    assert pending.by_tenant["burst"] == 8
    assert [pending.admit("steady", 1) for _ in range(5)] == [True] * 4 + [False]  # its share: 8 / 2
    assert not pending.admit("burst", 1)
    for _ in range(5):
        pending.release("burst", 1)
    assert pending.admit("burst", 1)  # under the limit again (7 of 8 pending): anyone is admitted
    assert not pending.admit("burst", 1)  # full, and the burster holds its share (4 of 8)
    pending.release("steady", 4)
    assert pending.admit("burst", 1) and "steady" not in pending.by_tenant


def test_the_total_stays_within_twice_the_limit_however_tenants_come_and_go() -> None:
    rng = random.Random(7)
    pending = PendingRequests(16)
    held: list[tuple[str, int]] = []
    for _ in range(20_000):
        if held and rng.random() < 0.45:
            tenant, n = held.pop(rng.randrange(len(held)))
            pending.release(tenant, n)
        else:
            tenant, n = f"t{rng.randrange(6)}", rng.choice([1, 1, 1, 2, 4])
            if pending.admit(tenant, n):
                held.append((tenant, n))
        assert pending.total == sum(n for _, n in held) <= 2 * 16 + 4
        assert sum(pending.by_tenant.values()) == pending.total
