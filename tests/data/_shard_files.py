"""Shards for croupier.data's tests (rows whose `id` is their dataset index), file systems that fail or garble
their first reads, and helpers for tests across processes (the S3-API server is tests/_s3.py's)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import os
import pathlib
import tarfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem


def write_parquet(folder: pathlib.Path, sizes: Sequence[int], row_group: int = 4, first: int = 0,
                  text: str = "row") -> list[pathlib.Path]:
    """One parquet file per size, rows numbered on from `first` (``id``) with a text column; `row_group`
    rows per row group."""
    folder.mkdir(parents=True, exist_ok=True)
    out, n = [], first
    for i, size in enumerate(sizes):
        ids = list(range(n, n + size))
        table = pa.table({"id": pa.array(ids, pa.int64()), "text": [f"{text} {j}" for j in ids]})
        path = folder / f"{i:05d}.parquet"
        pq.write_table(table, path, row_group_size=row_group)
        out.append(path)
        n += size
    return out


def write_tars(folder: pathlib.Path, sizes: Sequence[int], first: int = 0) -> list[pathlib.Path]:
    """One webdataset tar per size: sample k is ``KEY.id`` (its dataset index), ``KEY.txt`` and ``KEY.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    out, n = [], first
    for i, size in enumerate(sizes):
        path = folder / f"{i:05d}.tar"
        with tarfile.open(path, "w") as tar:
            for j in range(n, n + size):
                for ext, data in (("id", str(j).encode()), ("txt", f"text {j}".encode()),
                                  ("json", f'{{"n": {j}}}'.encode())):
                    info = tarfile.TarInfo(f"part/{j:08d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        out.append(path)
        n += size
    return out


class FlakyFS(LocalFileSystem):
    """Local files under the protocol ``flakytest://`` (so read as remote ones, through the cache), whose
    first `failures` opens for reading fail with a transient error."""

    protocol = ("flakytest",)
    failures = 0
    opens = 0

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" in mode:
            type(self).opens += 1
            if type(self).failures > 0:
                type(self).failures -= 1
                raise OSError(errno.ECONNRESET, "connection reset (flakytest)")
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("flakytest", FlakyFS, clobber=True)


class GarbledFS(LocalFileSystem):
    """Local files under ``garbledtest://`` whose info carries the MD5 of their bytes as the etag (as S3 gives
    for an object uploaded in one part), and whose first `garbles` reads serve a copy with one byte changed."""

    protocol = ("garbledtest",)
    garbles = 0
    opens = 0

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        out = dict(super().info(path, **kwargs))
        with open(self._strip_protocol(path), "rb") as f:
            out["ETag"] = '"' + hashlib.md5(f.read(), usedforsecurity=False).hexdigest() + '"'
        return out

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" in mode:
            type(self).opens += 1
            if type(self).garbles > 0:
                type(self).garbles -= 1
                data = bytearray(pathlib.Path(self._strip_protocol(path)).read_bytes())
                data[len(data) // 2] ^= 0xFF  # one byte changed in transit
                return io.BytesIO(bytes(data))
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("garbledtest", GarbledFS, clobber=True)


def lock_waiters(lock_file: str) -> int:
    """Processes blocked on a flock of `lock_file` now (from /proc/locks: lines with ``->`` on its inode)."""
    ino = os.stat(lock_file).st_ino
    with open("/proc/locks") as f:
        return sum(1 for line in f if "->" in line and "FLOCK" in line and line.split()[6].endswith(f":{ino}"))


def hold(lock_file: str) -> int:
    """An open file holding an exclusive flock on `lock_file` (close it to let go)."""
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def until(what: str, cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Waits for `cond()` to hold, checking every 5 ms; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s} s")
        time.sleep(0.005)


def read_one(manifest: str, options: dict[str, Any], cache_dir: str, index: int, ready: Any, out: Any) -> None:
    """A process of its own reading dataset index `index` of the manifest's shards: says it is ready, reads,
    and reports the row's id and the fetches it made."""
    from croupier.data import Manifest, ShardedDataset

    ds = ShardedDataset(Manifest.from_json(manifest), storage_options=options, cache_dir=cache_dir, verify=False)
    ready.put(os.getpid())
    out.put((ds[index]["id"], ds.cache.fetches))


def row_id(row: dict[str, Any]) -> int:
    """A row's id (a transform a DataLoader's workers can unpickle)."""
    return int(row["id"])
