"""When one adapter dominates its base's traffic: the rule behind a merged dedicated deployment.

The lesson's decision chart ends with *one adapter dominates traffic? give it a merged dedicated
deployment, keep the long tail on the shared base*: a merged model pays no adapter overhead and
takes no device slot from the tail. ``loraplane plan`` applies this rule to a table of steady
traffic; the operator applies it to the request rates its replicas report, through
:class:`DominanceTracker`, which adds time: an adapter must stay above the share for a while before
it counts, and below a lower share for a while before it stops counting, so a burst never creates
(or a lull removes) a Deployment. One module so the planner's recommendation and the operator's
decision cannot disagree.

Shares, not absolute rates: "dominant" is about the pool's mix (how much of the pool's work one
customer is), which is what decides whether the tail gains from its leaving. The rate floor keeps
an idle base (one request a minute, all to one adapter: a share of 1) from counting.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DominanceRule:
    """``share``: the fraction of the base's requests above which an adapter is dominant, held for
    ``hold_seconds``; ``return_share``: below it for ``return_seconds``, it is not any more (between
    the two shares nothing changes). ``min_rps``: its own rate must reach this too. ``max_dedicated``:
    at most this many adapters of one base are dominant at once (the largest shares first)."""

    share: float = 0.25
    hold_seconds: float = 600.0
    return_share: float = 0.15
    return_seconds: float = 1800.0
    min_rps: float = 1.0
    max_dedicated: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.return_share <= self.share <= 1:
            raise ValueError(f"need 0 < return share ({self.return_share}) <= share ({self.share}) <= 1")

    def enters(self, share: float, rps: float) -> bool:
        """Above the entry line now (the planner's whole test: its traffic table is steady)."""
        return share >= self.share and rps >= self.min_rps

    def leaves(self, share: float, rps: float) -> bool:
        """Below the return line now."""
        return share < self.return_share or rps < self.min_rps


def shares(rates: Mapping[str, float]) -> dict[str, float]:
    """Each adapter's fraction of the base's requests (all zero when nothing is asked)."""
    total = sum(max(0.0, r) for r in rates.values())
    return {name: (max(0.0, r) / total if total > 0 else 0.0) for name, r in rates.items()}


def steady_dominant(rule: DominanceRule, rates: Mapping[str, float]) -> list[str]:
    """The adapters a steady traffic table makes dominant, largest share first, at most
    ``rule.max_dedicated`` of them: what the tracker settles on when these rates last."""
    share = shares(rates)
    above = [n for n in rates if rule.enters(share[n], rates[n])]
    return sorted(above, key=lambda n: (-share[n], n))[: rule.max_dedicated]


def dedicated_replicas(share: float, pool_replicas: int, max_replicas: int) -> int:
    """Replicas for a dominant adapter out of a pool sized for the whole base: its share of them,
    rounded to the nearest (at least one), at most ``max_replicas``, and always leaving the tail
    one. 0 when the pool has a single replica: nothing can be carved out of it."""
    if pool_replicas < 2:
        return 0
    fair = max(1, math.floor(share * pool_replicas + 0.5))
    return min(fair, max_replicas, pool_replicas - 1)


@dataclass
class _Track:
    dominant: bool = False
    crossing_since: float | None = None  # when it crossed the line that would change ``dominant``
    share: float = 0.0
    rps: float = 0.0


@dataclass
class DominanceTracker:
    """The rule over time, for one base: :meth:`update` with each sync's request rates."""

    rule: DominanceRule
    tracks: dict[str, _Track] = field(default_factory=dict)

    def update(self, rates: Mapping[str, float], now: float) -> list[str]:
        """The dominant adapters after this observation, largest share first. An adapter missing
        from ``rates`` (deleted, not Ready) is forgotten. The ``max_dedicated`` cap keeps the
        incumbents: a new adapter takes a place only when one is free, so two dominant adapters
        trading places by a request do not swap Deployments."""
        share = shares(rates)
        self.tracks = {n: t for n, t in self.tracks.items() if n in rates}
        ready: list[str] = []  # past the entry line for the whole hold: dominant when a place is free
        for name, rps in rates.items():
            track = self.tracks.setdefault(name, _Track())
            track.share, track.rps = share[name], rps
            crossing = self.rule.leaves(share[name], rps) if track.dominant else self.rule.enters(share[name], rps)
            if not crossing:
                track.crossing_since = None
                continue
            if track.crossing_since is None:
                track.crossing_since = now
            if track.dominant and now - track.crossing_since >= self.rule.return_seconds:
                track.dominant, track.crossing_since = False, None
            elif not track.dominant and now - track.crossing_since >= self.rule.hold_seconds:
                ready.append(name)

        def by_share(names: Iterable[str]) -> list[str]:
            return sorted(names, key=lambda n: (-self.tracks[n].share, n))

        incumbents = by_share(n for n, t in self.tracks.items() if t.dominant)
        for name in incumbents[self.rule.max_dedicated :]:  # a lowered cap: the smallest shares go back first
            self.tracks[name].dominant = False
        incumbents = incumbents[: self.rule.max_dedicated]
        for name in by_share(ready)[: self.rule.max_dedicated - len(incumbents)]:
            self.tracks[name].dominant, self.tracks[name].crossing_since = True, None
            incumbents.append(name)
        return by_share(incumbents)

    def seed(self, dominant: Iterable[str]) -> None:
        """Start from a decision taken before (shown on the objects): these are dominant until
        they stay below the return line for ``return_seconds``."""
        for name in dominant:
            self.tracks[name] = _Track(dominant=True)

    def pending(self, name: str, now: float) -> float | None:
        """Seconds ``name`` has been past the line that would change its state (None: it is not)."""
        track = self.tracks.get(name)
        return None if track is None or track.crossing_since is None else now - track.crossing_since

    def share(self, name: str) -> float:
        track = self.tracks.get(name)
        return track.share if track else 0.0
