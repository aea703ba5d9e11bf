"""What the router knows about each serving replica: up or down, requests it has in flight there,
and which adapters the replica holds in which tier.

Residency comes from two places. The replica's ``/admin/stats`` is the truth, read every few
seconds; between reads the router assumes an adapter it just sent somewhere is now on that
replica's device, which is what the replica does on the first request. Without that guess every
request in the first interval after a cold start would hash, and a burst would scatter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplane.admin_api import ReplicaStats, Tier


@dataclass
class Replica:
    name: str
    url: str
    up: bool = True
    in_flight: int = 0
    served: int = 0
    waiting: int = 0  # the replica's own queue depth at the last stats read
    max_model_len: int = 0  # its context, once its stats said
    dedicated_model: str | None = None  # the one model a merged (dedicated) replica serves, once its stats said
    registered: set[str] = field(default_factory=set)  # every adapter it lists, in any tier
    owners: dict[str, str | None] = field(default_factory=dict)  # adapter -> its tenant (None: shared)
    device: set[str] = field(default_factory=set)
    host: set[str] = field(default_factory=set)
    error: str | None = None

    def view(self) -> dict[str, object]:
        return {
            "name": self.name, "url": self.url, "up": self.up, "in_flight": self.in_flight, "served": self.served,
            "waiting": self.waiting, "device": sorted(self.device), "host": sorted(self.host),
            "registered": len(self.registered), "error": self.error, "dedicated_model": self.dedicated_model,
        }  # fmt: skip


DEFAULT_MAX_MODEL_LEN = 4096  # the engine's own default (config.max_model_len unset)


class ReplicaTable:
    """Every replica the discovery reports, by name. Only the router's event loop touches it."""

    def __init__(self, *, proof_first: bool = False) -> None:
        """``proof_first``: a new member is down until the upkeep reads its signed stats (the router
        holds a token): being in the Service says only that a pod wears the labels."""
        self.replicas: dict[str, Replica] = {}
        self.proof_first = proof_first

    @property
    def max_model_len(self) -> int:
        """The largest context a member reports now: what a request without max_tokens, or one
        going on from a stored conversation the router cannot see, may use at most. The engine's
        default until a replica says; a replica gone, or restarted with less, counts no more."""
        return max((r.max_model_len for r in self.replicas.values() if r.max_model_len), default=DEFAULT_MAX_MODEL_LEN)

    def set_members(self, members: dict[str, str]) -> None:
        """Replace the membership (name -> URL) with what discovery reports now; a replica that
        stays keeps its counts, one whose URL changed starts afresh (a new pod behind the name)."""
        for name in list(self.replicas):
            if name not in members or self.replicas[name].url != members[name]:
                del self.replicas[name]
        for name, url in members.items():
            if name not in self.replicas:
                replica = self.replicas[name] = Replica(name, url.rstrip("/"))
                if self.proof_first:
                    self.mark_down(replica, "not yet proven a replica of this base")

    def up(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.up]

    def mark_down(self, replica: Replica, why: str) -> None:
        replica.up, replica.error = False, why

    def mark_up(self, replica: Replica) -> None:
        replica.up, replica.error = True, None

    def apply_stats(self, replica: Replica, stats: ReplicaStats) -> None:
        adapters = stats.adapters
        replica.registered = set(adapters)
        replica.owners = {n: a.tenant for n, a in adapters.items()}
        replica.device = {n for n, a in adapters.items() if a.tier is Tier.DEVICE}
        replica.host = {n for n, a in adapters.items() if a.tier is Tier.HOST}
        replica.waiting = stats.waiting
        if stats.max_model_len is not None:
            replica.max_model_len = stats.max_model_len
        replica.dedicated_model = stats.dedicated_model

    def shared(self) -> list[Replica]:
        """The up replicas of the shared base: those that serve every adapter (not a dedicated one)."""
        return [r for r in self.replicas.values() if r.up and r.dedicated_model is None]

    def owner(self, adapter: str) -> tuple[bool, str | None]:
        """Whether a replica lists the adapter now, and its tenant (None: shared), so the edge can
        hide another tenant's adapter before any quota of it answers."""
        for replica in self.replicas.values():
            if adapter in replica.owners:
                return True, replica.owners[adapter]
        return False, None

    def sent(self, replica: Replica, adapter: str) -> None:
        """The guess between two stats reads: the adapter now sits on this replica's device."""
        replica.in_flight += 1
        replica.served += 1
        if adapter in replica.registered or not replica.registered:
            replica.host.discard(adapter)
            replica.device.add(adapter)
