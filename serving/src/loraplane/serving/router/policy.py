"""Where one request goes: affinity (warm replicas first, then consistent hashing with bounded
loads) or round-robin, and a label saying why, which the metrics count.

The decisions are:
- ``device_hit`` / ``host_hit``: a replica that holds the adapter in that tier took it;
- ``hashed``: nobody holds it warm (or the warm ones are full) and the ring's home for it did;
- ``overflow``: the home was above the load bound, the next replica on the ring took it;
- ``round_robin``: the round-robin policy, warm or not;
- ``stored_response``: the replica that keeps the stored response a Responses API request goes
  on from (``previous_response_id``; chosen by the forwarder, before the policy);
- ``dedicated``: a replica serving the adapter merged into the base (a dedicated deployment) took
  it. Such a replica takes nothing else, and while none is up (or each failed this request) the
  adapter's requests go to the shared replicas, where it stays registered.

The load is the router's own count of requests in flight to each replica, the same load model as
``loraplane sim --replicas`` so that the benchmark can put the two side by side.
"""

from __future__ import annotations

import itertools
from typing import Literal

from loraplane.routing import BoundedLoadRing
from loraplane.serving.router.table import Replica

Policy = Literal["affinity", "round-robin"]
DECISIONS = ("device_hit", "host_hit", "hashed", "overflow", "round_robin", "stored_response", "dedicated")


class Router:
    def __init__(self, policy: Policy = "affinity", epsilon: float = 0.25) -> None:
        if policy not in ("affinity", "round-robin"):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy, self.epsilon = policy, epsilon
        self._rings: dict[tuple[str, ...], BoundedLoadRing] = {}
        self._turn = itertools.count()

    def _ring(self, names: tuple[str, ...]) -> BoundedLoadRing:
        ring = self._rings.get(names)
        if ring is None:
            if len(self._rings) > 64:  # membership churn: keep the cache small
                self._rings.clear()
            ring = self._rings[names] = BoundedLoadRing(names, epsilon=self.epsilon)
        return ring

    def choose(self, model: str, replicas: list[Replica]) -> tuple[Replica, str] | None:
        """The replica for a request to ``model`` among ``replicas`` (the up ones not yet tried)."""
        dedicated = [r for r in replicas if r.dedicated_model == model]
        if dedicated:
            return min(dedicated, key=lambda r: (r.in_flight, r.name)), "dedicated"
        replicas = [r for r in replicas if r.dedicated_model is None]
        if not replicas:
            return None
        # Replicas that list the adapter at all come first: a replica the operator has not staged
        # it on yet would answer 404. A model nobody lists (the base) may go anywhere.
        holders = [r for r in replicas if model in r.registered]
        pool = sorted(holders or replicas, key=lambda r: r.name)
        if self.policy == "round-robin":
            return pool[next(self._turn) % len(pool)], "round_robin"
        by_name = {r.name: r for r in pool}
        warm = [r.name for r in pool if model in r.device] + [r.name for r in pool if model in r.host]
        ring = self._ring(tuple(by_name))
        chosen = by_name[ring.choose(model, lambda n: by_name[n].in_flight, warm)]
        if model in chosen.device:
            return chosen, "device_hit"
        if model in chosen.host:
            return chosen, "host_hit"
        return chosen, "hashed" if ring.preference(model)[0] == chosen.name else "overflow"
