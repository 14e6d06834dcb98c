"""Shard indices (a tar's members, a parquet file's row groups) cached on local disk, keyed by the shard's content."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from typing import Any


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
