"""What the adapter manager records about each adapter, and the errors it answers with: the
registration (``AdapterSpec``), the manager's own record of a version (``AdapterEntry``), and the
read-only view callers get (``AdapterInfo``)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from loraplane.admin_api import Tier  # what stats report is what the manager tracks
from loraplane.serving.lora.peft_loader import LoadedAdapter
from loraplane.serving.lora.slot_store import Placement

Fetched = tuple[LoadedAdapter, str, float]  # the weights, where they came from (disk or cold), seconds


class AdapterNotFound(KeyError):
    def __str__(self) -> str:
        return f"adapter {self.args[0]!r} is not registered"


class AdapterBusy(RuntimeError):
    pass


class PinLimitReached(RuntimeError):
    """Pinning one more adapter would leave unpinned traffic without a device slot."""


class AdapterUnavailable(RuntimeError):
    """The adapter's files were refused (a permanent failure): requests fail at once until a new
    version is registered, instead of fetching the same bad files again for each."""


@dataclass(frozen=True)
class AdapterSpec:
    """What a registration says: where the adapter lives and what it must hash to."""

    name: str
    source: str
    digest: str | None = None
    tenant: str | None = None
    allow_rank_truncation: bool = False
    version: str | None = None  # the registrant's label for this revision (e.g. a date); shown, not interpreted


@dataclass
class AdapterEntry:
    """One registered version and where it is now (the manager's record; callers see AdapterInfo)."""

    spec: AdapterSpec
    loaded: LoadedAdapter | None = None
    placement: Placement | None = None  # its device slot (and pages), while on the device
    future: Future[Fetched] | None = None
    error: str | None = None
    pinned: bool = False
    running: int = 0
    permanent: bool = False  # its files were refused: no refetch until a new version is registered
    failures: int = 0  # transient failures in a row
    retry_at: float = 0.0  # no new load before this (monotonic seconds)
    retired_key: str | None = None  # set once a new version took its name (see _retire)
    placed_step: int = 0  # the engine step in which it last took a device slot (see drain.SlotDrain)

    @property
    def slot(self) -> int | None:
        return self.placement.slot if self.placement is not None else None

    @property
    def residency(self) -> Tier:
        if self.placement is not None:
            return Tier.DEVICE
        if self.loaded is not None:
            return Tier.HOST
        if self.future is not None:
            return Tier.LOADING
        return Tier.FAILED if self.error else Tier.COLD

    def info(self, name: str) -> AdapterInfo:
        """The read-only view callers get, under the name it is registered as."""
        loaded = self.loaded
        return AdapterInfo(
            name=name,
            source=self.spec.source,
            version=self.spec.version,
            tenant=self.spec.tenant,
            residency=self.residency,
            pinned=self.pinned,
            running=self.running,
            # What the manifest declared (the operator's servingDigest), else what the files hash to.
            digest=self.spec.digest or (loaded.manifest.adapter_digest if loaded else None),
            rank=loaded.rank if loaded else None,
            slot=self.slot,
            truncation_error=loaded.truncation_error if loaded else None,
            error=self.error,
            folder=loaded.folder if loaded else None,
        )


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    source: str
    version: str | None
    tenant: str | None
    residency: Tier
    pinned: bool
    running: int
    digest: str | None
    rank: int | None
    slot: int | None
    truncation_error: float | None
    error: str | None
    folder: Path | None


@dataclass
class LoadFailure:
    name: str
    message: str
