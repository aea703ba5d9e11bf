"""Adapter names and their versions: what is registered, what a running request holds, and
the snapshot the server's event loop reads.

A name maps to one current version (an :class:`AdapterEntry`). Registering a new version while
the old one still has running requests *retires* the old one under a private key instead of
dropping it: its requests finish on the weights they started with, and new requests get the new
version at once. This is how a promotion never fails a request in flight.

The registry knows nothing about tiers. What a version's residency must do when it is dropped or
retired (give up its slot, leave host memory) is the manager's, passed in as callbacks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from loraplane.adapter_format import check_adapter_name
from loraplane.serving.lora.entries import AdapterEntry, AdapterNotFound, AdapterSpec


class AdapterRegistry:
    def __init__(
        self,
        *,
        on_drop: Callable[[str], None],
        on_retire: Callable[[str, str, AdapterEntry], None],
        on_retired_done: Callable[[str], None],
    ) -> None:
        """``on_drop(name)`` takes an idle version out of the tiers; ``on_retire(name, key, entry)``
        moves a busy one's residency to its private key; ``on_retired_done(key)`` frees it once
        its last running request has released it."""
        self._on_drop, self._on_retire, self._on_retired_done = on_drop, on_retire, on_retired_done
        self.entries: dict[str, AdapterEntry] = {}
        self.retired: dict[str, AdapterEntry] = {}  # replaced versions still finishing running requests
        self._retired_count = 0
        # What the server's event loop may read without going through the engine thread: an
        # immutable snapshot of the registered names and their specs, replaced (never changed)
        # by the engine thread whenever a registration changes, so a reader sees one whole
        # version of it. Routing each lookup through the engine thread would add up to a step's
        # length to every request's admission.
        self.catalog: Mapping[str, AdapterSpec] = MappingProxyType({})

    def get(self, name: str) -> AdapterEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise AdapterNotFound(name) from None

    def lookup(self, key: object) -> AdapterEntry | None:
        """A current version by its name, or a retired one by its private key."""
        return self.entries.get(str(key)) or self.retired.get(str(key))

    def register(self, spec: AdapterSpec) -> None:
        """Declare an adapter (or a new version of one: a new source or digest). Nothing is loaded."""
        check_adapter_name(spec.name)
        old = self.entries.get(spec.name)
        if old is not None:
            if old.spec == spec:
                return
            self._set_aside(spec.name)
        self.entries[spec.name] = AdapterEntry(spec, pinned=old.pinned if old else False)
        self._publish()

    def unregister(self, name: str) -> None:
        """New requests stop finding the adapter at once; running ones finish on it first."""
        self.get(name)
        self._set_aside(name)
        del self.entries[name]
        self._publish()

    def _set_aside(self, name: str) -> None:
        """The current version leaves its name: retired while it has running requests, else dropped."""
        entry = self.entries[name]
        if not entry.running:
            self._on_drop(name)
            entry.loaded = None
            return
        self._retired_count += 1
        key = f"{name}#retired-{self._retired_count}"
        entry.retired_key = key
        self.retired[key] = entry
        self._on_retire(name, key, entry)

    def _publish(self) -> None:
        self.catalog = MappingProxyType({name: entry.spec for name, entry in self.entries.items()})

    def acquire(self, name: str) -> AdapterEntry:
        """Count a running request against the adapter; returns the lease to release, which stays
        with this version even if the name is re-registered meanwhile."""
        entry = self.get(name)
        entry.running += 1
        return entry

    def release(self, lease: AdapterEntry) -> None:
        lease.running -= 1
        key = lease.retired_key
        if key is not None and lease.running == 0 and key in self.retired:
            self._on_retired_done(key)
            del self.retired[key]
            lease.loaded = None
