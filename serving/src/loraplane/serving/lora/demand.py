"""Demand for each adapter, and the hot set it makes.

Demand is requests per adapter on arrival, decayed with a half-life in wall time, plus the
requests queued for it now; it decides which adapter a drain picks and which adapters form the
hot set, the ones that keep their device slots. The half-life is short enough to follow a shift in
traffic within a minute, long enough that at a fraction of a request per second the hot adapter's
lead is not lost to the noise of a few arrivals.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Container, Mapping

from loraplane.eviction.demand import DecayedCounts

DEMAND_HALF_LIFE_SECONDS = 30.0
# Hysteresis: a member stays until a newcomer's demand is HOT_SET_MARGIN times its own, so two
# adapters of similar demand do not trade the hot set back and forth on noise.
HOT_SET_MARGIN = 1.5
# ... and no adapter is hot on fewer decayed requests than this: at startup the first adapter to
# arrive would otherwise hold the hot set before the real favourite has shown itself.
HOT_SET_MIN = 4.0
HOT_SET_REFRESH_SECONDS = 0.05  # it is asked on every eviction decision


class Demand:
    def __init__(self, queued: Callable[[], Mapping[str, int]]) -> None:
        """``queued`` counts the requests waiting per adapter (the scheduler's queue)."""
        self.arrivals = DecayedCounts(DEMAND_HALF_LIFE_SECONDS, clock=time.monotonic)
        self.queued = queued
        self._hot: frozenset[str] = frozenset()
        self._hot_at = -1.0

    def note_arrival(self, name: str) -> None:
        self.arrivals.add(name)

    def forget(self, name: str) -> None:
        self.arrivals.forget(name)

    def of(self, name: str, queued: Mapping[str, int] | None = None) -> float:
        """Decayed arrivals plus the requests queued now (``queued``: the scheduler's counts, when
        the caller already has them)."""
        return self.arrivals.value(name) + (self.queued() if queued is None else queued).get(name, 0)

    def hot_set(self, room: int, registered: Container[str]) -> frozenset[str]:
        """The ``room`` registered adapters with the highest decayed arrival rate, with hysteresis;
        recomputed at most every HOT_SET_REFRESH_SECONDS."""
        now = time.monotonic()
        if now - self._hot_at < HOT_SET_REFRESH_SECONDS:
            return self._hot
        self._hot_at = now
        contenders = {
            str(n) for n in [*self.arrivals.top(room), *self._hot] if n in registered and self.arrivals.value(n) >= HOT_SET_MIN
        }
        margin = math.log2(HOT_SET_MARGIN)
        ranked = sorted(contenders, key=lambda n: self.arrivals.rank_key(n) + (margin if n in self._hot else 0.0))
        self._hot = frozenset(ranked[-room:] if room > 0 else [])
        return self._hot
