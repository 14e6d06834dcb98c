"""Shard indices (a tar's members, a parquet file's row groups) cached on local disk, keyed by the shard's content."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import fcntl
import json
import os
import secrets
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Pieces:
    """The parts of a shard that are read apart (a parquet file's row groups): their rows and byte ranges.

    Attributes:
        starts: The first row of each piece, and the shard's rows last (``pieces + 1`` values, ascending).
        ranges: Each piece's bytes in the shard's file, ``(start, end)`` (end exclusive).
    """

    starts: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]

    def of(self, row: int) -> int:
        """The piece holding `row`."""
        return bisect.bisect_right(self.starts, row) - 1


class IndexCache:
    """JSON files ``ROOT/index/KEY.json``, one per shard content: built once, read by every process after.

    A file is written whole under a temporary name and renamed, so a reader never sees half of one; two
    processes that build the same index write the same file.

    Args:
        root: The cache folder, or None: nothing is kept.
    """

    def __init__(self, root: str | os.PathLike[str] | None) -> None:
        self.dir = None if root is None else os.path.join(os.fspath(root), "index")

    def get(self, key: str) -> dict[str, Any] | None:
        """The index of shard content `key`, if one was kept (an unreadable one counts as none)."""
        if self.dir is None:
            return None
        try:
            with open(os.path.join(self.dir, f"{key}.json")) as f:
                doc = json.load(f)
        except (FileNotFoundError, ValueError):
            return None
        return doc if isinstance(doc, dict) and "samples" in doc else None

    def get_or_build(self, key: str, build: Callable[[], dict[str, Any]],
                     complete: Callable[[dict[str, Any]], bool] = lambda _: True) -> dict[str, Any]:
        """The index of shard content `key`: the one kept if it is `complete`, else `build()` kept.

        The processes of a node that ask for one index at once build it once: the builder holds
        ``KEY.lock`` (an exclusive flock), and the others find its index when they get the lock.
        """
        got = self.get(key)
        if got is not None and complete(got):
            return got
        if self.dir is None:
            return build()
        os.makedirs(self.dir, exist_ok=True)
        fd = os.open(os.path.join(self.dir, f"{key}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            got = self.get(key)
            if got is None or not complete(got):
                got = build()
                self.put(key, got)
            return got
        finally:
            os.close(fd)  # lets go of the lock

    def put(self, key: str, index: dict[str, Any]) -> None:
        """Keeps the index of shard content `key`."""
        if self.dir is None:
            return
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, f"{key}.json")
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(index, f, separators=(",", ":"))
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
