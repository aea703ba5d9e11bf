"""The node disk cache of adapter files: bounded in bytes, verified on read, durable and safe to
share between writers. Files here are opaque bytes; the engine-level refetch of a corrupted
entry is in test_adapter_tiers.py."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from loraplane.adapter_format import adapter_digest, file_digest
from loraplane.node_cache.store import STALE_STAGING_SECONDS, DiskCache

KB = 1024


def fetch(cache: DiskCache, source: str, size: int, seed: int) -> tuple[str, Path]:
    """What a load does: fetch into a staging folder, commit, read, release."""
    staged = cache.staging()
    (staged / "adapter_config.json").write_text(f'{{"r": {seed}}}')
    (staged / "adapter_model.safetensors").write_bytes(bytes([seed % 256]) * size)
    digest, folder = cache.commit(staged, source)
    cache.release(folder)
    return digest, folder


def test_the_cache_stays_within_its_bound_evicting_the_least_wanted(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, max_bytes=250 * KB, policy="lru")
    a, folder_a = fetch(cache, "s3://b/a", 100 * KB, 1)
    b, _ = fetch(cache, "s3://b/b", 100 * KB, 2)
    assert cache.get("s3://b/a", a) == (a, folder_a)  # a is used again: b is now the least recent
    cache.release(folder_a)
    fetch(cache, "s3://b/c", 100 * KB, 3)
    assert cache.used_bytes <= 250 * KB and len(cache) == 2
    assert cache.get("s3://b/b", b) is None  # evicted, and its files are gone from the disk
    assert len([p for p in (tmp_path / "adapters").iterdir() if len(p.name) == 64]) == 2
    assert cache.evictions == 1


def test_an_entry_being_read_or_pinned_is_not_evicted(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, max_bytes=150 * KB, policy="lru")
    a, folder_a = fetch(cache, "s3://b/a", 100 * KB, 1)
    assert cache.get("s3://b/a", a) == (a, folder_a)  # a load is reading it
    b, _ = fetch(cache, "s3://b/b", 100 * KB, 2)  # over the bound, and a is protected: b goes
    assert (folder_a / "adapter_model.safetensors").is_file()
    assert cache.get("s3://b/b", b) is None
    cache.release(folder_a)
    cache.pin("s3://b/a")
    c, _ = fetch(cache, "s3://b/c", 100 * KB, 3)  # a is no longer read, but pinned
    assert cache.get("s3://b/a", a) == (a, folder_a)
    cache.release(folder_a)
    assert cache.get("s3://b/c", c) is None
    cache.unpin("s3://b/a")
    fetch(cache, "s3://b/c", 100 * KB, 3)  # unpinned and least recent: a goes now
    assert cache.get("s3://b/a", a) is None
    assert cache.used_bytes <= 150 * KB


def test_a_corrupted_entry_is_dropped_on_read_so_the_caller_fetches_it_again(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path)
    digest, folder = fetch(cache, "s3://b/a", 10 * KB, 1)
    weights = folder / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert cache.get("s3://b/a", digest) is None
    assert not folder.exists() and len(cache) == 0
    again, folder2 = fetch(cache, "s3://b/a", 10 * KB, 1)  # the refetch lands under the same content name
    assert again == digest and cache.get("s3://b/a", digest) == (digest, folder2)
    cache.release(folder2)
    # The adapter digest (config, weights and golden outputs) finds it too; the folder's name is its hex.
    assert cache.get("s3://b/a", adapter_digest(folder2)) == (digest, folder2)
    assert folder2.name == adapter_digest(folder2).removeprefix("sha256:")
    cache.release(folder2)
    # A changed config is a different adapter too, though the weights' digest did not change.
    (folder2 / "adapter_config.json").write_text('{"r": 64}')
    assert cache.get("s3://b/a", digest) is None


def test_a_restart_adopts_the_entries_on_disk_under_the_bound_oldest_first(tmp_path: Path) -> None:
    first = DiskCache(tmp_path)
    digests = {}
    for i, name in enumerate("abc"):
        digests[name], folder = fetch(first, f"s3://b/{name}", 100 * KB, i + 1)
        os.utime(folder, (time.time() - 100 + i, time.time() - 100 + i))  # a oldest, c newest
    second = DiskCache(tmp_path, max_bytes=210 * KB, policy="lru")  # room for two
    assert len(second) == 2 and second.used_bytes <= 210 * KB
    assert second.get("s3://b/a", digests["a"]) is None
    assert second.get("s3://b/c", digests["c"]) is not None


def test_two_writers_of_the_same_content_both_succeed(tmp_path: Path) -> None:
    """Two replicas on one node fetching the same adapter at once: each writes its own temporary
    folder, one rename wins, neither fails, and the entry is whole."""
    caches = [DiskCache(tmp_path), DiskCache(tmp_path)]
    results: list[str] = []
    errors: list[BaseException] = []

    def writer(cache: DiskCache) -> None:
        try:
            results.append(fetch(cache, "s3://b/shared", 200 * KB, 7)[0])
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(c,)) for c in caches for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    hit = caches[0].get("s3://b/shared", results[0])
    assert hit is not None and file_digest(hit[1] / "adapter_model.safetensors") == results[0]
    assert not [p for p in (tmp_path / "adapters").iterdir() if p.name.startswith(".fetch-")]
    assert not [p for p in (tmp_path / "adapters" / "by-source").iterdir() if p.name.startswith(".alias-")]


def test_a_crashed_fetch_is_cleaned_up_at_the_next_start(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path)
    old, fresh = cache.staging(), cache.staging()
    (old / "adapter_model.safetensors").write_bytes(b"half")
    stale = time.time() - STALE_STAGING_SECONDS - 60
    os.utime(old, (stale, stale))
    DiskCache(tmp_path)
    assert not old.exists()
    assert fresh.exists()  # perhaps another replica's fetch in progress: left alone


def test_a_commit_is_durable_before_it_is_visible(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Crash consistency, by the order of the system calls: every fetched file and the staged
    folder are fsynced before the rename that makes the folder visible under its content address,
    and the cache folder after it; the alias is written to a temporary file, fsynced, renamed over
    the old one, and its folder fsynced. A crash between any two calls leaves either the old state
    or a complete new entry, never a visible folder whose files the disk has not got."""
    calls: list[tuple[str, ...]] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd: int) -> None:
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst) -> None:  # type: ignore[no-untyped-def]
        calls.append(("rename", str(src), str(dst)))
        real_rename(src, dst)

    def replace(src, dst) -> None:  # type: ignore[no-untyped-def]
        calls.append(("rename", str(src), str(dst)))
        real_replace(src, dst)

    cache = DiskCache(tmp_path, max_bytes=1024 * KB, policy="lru")
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    digest, folder = fetch(cache, "s3://b/a", 10 * KB, 1)
    monkeypatch.undo()

    renames = [i for i, c in enumerate(calls) if c[0] == "rename"]
    assert len(renames) == 2, calls  # the folder into place, then the alias
    folder_at, alias_at = renames
    staged = calls[folder_at][1]
    assert calls[folder_at][2] == str(folder)
    synced_before = {c[1] for c in calls[:folder_at] if c[0] == "fsync"}
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert f"{staged}/{name}" in synced_before, f"{name} was not fsynced before the folder became visible"
    assert staged in synced_before, "the staged folder's entries were not fsynced before its rename"
    root = str(folder.parent)
    assert ("fsync", root) in calls[folder_at:alias_at], "the rename into the cache folder was not made durable"
    alias_tmp, alias = calls[alias_at][1], calls[alias_at][2]
    assert ("fsync", alias_tmp) in calls[folder_at:alias_at], "the alias was renamed before its contents were on disk"
    assert ("fsync", str(Path(alias).parent)) in calls[alias_at:], "the alias's rename was not made durable"
    assert cache.get("s3://b/a", digest) == (digest, folder)
