"""The bound on accepted, unfinished requests, shared fairly between tenants.

Past ``limit`` pending requests the server sheds load with 503 and ``Retry-After`` rather than
queue without bound. A single shared count would let one tenant's burst fill it and then refuse
every neighbour's request too, so the bound is shared: once it is reached, a tenant is still
admitted while it holds less than its share (the limit over the tenants with pending requests,
itself counted), and only the tenants over their share are shed. The engine's fair admission
then serves what was admitted least-served tenant first.

The total stays below about twice the limit: past it, every tenant grows only up to its share,
and the shares add up to the limit.
"""

from __future__ import annotations

from collections import Counter


class PendingRequests:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.by_tenant: Counter[str | None] = Counter()
        self.total = 0

    def admit(self, tenant: str | None, n: int) -> bool:
        """Count ``n`` more pending requests of ``tenant`` and return True, or return False
        (and count nothing) when the server is full and the tenant holds its share already. A
        request larger than the limit still runs when nothing else is pending."""
        if self.total and self.total + n > self.limit:
            tenants = len(self.by_tenant) + (tenant not in self.by_tenant)
            if self.by_tenant[tenant] + n > self.limit / tenants:
                return False
        self.by_tenant[tenant] += n
        self.total += n
        return True

    def release(self, tenant: str | None, n: int) -> None:
        self.by_tenant[tenant] -= n
        self.total -= n
        if self.by_tenant[tenant] <= 0:
            del self.by_tenant[tenant]
