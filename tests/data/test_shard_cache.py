"""The node's shard cache and the reads behind it: transient errors retried (a bounded number of times), one
fetch per shard among concurrent readers, a dead fetch's leftovers removed."""

from __future__ import annotations

import fcntl
import os
import pathlib
import threading

import pytest
from _shard_files import FlakyFS, GarbledFS, hold, lock_waiters, until, write_parquet

from croupier.client import FILTERED
from croupier.data import Retry, ShardCache, ShardedDataset, ShardError
from croupier.data._storage import transient


def _flaky(tmp_path: pathlib.Path, attempts: int, **kw: object) -> ShardedDataset:
    files = write_parquet(tmp_path / "d", [6, 6])
    FlakyFS.failures = 0
    ds = ShardedDataset([f"flakytest://{f}" for f in files], cache_dir=tmp_path / "cache",
                        retry=Retry(attempts=attempts, first_wait_s=0.001, max_wait_s=0.01), **kw)  # type: ignore[arg-type]
    FlakyFS.opens = 0
    return ds


def test_a_read_that_fails_twice_then_works_is_retried(tmp_path: pathlib.Path) -> None:
    ds = _flaky(tmp_path, attempts=3)
    FlakyFS.failures = 2
    assert ds[7]["id"] == 7
    assert FlakyFS.opens == 3 and ds.cache.fetches == 1  # two failed tries, then the fetch


def test_a_copy_whose_md5_is_not_the_etag_is_fetched_again(tmp_path: pathlib.Path) -> None:
    """The store's etag is the MD5 of the shard: a copy garbled in transit is caught and fetched again; one
    garbled on every try is named, never read. (Whole shards: a range carries no checksum of the store's.)"""
    files = write_parquet(tmp_path / "d", [6, 6])
    ds = ShardedDataset([f"garbledtest://{f}" for f in files], cache_dir=tmp_path / "cache",
                        retry=Retry(attempts=3, first_wait_s=0.001, max_wait_s=0.01), range_reads=False)
    GarbledFS.garbles, GarbledFS.opens = 1, 0
    assert [ds[i]["id"] for i in range(12)] == list(range(12))
    assert GarbledFS.opens == 3 and ds.cache.fetches == 2  # shard 0: a garbled copy, then a good one
    bad = ShardedDataset([f"garbledtest://{f}" for f in files], cache_dir=tmp_path / "cache2",
                         retry=Retry(attempts=2, first_wait_s=0.001, max_wait_s=0.01), range_reads=False)
    GarbledFS.garbles = 2
    with pytest.raises(ShardError, match="has MD5 [0-9a-f]{32}, but the store's etag is [0-9a-f]{32}"):
        bad[0]


def test_retries_are_bounded(tmp_path: pathlib.Path) -> None:
    ds = _flaky(tmp_path, attempts=2)
    FlakyFS.failures = 2
    with pytest.raises(ShardError) as e:
        ds[7]
    assert "flakytest://" in str(e.value) and "unreadable after 2 tries" in str(e.value)
    assert "ConnectionResetError" in str(e.value) and "indices 6 to 11" in str(e.value)
    assert FlakyFS.opens == 2 and ds.cache.fetches == 0 and ds.cache.held_bytes() == 0
    skip = _flaky(tmp_path / "skip", attempts=2, on_error="skip")
    FlakyFS.failures = 2
    assert skip[7] is FILTERED and skip[0]["id"] == 0


def test_what_is_transient() -> None:
    from botocore.exceptions import ClientError

    def client_error(status: int, code: str) -> ClientError:
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")

    assert transient(OSError(5, "EIO")) and transient(TimeoutError()) and transient(ConnectionResetError())
    assert transient(client_error(503, "SlowDown")) and transient(client_error(500, "InternalError"))
    assert not transient(FileNotFoundError()) and not transient(PermissionError())
    assert not transient(client_error(403, "AccessDenied")) and not transient(ValueError("bad"))


