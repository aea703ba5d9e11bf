"""Fetches that stop as they stream: an adapter's files at their byte caps before the bytes past
them land, a fetch at its deadline between the pieces a trickling store sends, and a node cache
that counts a fetch's bytes against its bound while they land. A namespace user chooses the
source; whoever fetches it (the operator, the node agent, a replica) keeps its disk."""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from flaky_proxy import flaky_proxy
from s3_server import ACCESS, SECRET, moto_server, upload_folder
from small_disk import fill, small_disk

from loraplane.adapter_format import AdapterValidationError, ErrorCode
from loraplane.adapter_format.digest import CONFIG_FILE, WEIGHTS_FILE
from loraplane.adapter_format.download import FetchBounds, write_capped
from loraplane.adapter_format.sources import S3Settings, open_source
from loraplane.node_cache.fetch import acquire
from loraplane.node_cache.store import DiskCache

MiB = 2**20


def _folder(path: Path, weights_bytes: int, *, sparse: bool = False) -> Path:
    """An adapter-shaped folder: a small config and a weights file of the given size (random
    bytes, or a hole when ``sparse``: 100 GiB that costs the disk nothing)."""
    path.mkdir(parents=True)
    (path / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    if sparse:
        with (path / WEIGHTS_FILE).open("wb") as fh:
            fh.truncate(weights_bytes)
    else:
        (path / WEIGHTS_FILE).write_bytes(os.urandom(weights_bytes))
    return path


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[str, object]]:
    with moto_server() as endpoint, flaky_proxy(endpoint) as proxy:
        yield endpoint, proxy


def _settings(url: str) -> S3Settings:
    return S3Settings(endpoint=url, access_key=ACCESS, secret_key=SECRET, region="us-east-1")


def test_an_object_listed_over_its_cap_is_refused_before_it_is_read(store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    endpoint, proxy = store
    uri = upload_folder(endpoint, "adapters", "big/one", _folder(tmp_path / "big", 3 * MiB))
    landed: list[int] = []
    into = tmp_path / "into"
    into.mkdir()
    before = proxy.bytes_from_target
    with pytest.raises(AdapterValidationError) as err:
        open_source(uri, _settings(proxy.url)).fetch(into, FetchBounds.within(max_weights_bytes=MiB, on_bytes=landed.append))
    assert err.value.code is ErrorCode.TOO_LARGE and WEIGHTS_FILE in err.value.message
    assert not (into / WEIGHTS_FILE).exists() and sum(landed) == (into / CONFIG_FILE).stat().st_size
    assert proxy.bytes_from_target - before < 64 * 1024  # the listing and the config, none of the weights


def test_a_stream_longer_than_its_listing_stops_at_the_cap(tmp_path: Path) -> None:
    """An object replaced after it was listed, or a file that grows while it is read: an endless
    stream is cut at the cap, and nothing of it stays on disk."""

    def endless() -> Iterator[bytes]:
        while True:
            yield b"\0" * (256 * 1024)

    landed: list[int] = []
    target = tmp_path / WEIGHTS_FILE
    with pytest.raises(AdapterValidationError) as err:
        write_capped(endless(), target, 3 * MiB, FetchBounds.within(on_bytes=landed.append), "s3://adapters/x")
    assert err.value.code is ErrorCode.TOO_LARGE and not target.exists() and sum(landed) <= 3 * MiB


def test_a_trickling_store_is_left_at_the_deadline(store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """40 KB/s from the store: the 1 MiB weights would take half a minute; a one-second fetch stops
    at its deadline between the pieces, with no partial file left."""
    endpoint, proxy = store
    uri = upload_folder(endpoint, "adapters", "slow/one", _folder(tmp_path / "slow", MiB))
    into = tmp_path / "into"
    into.mkdir()
    proxy.trickle = 4096
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            open_source(uri, _settings(proxy.url)).fetch(into, FetchBounds.within(1.0))
        assert time.monotonic() - started < 10
    finally:
        proxy.trickle = None
    assert not (into / WEIGHTS_FILE).exists()


@pytest.mark.parametrize("name", [WEIGHTS_FILE, CONFIG_FILE])
def test_a_file_as_large_as_a_disk_is_refused_from_its_size(tmp_path: Path, name: str) -> None:
    folder = _folder(tmp_path / "src", 1024)
    with (folder / name).open("r+b") as fh:
        fh.truncate(100 * 2**30)
    into = tmp_path / "into"
    into.mkdir()
    with pytest.raises(AdapterValidationError) as err:
        open_source(str(folder)).fetch(into)
    assert err.value.code is ErrorCode.TOO_LARGE and name in err.value.message
    assert sum(p.stat().st_size for p in into.iterdir()) < 1024


def test_the_node_cache_counts_a_fetch_in_flight_against_its_bound(tmp_path: Path) -> None:
    """Bytes landing count from the first chunk: an unpinned entry is evicted to make room for
    them; when pinned entries leave no room, the fetch stops (ENOSPC, retried later) and leaves
    nothing behind."""
    cache = DiskCache(tmp_path / "cache", max_bytes=4 * MiB)
    old = acquire(cache, str(_folder(tmp_path / "old", 3 * MiB)), None, None)
    cache.release(old.folder)
    new = acquire(cache, str(_folder(tmp_path / "new", 2 * MiB)), None, None)
    assert cache.evictions == 1 and not old.folder.exists()  # evicted while the new one landed
    cache.release(new.folder)
    cache.pin(str(tmp_path / "new"))
    with pytest.raises(OSError) as err:
        acquire(cache, str(_folder(tmp_path / "third", 3 * MiB)), None, None)
    assert err.value.errno == errno.ENOSPC
    assert cache.landing_bytes == 0 and cache.used_bytes <= 4 * MiB and new.folder.exists()
    assert not [p for p in cache.root.iterdir() if p.name.startswith(".fetch-")]


def test_a_full_disk_fails_a_node_cache_fetch_alone_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """The cache's volume full (a real one: a small tmpfs): the fetch fails (ENOSPC, retried), no
    half-written folder stays, what is cached keeps being served, and with room again it lands."""
    small, large = _folder(tmp_path / "small", 16 * 1024), _folder(tmp_path / "large", 128 * 1024)
    with small_disk(tmp_path / "disk", 512) as disk:
        cache = DiskCache(disk / "cache")
        kept = acquire(cache, str(small), None, None)
        cache.release(kept.folder)
        filler = fill(disk)
        with pytest.raises(OSError) as err:
            acquire(cache, str(large), None, None)
        assert err.value.errno == errno.ENOSPC and cache.landing_bytes == 0
        assert not [p for p in cache.root.iterdir() if p.name.startswith(".fetch-")]
        assert cache.get(str(small), f"sha256:{kept.folder.name}") is not None  # still served
        filler.unlink()
        assert acquire(cache, str(large), None, None).tier == "cold"
