"""Node-local disk cache of adapter folders, content-addressed, bounded in bytes.

Each fetched folder is stored under its adapter digest (``adapter_format.digest``: the config,
the weights and the golden outputs together; two adapters with the same weights but different
``lora_alpha`` or target modules are different adapters). A small alias per source URI records
which content that source last gave and the weights' digest, so a restart with the same
registration (source and declared digest, of either form) is a local read.

What a cache shared by replicas and outliving crashes needs:

- **Atomic, durable writes.** A fetch lands in a private temporary folder (a unique name, so two
  writers on one node never share one); its files and the folder are fsynced before the rename
  into place, and the parent after it, so a crash leaves either the whole entry or none of it.
- **Verification on read.** A folder is checked against its content address before it is used;
  one that no longer matches (bit rot, a truncated copy, a hand edit) is deleted and the caller
  fetches it again, rather than failing with a digest mismatch on every load from then on.
- **A size bound.** Entries are counted in bytes in a :class:`~loraplane.eviction.tier.Tier`
  under the engine's eviction policy, and after every write or read the least wanted ones go until
  the cache fits. An entry being read by a load, or the content of a pinned adapter, is never
  evicted: while they alone exceed the bound, the cache stays over it (a newly fetched adapter is
  always kept long enough to be loaded) and shrinks as soon as they are released.

The bound is kept by each process for the entries it knows (those on disk when it started and
those it wrote). Replicas sharing a directory each enforce it; one may delete a folder another is
about to read, which that load sees as a missing file: a transient failure, retried from the
source with backoff.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from loraplane.adapter_format import adapter_digest, parse_digest
from loraplane.adapter_format.digest import WEIGHTS_FILE, file_digests
from loraplane.eviction import Tier, make_policy
from loraplane.usage.spool import fsync_path

_CONTENT_NAME = re.compile(r"^[0-9a-f]{64}$")
STALE_STAGING_SECONDS = 3600.0  # a temporary fetch folder this old is a crash's leftover


def _alias_name(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:40] + ".json"


def content_address(folder: Path, digests: dict[str, str] | None = None) -> str:
    """A folder's name in the cache: the hex of its adapter digest."""
    return adapter_digest(folder, digests).removeprefix("sha256:")


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


class BoundFull(OSError):
    """ENOSPC from the cache's own bound (what is pinned or being read leaves no room), as against
    the volume's: the first means the staged set does not fit the bound, the second a disk fuller
    than the bound assumed, which is an error to report and retry."""


