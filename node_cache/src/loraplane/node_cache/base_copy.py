"""A base checkpoint from object storage (or a folder), copied once per node and published only
when whole and verified.

The copy lands in a private temporary folder, is hashed file by file into one folder digest,
checked against the digest the BaseModel declares (when it declares one), fsynced, renamed to
``bases/<digest hex>`` and only then published: ``bases/by-source/<key>`` is a symlink replaced
atomically (``os.replace``). A serving pod's init step waits for that link (``wait_for_base``), so
no process ever opens a half-written or unverified base; a crash mid-copy leaves a temporary
folder the next start removes. A new declared digest for the same source is fetched beside the old
copy, so pods still running on the old one keep their files.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

from loraplane.adapter_format.digest import file_digest
from loraplane.adapter_format.download import FetchBounds, response_chunks, write_capped
from loraplane.adapter_format.sources import S3Settings
from loraplane.usage.spool import fsync_path

MAX_BASE_FILES = 4096  # a checkpoint is a few shards, a config and a tokenizer; far more is not one
BASE_FETCH_DEADLINE_SECONDS = 4 * 3600.0  # a 140 GB checkpoint at 10 MB/s, not forever
DISK_RESERVE_BYTES = 2 * 2**30  # left free on the node's disk whatever a base's size
STAGED_FILE = "staged.json"  # in bases/: the link names of the copies staged by the operator (merged models)


class BaseDigestMismatch(ValueError):
    """The copied files do not hash to the digest the BaseModel declares."""


def source_key(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:40]


def published_path(root: Path, source: str) -> Path:
    """Where a base's verified copy is published on the node (a symlink to its content folder):
    the serving pods' engine config names this path, which the operator computes the same way."""
    return root / "bases" / "by-source" / source_key(source)


def folder_digest(folder: Path) -> str:
    """``sha256:<hex>`` over one ``<relative path>=<file digest>`` line per file, sorted: what
    ``loraplane digest --base`` prints for a checkpoint folder, to declare in the BaseModel."""
    lines = sorted(f"{p.relative_to(folder).as_posix()}={file_digest(p)}" for p in folder.rglob("*") if p.is_file())
    listing = "\n".join(lines)
    return f"sha256:{hashlib.sha256(listing.encode()).hexdigest()}"


def _room(folder: Path) -> int:
    """What a base copy may still write on this disk: its free space less a reserve, so a base
    larger than the disk stops before the node's adapters and pods have no room left."""
    return shutil.disk_usage(folder).free - DISK_RESERVE_BYTES


def _download(source: str, into: Path, s3: S3Settings | None, bounds: FetchBounds) -> None:
    """A base's files into ``into``, each object streamed: stopped before the disk's room runs out
    (its listed size is checked first) and at the deadline between chunks."""
    parsed = urlparse(source)
    if parsed.scheme == "s3":
        client = (s3 or S3Settings.from_env()).client()
        prefix = parsed.path.strip("/") + "/"
        objects = [o for o in client.list_objects(parsed.netloc, prefix=prefix, recursive=True) if not o.is_dir]
        if not objects:
            raise FileNotFoundError(f"{source} holds no files")
        if len(objects) > MAX_BASE_FILES:
            raise ValueError(f"{source} holds {len(objects)} files, more than a checkpoint's {MAX_BASE_FILES}")
        for obj in objects:
            relative = obj.object_name[len(prefix) :]
            target = (into / relative).resolve()
            if not target.is_relative_to(into.resolve()) or not relative:
                raise ValueError(f"{source}: object {obj.object_name!r} would land outside the base's folder")
            target.parent.mkdir(parents=True, exist_ok=True)
            room = _room(into)
            if (obj.size or 0) > room:
                raise OSError(errno.ENOSPC, f"{source}: {relative} is {obj.size} bytes, the node's disk has room for {room}")
            bounds.check_time(source)
            response = client.get_object(parsed.netloc, obj.object_name)
            try:
                write_capped(response_chunks(response), target, room, bounds, source)
            finally:
                response.close()
                response.release_conn()
    elif parsed.scheme in ("file", ""):
        folder = Path(parsed.path if parsed.scheme else source)
        if not folder.is_dir():
            raise FileNotFoundError(f"{source} is not a folder")
        shutil.copytree(folder, into, dirs_exist_ok=True, symlinks=False)
    else:
        raise ValueError(f"{source!r}: a base copied to the node cache is s3://bucket/prefix or file:///path")


