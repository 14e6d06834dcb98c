"""Where shards live: fsspec file systems, a shard's identity (size, etag or mtime), and retried reads."""

from __future__ import annotations

import dataclasses
import datetime
import errno
import hashlib
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import fsspec
import fsspec.asyn

from croupier.core.checks import check_int

log = logging.getLogger("croupier.data")
T = TypeVar("T")

#: Bytes copied per read when a shard is fetched (one ranged request each on an object store).
CHUNK_BYTES = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class Retry:
    """How a transient read error is retried: `attempts` tries in all, waits growing exponentially.

    The wait before try k (k = 1, 2, ...) is ``min(max_wait_s, first_wait_s * 2**(k-1))``, scaled by a
    random factor in [0.5, 1] so that the ranks of a node do not retry in step.

    Args:
        attempts: Tries in all, the first included (>= 1).
        first_wait_s: The wait before the second try, in seconds.
        max_wait_s: The longest wait between two tries, in seconds.
    """

    attempts: int = 5
    first_wait_s: float = 0.2
    max_wait_s: float = 10.0

    def __post_init__(self) -> None:
        check_int("attempts", self.attempts, 1)
        if not (self.first_wait_s >= 0 and self.max_wait_s >= self.first_wait_s):
            raise ValueError(f"Retry needs 0 <= first_wait_s <= max_wait_s (got first_wait_s={self.first_wait_s}, "
                             f"max_wait_s={self.max_wait_s})")

    def wait_s(self, tried: int) -> float:
        """The wait after the `tried`-th failed try (1 for the first)."""
        return min(self.max_wait_s, self.first_wait_s * 2.0 ** (tried - 1)) * random.uniform(0.5, 1.0)

    def run(self, what: str, call: Callable[[], T]) -> T:
        """`call()`, tried again on a transient error (:func:`transient`) until `attempts` tries failed.

        Raises:
            Exception: the last error, once the tries are spent, or at once if it is not transient.
        """
        for tried in range(1, self.attempts + 1):
            try:
                return call()
            except Exception as e:
                if tried == self.attempts or not transient(e):
                    raise
                wait = self.wait_s(tried)
                log.info("%s: try %d of %d failed (%s: %s); again in %.2f s", what, tried, self.attempts,
                         type(e).__name__, e, wait)
                time.sleep(wait)
        raise AssertionError("unreachable")  # the last try returned or raised


#: OSErrors that trying again does not cure: what is missing, refused or not a file stays so.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


#: An etag that is the MD5 of the object's bytes (an object uploaded in one part; a multipart etag has a "-N").
_MD5 = re.compile(r"[0-9a-fA-F]{32}")


def transient(e: BaseException) -> bool:
    """Whether trying the read again may succeed: an OSError other than a missing, refused or wrong kind of
    file (timeouts and broken connections included), an object store's 5xx, throttling or timeout."""
    if isinstance(e, _PERMANENT):
        return False
    if isinstance(e, (OSError, TimeoutError)):
        return True
    try:
        from botocore.exceptions import ClientError, ConnectionError, HTTPClientError, ReadTimeoutError
    except ImportError:  # no S3 support installed: nothing of botocore's can be raised
        return False
    if isinstance(e, ClientError):
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return status >= 500 or status == 429 or code in ("SlowDown", "Throttling", "RequestTimeout")
    return isinstance(e, (ConnectionError, HTTPClientError, ReadTimeoutError))


class ContentChanged(ValueError):
    """A conditional read refused by the store: the object is not the content the condition named."""


def _protocols(fs: Any) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


@dataclasses.dataclass(frozen=True)
class Stat:
    """What the store says of a file: its size in bytes, its etag (None where the store keeps none) and its
    modification time in seconds (None where unknown)."""

    size: int
    etag: str | None
    mtime: float | None


def stat_of(info: Mapping[str, Any]) -> Stat:
    """A :class:`Stat` from an fsspec ``info()`` or listing entry (S3's ``ETag`` and ``LastModified``, a
    local file's ``mtime``, GCS's ``etag`` and ``updated``)."""
    etag = info.get("ETag", info.get("etag"))
    mtime: float | None = None
    for name in ("mtime", "LastModified", "updated", "last_modified", "created"):
        v = info.get(name)
        if isinstance(v, (int, float)):
            mtime = float(v)
        elif isinstance(v, datetime.datetime):
            mtime = v.timestamp()
        elif isinstance(v, str):
            try:
                mtime = datetime.datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
        if mtime is not None:
            break
    return Stat(size=int(info["size"]), etag=None if etag is None else str(etag).strip('"'), mtime=mtime)