class DiskCache:
    def __init__(
        self, root: Path, *, max_bytes: int | None = None, policy: str = "demand", enforce_now: bool = True,
        sole_writer: bool = False,
    ) -> None:  # fmt: skip
        """``max_bytes`` None leaves the cache unbounded. ``enforce_now`` False evicts nothing (the
        adopted entries, or what is written meanwhile) until :meth:`enforce`: an owner that learns
        its pins after a restart says when it knows them. ``sole_writer``: no other process
        fetches into ``root`` (the node agent's), so every temporary fetch folder found at start is
        a crash's leftover, removed now rather than when it is old."""
        self.sole_writer = sole_writer
        self.root = root / "adapters"
        self.aliases = self.root / "by-source"
        self.aliases.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.evictions = 0
        self._lock = threading.Lock()  # loads run on a pool of worker threads
        self._reading: Counter[str] = Counter()  # content -> loads reading it now
        self._pinned: set[str] = set()  # sources whose content stays
        self._content_of: dict[str, str] = {}  # source -> content, as far as this process has seen
        self._landing: Counter[str] = Counter()  # staging folder -> bytes a fetch has written into it
        # The tier orders and counts; the bound is kept by _enforce, which may leave the cache over
        # it while protected entries alone fill it (an insert into a full Tier would raise instead).
        self.tier = Tier(2**62, make_policy(policy), name="disk cache", in_use=self._protected)
        self._enforcing = enforce_now
        self._scan()
        self._enforce()

    # what is on disk ------------------------------------------------------------------------
    def _scan(self) -> None:
        """Adopt the entries a previous process left, oldest use first (a hit touches the folder's
        mtime), so the bound applies to them and their eviction order survives a restart. Crash
        leftovers of temporary folders are removed."""
        entries: list[tuple[float, str, int]] = []
        for child in self.root.iterdir():
            if child.name.startswith(".fetch-"):
                with contextlib.suppress(OSError):
                    if self.sole_writer or time.time() - child.stat().st_mtime > STALE_STAGING_SECONDS:
                        shutil.rmtree(child, ignore_errors=True)
            elif _CONTENT_NAME.match(child.name) and child.is_dir():
                with contextlib.suppress(OSError):
                    entries.append((child.stat().st_mtime, child.name, _folder_bytes(child)))
        for _, name, size in sorted(entries):
            self.tier.insert(name, size)

    @property
    def used_bytes(self) -> int:
        return self.tier.used

    @property
    def landing_bytes(self) -> int:
        """Bytes fetches have written and not yet committed: counted against the bound."""
        return sum(self._landing.values())

    def __len__(self) -> int:
        return len(self.tier)

    # eviction -------------------------------------------------------------------------------
    def _protected(self, content: object) -> bool:
        return self._reading[str(content)] > 0 or any(self._content_of.get(s) == content for s in self._pinned)

    def _delete(self, content: object) -> None:
        """Evict: the folder and the aliases this process knows point at it."""
        self.evictions += 1
        shutil.rmtree(self.root / str(content), ignore_errors=True)
        for source in [s for s, c in self._content_of.items() if c == content]:
            del self._content_of[source]
            (self.aliases / _alias_name(source)).unlink(missing_ok=True)

    def _alias(self, source: str) -> dict[str, str]:
        try:
            alias = json.loads((self.aliases / _alias_name(source)).read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        return alias if isinstance(alias, dict) else {}

    def pin(self, source: str) -> None:
        """Keep the content this source gave (now and after its next fetch) whatever the bound."""
        content = self._alias(source).get("content")
        with self._lock:
            self._pinned.add(source)
            if isinstance(content, str) and content in self.tier:
                self._content_of.setdefault(source, content)

    def unpin(self, source: str) -> None:
        with self._lock:
            self._pinned.discard(source)

    # reads ----------------------------------------------------------------------------------
    def cached_bytes(self, source: str, digest: str) -> int | None:
        """The bytes of this source's copy with this digest if one is on disk, without hashing it
        (a report, not a read: :meth:`get` verifies)."""
        alias = self._alias(source)
        content = str(alias.get("content", ""))
        if parse_digest(digest) not in (str(alias.get("weights", "")), f"sha256:{content}") or not _CONTENT_NAME.match(content):
            return None
        with self._lock:
            return self.tier.size(content)

    def get(self, source: str, digest: str) -> tuple[str, Path] | None:
        """(weights digest, folder) of this source's cached copy if it has this digest (the
        adapter's, or the earlier form's of the weights alone) and still matches its content
        address; the caller then holds it for reading until :meth:`release`. A folder that no
        longer matches is deleted and None returned, so the caller fetches it again."""
        alias = self._alias(source)
        content, weights = str(alias.get("content", "")), str(alias.get("weights", ""))
        if parse_digest(digest) not in (weights, f"sha256:{content}") or not _CONTENT_NAME.match(content):
            return None
        folder = self.root / content
        with self._lock:
            self._reading[content] += 1
        try:
            if not (folder / WEIGHTS_FILE).is_file() or content_address(folder) != content:
                raise FileNotFoundError(folder)
        except OSError:  # missing, unreadable or no longer what its name says
            with self._lock:
                self._reading[content] -= 1
                self.tier.remove(content)
            shutil.rmtree(folder, ignore_errors=True)
            return None
        with contextlib.suppress(OSError):  # the recency a restart's scan orders by (not on a read-only mount)
            os.utime(folder)
        with self._lock:
            self._content_of[source] = content
            if content in self.tier:
                self.tier.touch(content)
            else:  # written by another process sharing the directory
                self.tier.insert(content, _folder_bytes(folder))
            self._enforce()
        return weights, folder

    def hold(self, content: str) -> Path | None:
        """Hold an entry for reading as :meth:`get` does, without checking its files again: a read a
        previous process began (the agent's leases survive its restart); :meth:`release` ends it.
        None when no such entry is on disk."""
        with self._lock:
            if content not in self.tier:
                return None
            self._reading[content] += 1
        return self.root / content

    def release(self, folder: Path) -> None:
        """A load has finished reading ``folder``: it may be evicted again."""
        with self._lock:
            self._reading[folder.name] -= 1
            if self._reading[folder.name] <= 0:
                del self._reading[folder.name]
            self._enforce()

    # writes ---------------------------------------------------------------------------------
    def staging(self) -> Path:
        staged = Path(tempfile.mkdtemp(prefix=".fetch-", dir=self.root))
        with self._lock:
            self._landing[staged.name] = 0
        return staged

    def land(self, staged: Path, size: int) -> None:
        """A fetch into ``staged`` is about to write ``size`` more bytes: they count against the
        bound from now (entries are evicted to make room), and are refused with ``ENOSPC`` (a
        transient failure, retried) when what is pinned or being read leaves no room for them."""
        with self._lock:
            self._landing[staged.name] += size
            self._enforce()
            if self._enforcing and self.max_bytes is not None and self.tier.used + self.landing_bytes > self.max_bytes:
                self._landing[staged.name] -= size
                raise BoundFull(errno.ENOSPC, f"the node cache's bound of {self.max_bytes} bytes is full of adapters in use")

    def commit(self, staged: Path, source: str) -> tuple[str, Path]:
        """Move a fetched folder into place under its content address, durably; returns (weights
        digest, folder), which the caller holds for reading until :meth:`release`."""
        digests = file_digests(staged)
        weights, content = digests[WEIGHTS_FILE], content_address(staged, digests)
        target = self.root / content
        for child in staged.iterdir():
            if child.is_file():
                fsync_path(child)
        staged.chmod(0o755)  # mkdtemp's 0700 would hide it from the other replicas sharing the node
        fsync_path(staged)
        with self._lock:
            self._reading[content] += 1
        try:
            try:
                os.rename(staged, target)
            except OSError:  # the same content is already there (another adapter or replica)
                shutil.rmtree(staged, ignore_errors=True)
            fsync_path(self.root)
            fd, tmp = tempfile.mkstemp(prefix=".alias-", dir=self.aliases)
            with os.fdopen(fd, "w") as fh:
                json.dump({"source": source, "weights": weights, "content": content}, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.aliases / _alias_name(source))
            fsync_path(self.aliases)
        except BaseException:
            self.release(target)
            raise
        with self._lock:
            self._landing.pop(staged.name, None)
            self._content_of[source] = content
            if content not in self.tier:
                self.tier.insert(content, _folder_bytes(target))
            self._enforce()
        return weights, target

    def enforce(self) -> None:
        """Keep the bound from now on, starting now."""
        with self._lock:
            self._enforcing = True
            self._enforce()

    def _enforce(self) -> None:
        """Evict unprotected entries, least wanted first, until the cache fits its bound."""
        while self._enforcing and self.max_bytes is not None and self.tier.used + self.landing_bytes > self.max_bytes:
            victim = self.tier.policy.victim(self._protected)
            if victim is None:
                return
            self.tier.remove(victim)
            self._delete(victim)

    def discard(self, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)
        with self._lock:
            self._landing.pop(staged.name, None)