def test_concurrent_readers_of_one_shard_fetch_it_once(tmp_path: pathlib.Path) -> None:
    """Two readers ask for a shard while a third holds its lock: both wait, one fetches, the other finds it."""
    cache = ShardCache(tmp_path / "c", max_bytes=1000)
    fetched: list[int] = []

    def fetch(dest: str) -> None:
        fetched.append(1)
        pathlib.Path(dest).write_bytes(b"x" * 100)

    lock = os.path.join(cache.root, "k.lock")
    fd = hold(lock)
    paths: list[str] = []
    readers = [threading.Thread(target=lambda: paths.append(cache.ensure("k", 100, fetch))) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        until("two readers waiting on the shard's lock",
              lambda: lock_waiters(lock) == 2 or not any(t.is_alive() for t in readers))
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    for t in readers:
        t.join(timeout=20)
    assert len(fetched) == 1 and cache.fetches == 1
    assert paths == [cache.path("k")] * 2 and pathlib.Path(cache.path("k")).read_bytes() == b"x" * 100


def test_a_dead_fetch_leaves_no_claim(tmp_path: pathlib.Path) -> None:
    """A ``.part`` whose fetch died (its lock free) is removed when room is made, and its bytes no longer count."""
    cache = ShardCache(tmp_path / "c", max_bytes=1000)
    dead = pathlib.Path(cache.root) / "gone.900.12345.abcd.part"
    dead.write_bytes(b"y" * 300)
    cache.ensure("k", 500, lambda dest: pathlib.Path(dest).write_bytes(b"x" * 500))
    assert not dead.exists() and cache.held_bytes() == 500


def test_a_live_fetch_holds_its_room(tmp_path: pathlib.Path) -> None:
    """The bytes a live fetch announces count against the bound: room is made around them."""
    cache = ShardCache(tmp_path / "c", max_bytes=1000)
    cache.ensure("old", 400, lambda dest: pathlib.Path(dest).write_bytes(b"o" * 400))
    fd = hold(os.path.join(cache.root, "busy.lock"))
    live = pathlib.Path(ShardCache(cache.root, max_bytes=1000)._reserve("busy", 500))  # as another process's fetch
    try:
        cache.ensure("new", 400, lambda dest: pathlib.Path(dest).write_bytes(b"n" * 400))
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    assert live.exists() and not os.path.exists(cache.path("old")) and cache.held_bytes() == 400


def test_a_fetch_with_room_does_not_look_at_the_folder(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache's count of its bytes lets a fetch with room reserve it at once; a count too high (left by a
    process killed mid-change) costs a look at the folder, which sets it right, never the bound."""
    cache = ShardCache(tmp_path / "c", max_bytes=1000)
    looks: list[int] = []
    in_flight = cache._in_flight  # asked once a look at the folder
    monkeypatch.setattr(cache, "_in_flight", lambda key: (looks.append(1), in_flight(key))[1])
    cache.ensure("a", 300, lambda dest: pathlib.Path(dest).write_bytes(b"a" * 300))  # no count yet: a look
    cache.ensure("b", 300, lambda dest: pathlib.Path(dest).write_bytes(b"b" * 300))
    assert len(looks) == 1 and cache.held_bytes() == 600
    (pathlib.Path(cache.root) / ".cache.bytes").write_text("900")  # too high: room for b's 300 is not seen
    cache.ensure("c", 300, lambda dest: pathlib.Path(dest).write_bytes(b"c" * 300))
    assert len(looks) == 2 and cache.held_bytes() == 900  # looked, found room, evicted nothing
    cache.ensure("d", 300, lambda dest: pathlib.Path(dest).write_bytes(b"d" * 300))
    assert len(looks) == 3 and cache.held_bytes() == 900  # the bound: one evicted
    cache.discard("d")
    cache.ensure("e", 300, lambda dest: pathlib.Path(dest).write_bytes(b"e" * 300))
    assert len(looks) == 3 and cache.held_bytes() == 900  # d's bytes taken off the count: room at once