class Storage:
    """The file systems of one dataset's shards, from their URLs and fsspec's `storage_options`.

    A file system is made in the process that uses it (after a fork or an unpickling, anew): an object
    store's client is not safe to share across processes.

    Args:
        storage_options: Passed to the file system of every URL's protocol (credentials, ``endpoint_url``
            in ``client_kwargs`` for S3, ...), as ``fsspec.core.url_to_fs`` takes them.
        retry: How transient errors are retried.
    """

    def __init__(self, storage_options: Mapping[str, Any] | None = None, retry: Retry | None = None) -> None:
        self.storage_options = dict(storage_options or {})
        self.retry = retry or Retry()
        self._lock = threading.Lock()
        self._fs: dict[str, Any] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {"storage_options": self.storage_options, "retry": self.retry}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["storage_options"], state["retry"])  # type: ignore[misc]

    def fs(self, url: str) -> tuple[Any, str]:
        """The file system of `url` and the path within it."""
        protocol = fsspec.core.split_protocol(url)[0] or "file"
        with self._lock:
            if self._pid != os.getpid():
                self._fs, self._pid = {}, os.getpid()
            fs = self._fs.get(protocol)
            if fs is None:
                fs, _ = fsspec.core.url_to_fs(url, **self.storage_options)
                self._fs[protocol] = fs
        return fs, fs._strip_protocol(url)

    def is_local(self, url: str) -> bool:
        """Whether `url` is a file on this machine's file system (read in place, not through the cache)."""
        return "file" in _protocols(self.fs(url)[0])

    def local_path(self, url: str) -> str:
        """The path on this machine of a local `url`."""
        return str(self.fs(url)[1])

    def stat(self, url: str, fresh: bool = True) -> Stat:
        """The file's :class:`Stat`, asked of the store (`fresh`: not from a listing it cached), retried."""
        fs, path = self.fs(url)

        def call() -> Stat:
            if fresh:
                fs.invalidate_cache(path)
            return stat_of(fs.info(path))

        return self.retry.run(f"stat {url}", call)

    def listing(self, url: str) -> dict[str, Stat]:
        """The :class:`Stat` of every file in the folder of `url`, by path, asked of the store (empty if the folder
        is gone)."""
        fs, path = self.fs(url)
        parent = fs._parent(path)
        fs.invalidate_cache(parent)
        try:
            entries = self.retry.run(f"list {parent}", lambda: fs.ls(parent, detail=True))
        except FileNotFoundError:
            return {}
        return {fs._strip_protocol(e["name"]): stat_of(e) for e in entries if e.get("type") != "directory"}

    def open(self, url: str, block_size: int = 2**20, size: int | None = None) -> Any:
        """A seekable file object reading `url` (reads of `block_size` bytes at least); with its `size` known
        (from a listing or a manifest), an object store is not asked for it first."""
        fs, path = self.fs(url)
        more = {} if size is None else {"size": size}
        return self.retry.run(f"open {url}", lambda: fs.open(path, "rb", block_size=block_size, **more))

    def fetch(self, url: str, dest: str, size: int, etag: str | None = None) -> None:
        """Copies `url` to the local file `dest` (created, empty), `size` bytes, in large ranged reads; a
        copy cut short is a transient error, tried again from the start. Where the store's `etag` is the
        MD5 of the content (S3 and most of its kind give it for an object uploaded in one part: 32 hex
        digits), the copy's MD5 must match it: a copy that does not is a transient error too.

        Raises:
            OSError: the copy failed, the last try's error once the tries are spent.
        """
        fs, path = self.fs(url)
        want = etag.lower() if etag is not None and _MD5.fullmatch(etag) else None

        def call() -> None:
            got = 0
            digest = hashlib.md5(usedforsecurity=False) if want is not None else None
            with fs.open(path, "rb", block_size=CHUNK_BYTES, cache_type="none") as src, open(dest, "wb") as out:
                while chunk := src.read(CHUNK_BYTES):
                    out.write(chunk)
                    got += len(chunk)
                    if digest is not None:
                        digest.update(chunk)
            if got != size:
                raise OSError(errno.EIO, f"read {got} bytes of {url}, expected {size}")
            if digest is not None and digest.hexdigest() != want:
                raise OSError(errno.EIO, f"the copy of {url} has MD5 {digest.hexdigest()}, but the store's etag is {want}")

        self.retry.run(f"fetch {url}", call)

    def read_all(self, url: str) -> bytes:
        """The whole of the (small) file `url`, in one read, retried.

        Raises:
            FileNotFoundError: there is no such file.
            OSError: the read failed, the last try's error once the tries are spent.
        """
        fs, path = self.fs(url)
        return self.retry.run(f"read {url}", lambda: bytes(fs.cat_file(path)))

    def write_all(self, url: str, data: bytes) -> None:
        """Writes `data` as the file `url` in one request (an object store's put: whole or not at all), retried.

        Raises:
            OSError: the store refused the write (PermissionError) or it failed, the last try's error.
        """
        fs, path = self.fs(url)
        self.retry.run(f"write {url}", lambda: fs.pipe_file(path, data))

    def conditional(self, url: str) -> bool:
        """Whether :meth:`read_range` of `url` can be made on the condition that the object's etag is one given
        (S3's ``If-Match``): the store then refuses a read of changed content itself, in the same request."""
        return "s3" in _protocols(self.fs(url)[0])

    def read_range(self, url: str, start: int, end: int, etag: str | None = None) -> bytes:
        """Bytes [`start`, `end`) of `url`, in one ranged read; a read cut short is a transient error, tried
        again. No checksum: a store's etag covers a whole object, never a range. With `etag` (where
        :meth:`conditional`), the read is made on the condition that the object's etag is `etag`.

        Raises:
            ContentChanged: the store refused the condition (the object's etag is not `etag`).
            OSError: the read failed, the last try's error once the tries are spent.
        """
        fs, path = self.fs(url)

        def call() -> bytes:
            if etag is not None:
                return self._read_if(fs, path, url, start, end, etag)
            data = bytes(fs.cat_file(path, start=start, end=end))
            if len(data) != end - start:
                raise OSError(errno.EIO, f"read {len(data)} bytes of [{start}, {end}) of {url}, expected {end - start}")
            return data

        return self.retry.run(f"read bytes [{start}, {end}) of {url}", call)

    @staticmethod
    def _read_if(fs: Any, path: str, url: str, start: int, end: int, etag: str) -> bytes:
        """One ranged GET of an S3 object on the condition ``If-Match: etag``."""
        bucket, key, _ = fs.split_path(path)

        async def get() -> bytes:
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}",
                                     IfMatch=f'"{etag}"')
            try:
                return bytes(await resp["Body"].read())
            finally:
                resp["Body"].close()

        try:
            data: bytes = fsspec.asyn.sync(fs.loop, get)
        except OSError as e:
            if e.errno == errno.EINVAL and "pre-condition" in str(e):  # s3fs's translation of 412
                raise ContentChanged(f"{url} is no longer the content of etag {etag!r} (the store refused a read "
                                     f"on that condition)") from e
            raise
        if len(data) != end - start:
            raise OSError(errno.EIO, f"read {len(data)} bytes of [{start}, {end}) of {url}, expected {end - start}")
        return data

    def expand(self, source: str) -> tuple[list[tuple[str, Stat]], bool]:
        """The files `source` names, each with its :class:`Stat`, in sorted order: a glob's matches, a
        folder's files (recursively), or the one file; and whether `source` is a folder.

        Raises:
            FileNotFoundError: nothing is there.
        """
        fs, path = self.fs(source)
        protocol = fsspec.core.split_protocol(source)[0]

        def url(p: str) -> str:
            return p if protocol is None else fs.unstrip_protocol(p)

        folder = False
        if any(c in path for c in "*?["):
            found = self.retry.run(f"glob {source}", lambda: fs.glob(path, detail=True))
        else:
            info = self.retry.run(f"stat {source}", lambda: fs.info(path))
            if info["type"] != "directory":
                return [(source, stat_of(info))], False
            found = self.retry.run(f"list {source}", lambda: fs.find(path, detail=True))
            folder = True
        files = sorted((p, i) for p, i in found.items() if i.get("type") != "directory")
        if not files:
            raise FileNotFoundError(f"no shards at {source}")
        return [(url(p), stat_of(i)) for p, i in files], folder