class BaseStore:
    def __init__(self, root: Path) -> None:
        self.bases = root / "bases"
        self.links = self.bases / "by-source"
        self.links.mkdir(parents=True, exist_ok=True)
        for child in self.bases.iterdir():  # a crashed copy's leftovers; nothing reads them
            if child.name.startswith(".fetch-"):
                shutil.rmtree(child, ignore_errors=True)

    def published(self, source: str) -> tuple[str, Path] | None:
        """(digest, folder) of the source's published copy, if there is one."""
        link = self.links / source_key(source)
        with contextlib.suppress(OSError):
            target = link.resolve(strict=True)
            return f"sha256:{target.name}", target
        return None

    def ensure(self, source: str, digest: str | None, s3: S3Settings | None) -> tuple[str, Path]:
        """The source's verified copy on this node, fetched unless the published one has the
        declared digest (any published one, when none is declared). Returns (digest, folder)."""
        current = self.published(source)
        if current is not None and digest in (None, current[0]):
            return current
        staged = Path(tempfile.mkdtemp(prefix=".fetch-", dir=self.bases))
        try:
            _download(source, staged, s3, FetchBounds.within(BASE_FETCH_DEADLINE_SECONDS))
            got = folder_digest(staged)
            if digest is not None and got != digest:
                raise BaseDigestMismatch(f"{source} hashes to {got}, not the declared {digest}")
            for path in staged.rglob("*"):
                if path.is_file():
                    fsync_path(path)
            for path in [staged, *(p for p in staged.rglob("*") if p.is_dir())]:
                path.chmod(0o755)  # mkdtemp's 0700 would hide it from the serving pods' user
                fsync_path(path)
            target = self.bases / got.removeprefix("sha256:")
            try:
                os.rename(staged, target)
            except OSError:  # this content is already here (published for another source)
                shutil.rmtree(staged, ignore_errors=True)
            fsync_path(self.bases)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        self._publish(source, target)
        return got, target

    def staged_keys(self) -> set[str]:
        """The link names of the copies published for the operator's staging (merged models), as
        recorded beside them, so an agent's restart still knows which it may delete."""
        try:
            return set(json.loads((self.bases / STAGED_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            return set()

    def record_staged(self, source: str) -> None:
        keys = self.staged_keys()
        if source_key(source) in keys:
            return
        scratch = self.bases / f".{STAGED_FILE}.tmp"
        scratch.write_text(json.dumps(sorted(keys | {source_key(source)})))
        os.replace(scratch, self.bases / STAGED_FILE)

    def keep_only(self, sources: set[str]) -> list[Path]:
        """Unpublish every staged copy (:meth:`record_staged`) but ``sources``' and delete the
        folders nothing published any longer points to (a merged model the operator no longer
        stages); the folders deleted. The base's own copy, and one a published source replaced (a
        new digest), are not touched here: pods may still run on them."""
        keys = {source_key(s) for s in sources}
        staged = self.staged_keys()
        dropped: set[Path] = set()
        for link in list(self.links.iterdir()):
            if link.name in keys or link.name not in staged:
                continue
            with contextlib.suppress(OSError):
                dropped.add(link.resolve(strict=True))
            link.unlink(missing_ok=True)
        if staged - keys:
            scratch = self.bases / f".{STAGED_FILE}.tmp"
            scratch.write_text(json.dumps(sorted(staged & keys)))
            os.replace(scratch, self.bases / STAGED_FILE)
        if not dropped:
            return []
        fsync_path(self.links)
        still = set()
        for link in self.links.iterdir():
            with contextlib.suppress(OSError):
                still.add(link.resolve(strict=True))
        gone = sorted(p for p in dropped - still if p.parent == self.bases.resolve())
        for folder in gone:
            shutil.rmtree(folder, ignore_errors=True)
        return gone

    def _publish(self, source: str, target: Path) -> None:
        tmp = self.links / f".link-{os.getpid()}-{time.monotonic_ns()}"
        os.symlink(os.path.relpath(target, self.links), tmp)
        os.replace(tmp, self.links / source_key(source))
        fsync_path(self.links)


def wait_for_base(root: Path, source: str, timeout: float, digest: str | None = None, poll: float = 1.0) -> Path:
    """Block until the source's verified copy is published on this node (the one with ``digest``,
    when given: after a new digest, the old copy stays published until the new one replaces it);
    its path."""
    link = published_path(root, source)
    deadline = time.monotonic() + timeout

    def ready() -> bool:
        with contextlib.suppress(OSError):
            target = link.resolve(strict=True)  # first: a link that is not there is no copy, any digest or none
            return digest is None or f"sha256:{target.name}" == digest
        return False

    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{source} was not published on this node within {timeout:.0f} s (see the node agent's state)")
        time.sleep(poll)
    return link
