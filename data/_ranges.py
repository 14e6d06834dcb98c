"""Shards in object storage read by ranges: their pieces (a parquet file's row groups) from the shard's index, each
fetched into the node's cache with one ranged read."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from croupier.data._cache import ShardCache
from croupier.data._formats import FORMATS
from croupier.data._index import IndexCache, Pieces
from croupier.data._manifest import Manifest, Shard, ShardChanged
from croupier.data._storage import ContentChanged, Storage

#: Tries at reading a piece the cache fetched, should another process evict it before the read.
READ_TRIES = 3


class Corrupt(Exception):
    """A shard's local copy (or local file, or its metadata) that its format cannot read: not tried again."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class FetchFailed(Exception):
    """A piece of a shard that could not be fetched (the error it got), raised out of a reader's row."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class Ranges:
    """The pieces of a dataset's shards in object storage and their fetches: piece k of shard s is held in the
    node's cache as ``KEY-k`` (KEY: the shard's content key), fetched with one ranged read of its bytes.

    Invariants: every ranged read MUST be of the content the manifest names: made on the condition of the
    shard's etag where the store takes one (S3's ``If-Match``: one request, refused by the store when the
    object changed), else after a check of the shard against its manifest (a stat of the store), once for
    all the pieces a fetch reads; a shard's pieces MUST come from an index built from that content (its key).

    NOTE: no checksum covers a range (a store's etag is the whole object's); parquet pages written with
    checksums are verified when their group is decoded.

    Args:
        manifest: The dataset's shards.
        storage: Their file systems.
        cache: The node's cache.
        index: The node's shard indices.
    """

    def __init__(self, manifest: Manifest, storage: Storage, cache: ShardCache, index: IndexCache) -> None:
        self._manifest, self._storage, self._cache, self._index = manifest, storage, cache, index
        self._pieces: dict[int, Pieces] = {}

    def index(self, s: int) -> dict[str, Any]:
        """The index of shard `s`, naming its pieces: the manifest's (:meth:`Manifest.index`), the node's, or read
        from the shard's metadata (a parquet footer: one ranged read) and kept for the node.

        Raises:
            ShardChanged: the shard is not what the manifest names.
            Corrupt: its metadata cannot be read by its format.
            OSError: the store's error, once the retries are spent.
        """
        shard = self._manifest.shards[s]
        fmt = FORMATS[shard.format]
        carried = self._manifest.index(s)
        if carried is not None and fmt.pieces(carried) is not None:
            return carried  # the manifest's, built from the content it names: no footer read

        def read() -> dict[str, Any]:
            with self._storage.open(shard.path, block_size=2**16, size=shard.bytes) as f:
                try:
                    return fmt.index(f)
                except OSError:
                    raise
                except Exception as e:
                    raise Corrupt(e) from e

        def build() -> dict[str, Any]:
            if self._conditional(shard):
                try:
                    return fmt.index(_Tail(self._storage, shard))  # type: ignore[arg-type]
                except (OSError, ContentChanged):
                    raise
                except Exception as e:
                    raise Corrupt(e) from e
            shard.check(self._storage.stat(shard.path))
            return self._storage.retry.run(f"read the index of {shard.path}", read)

        try:
            return self._index.get_or_build(shard.key, build, lambda got: fmt.pieces(got) is not None)
        except ContentChanged as e:
            raise self._changed(shard, e) from e

    def pieces(self, s: int, index: dict[str, Any] | None = None) -> Pieces:
        """The pieces of shard `s`, from `index` or the shard's index (:meth:`index`)."""
        got = self._pieces.get(s)
        if got is None:
            got = FORMATS[self._manifest.shards[s].format].pieces(index or self.index(s))
            if got is None:  # an index built by this release names them
                raise AssertionError(f"the index of shard {s} names no pieces")
            self._pieces[s] = got
        return got

    def key(self, s: int, k: int) -> str:
        """The cache's name for piece `k` of shard `s`."""
        return f"{self._manifest.shards[s].key}-{k}"

    def wanted(self, s: int, rows: np.ndarray | None) -> list[int]:
        """The pieces of shard `s` that `rows` (None: every row) lie in, ascending."""
        pieces = self.pieces(s)
        if rows is None:
            return list(range(len(pieces.ranges)))
        got: list[int] = np.unique(np.searchsorted(np.asarray(pieces.starts), rows, side="right") - 1).tolist()
        return got

    def held(self, s: int, ks: Iterable[int]) -> bool:
        """Whether the cache holds every piece `ks` of shard `s` now."""
        return all(self._cache.holds(self.key(s, k)) for k in ks)

    def ready(self, s: int, rows: np.ndarray) -> bool:
        """Whether the pieces of shard `s` that `rows` lie in are known and held (False while its index is not
        read in this process)."""
        return s in self._pieces and self.held(s, self.wanted(s, rows))

    def ensure(self, s: int, ks: Iterable[int]) -> None:
        """Fetches the pieces `ks` of shard `s` the cache does not hold (touching those it holds: they are used
        next), one ranged read each; the shard is checked once, before the first read.

        NOTE: one read a piece, under that piece's lock: a read of several adjacent pieces would fetch again
        those that another process of the node is fetching at the same time.

        Raises:
            ShardChanged: the shard changed.
            Exception: the fetch's error (OSError once the retries are spent).
        """
        shard = self._manifest.shards[s]
        ranges = self.pieces(s).ranges
        checked = False

        def fetch(dest: str, k: int) -> None:
            nonlocal checked
            if self._conditional(shard):
                data = self._storage.read_range(shard.path, *ranges[k], etag=shard.etag)
            else:
                if not checked:
                    shard.check(self._storage.stat(shard.path))
                    checked = True
                data = self._storage.read_range(shard.path, *ranges[k])
            with open(dest, "wb") as out:
                out.write(data)

        try:
            for k in sorted(set(ks)):
                if not self._cache.touch(self.key(s, k)):
                    self._cache.ensure(self.key(s, k), ranges[k][1] - ranges[k][0], functools.partial(fetch, k=k))
        except ContentChanged as e:
            raise self._changed(shard, e) from e

    def _conditional(self, shard: Shard) -> bool:
        """Whether the reads of `shard` are made on the condition of its etag (the store takes one, it has one)."""
        return shard.etag is not None and self._storage.conditional(shard.path)

    def _changed(self, shard: Shard, e: ContentChanged) -> ShardChanged:
        """The error of a conditional read the store refused: what the store says of the shard now, beside what the
        manifest recorded."""
        try:
            shard.check(self._storage.stat(shard.path))
        except ShardChanged as changed:
            return changed
        return ShardChanged(f"shard {shard.path} changed since the manifest recorded it: {e}; rebuild the manifest "
                            f"(Manifest.build) to read the shard as it is")

    def read(self, s: int, k: int) -> bytes:
        """Piece `k` of shard `s`, from the cache (fetched if need be).

        Raises:
            ShardChanged: the shard changed.
            FetchFailed: the fetch failed (its error inside).
        """
        for tried in range(1, READ_TRIES + 1):
            try:
                self.ensure(s, [k])
            except ShardChanged:
                raise
            except Exception as e:
                raise FetchFailed(e) from e
            try:
                with open(self._cache.path(self.key(s, k)), "rb") as f:
                    return f.read()
            except FileNotFoundError as e:  # evicted between its fetch and this read
                if tried == READ_TRIES:  # again and again: the cache is too small for the readers
                    raise FetchFailed(e) from e
        raise AssertionError("unreachable")

    def discard(self, s: int) -> None:
        """Drops the copies of shard `s`'s pieces from the cache (one found corrupt)."""
        for k in range(len(self._pieces[s].ranges) if s in self._pieces else 0):
            self._cache.discard(self.key(s, k))


class _Tail:
    """A shard in object storage as a read-only file whose every read is one ranged read on the condition of its
    etag: what a format reads its index through (parquet: the footer, one read of the file's end)."""

    def __init__(self, storage: Storage, shard: Shard) -> None:
        self._storage, self._shard, self._pos = storage, shard, 0

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = 0 if whence == os.SEEK_SET else self._pos if whence == os.SEEK_CUR else self._shard.bytes
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self._shard.bytes if n is None or n < 0 else min(self._shard.bytes, self._pos + n)
        if end <= self._pos:
            return b""
        data: bytes = self._storage.read_range(self._shard.path, self._pos, end, etag=self._shard.etag)
        self._pos = end
        return data
