"""A node's cache of whole shards on local disk: bounded in bytes, least recently used out first, shared safely
by every process of the node (its ranks and their DataLoader workers)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator

from croupier.core.checks import check_int

log = logging.getLogger("croupier.data")

#: How long a fetch waits, at most, for the others' fetches in flight to leave it room (seconds).
ROOM_WAIT_S = 600.0


@contextlib.contextmanager
def _flock(path: str, blocking: bool = True) -> Iterator[bool]:
    """Holds an exclusive flock on the file `path` (created if need be); yields False if `blocking` is False
    and another open file holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class ShardCache:
    """Whole shards in one local folder, at most `max_bytes` of them, the least recently used evicted first.

    A shard is held as ``KEY.data`` (KEY names its content: its URL with its size and etag or mtime, so a
    changed shard is never read from an old copy). Its fetch writes ``KEY.SIZE.PID.TOKEN.part`` and renames it
    to ``KEY.data`` when complete, so a reader never sees half a shard. Invariants, for every process that
    shares the folder:

    - a fetch MUST hold ``KEY.lock`` (an exclusive flock) from before it checks for ``KEY.data`` until the
      rename: two processes asking for one shard fetch it once, the second finds it fetched;
    - room is made under ``.cache.lock``: the ``.data`` files plus the sizes the ``.part`` files announce
      stay within `max_bytes`, the least recently used ``.data`` going first; a ``.part`` whose ``KEY.lock``
      nobody holds is left from a killed process and removed;
    - a read touches its ``.data`` file (its mtime is its last use).

    NOTE: evicting a shard that another process is reading is safe: the reader holds it open, and the file's
    blocks are freed when it closes it. A shard evicted between its fetch and the reader's open is fetched
    again (:meth:`ShardedDataset` opens through :meth:`ensure` in a loop).

    Args:
        root: The folder (created if need be); the same path for every process of the node.
        max_bytes: The bound on the shards held, in bytes.
    """

    def __init__(self, root: str | os.PathLike[str], max_bytes: int) -> None:
        self.root = os.fspath(root)
        self.max_bytes = check_int("cache_bytes", max_bytes, 1)
        os.makedirs(self.root, exist_ok=True)
        self._count_lock = threading.Lock()
        self.fetches = 0
        """Shards this process fetched into the cache (not counting those another process had fetched)."""

    def __getstate__(self) -> dict[str, object]:
        return {"root": self.root, "max_bytes": self.max_bytes}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.root = str(state["root"])
        self.max_bytes = int(state["max_bytes"])  # type: ignore[call-overload]
        self._count_lock = threading.Lock()
        self.fetches = 0

    def path(self, key: str) -> str:
        """Where the shard `key` is held when it is."""
        return os.path.join(self.root, f"{key}.data")

    def ensure(self, key: str, size: int, fetch: Callable[[str], None]) -> str:
        """The local path of shard `key` (`size` bytes), fetched first if the cache does not hold it:
        `fetch(dest)` writes the shard into the file `dest`.

        Raises:
            ValueError: the shard is larger than the cache.
            TimeoutError: the others' fetches in flight left no room for ROOM_WAIT_S seconds.
            Exception: what `fetch` raised (nothing is left in the cache then).
        """
        data = self.path(key)
        if self._touch(data):
            return data
        if size > self.max_bytes:
            raise ValueError(f"a shard of {size} bytes does not fit in a cache of cache_bytes={self.max_bytes}")
        with _flock(os.path.join(self.root, f"{key}.lock")):
            if self._touch(data):
                return data  # fetched by another process while this one waited
            part = self._reserve(key, size)
            try:
                fetch(part)
                os.replace(part, data)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part)
                raise
        with self._count_lock:
            self.fetches += 1
        return data

    def touch(self, key: str) -> bool:
        """Marks shard `key` used now, if the cache holds it; whether it does."""
        return self._touch(self.path(key))

    def holds(self, key: str) -> bool:
        """Whether the cache holds shard `key` now (another process may evict it the next moment)."""
        return os.path.exists(self.path(key))

    def discard(self, key: str) -> None:
        """Drops shard `key` from the cache (a copy found corrupt), if it holds it."""
        with _flock(os.path.join(self.root, f"{key}.lock")), contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(key))

    def held_bytes(self) -> int:
        """The bytes of the shards held now (complete ones: ``.data`` files)."""
        return sum(size for _, size, _ in self._held())

    def _touch(self, data: str) -> bool:
        try:
            os.utime(data)
            return True
        except FileNotFoundError:
            return False

    def _held(self) -> list[tuple[float, int, str]]:
        """(last use, bytes, path) of every ``.data`` file."""
        out = []
        for entry in os.scandir(self.root):
            if entry.name.endswith(".data"):
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat()
                    out.append((st.st_mtime, st.st_size, entry.path))
        return out

    def _in_flight(self, mine: str) -> int:
        """The bytes the ``.part`` files of live fetches announce; those of dead fetches are removed (a ``.part``
        of `mine`, the shard whose lock the caller holds, is one)."""
        total = 0
        for entry in os.scandir(self.root):
            if not entry.name.endswith(".part"):
                continue
            key, size = entry.name.split(".")[:2]
            with _flock(os.path.join(self.root, f"{key}.lock"), blocking=False) as free:
                if free or key == mine:  # nobody fetches it: a process died mid-fetch
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                    log.info("shard cache: removed %s, left by a fetch that died", entry.name)
                    continue
            total += int(size)
        return total

    def _reserve(self, key: str, size: int) -> str:
        """Makes room for `size` bytes (evicting least recently used shards) and announces the fetch: returns
        its ``.part`` file, created empty."""
        deadline = time.monotonic() + ROOM_WAIT_S
        wait = 0.01
        while True:
            with _flock(os.path.join(self.root, ".cache.lock")):
                held = sorted(self._held())  # oldest use first
                used = sum(s for _, s, _ in held) + self._in_flight(key)
                for _, s, p in held:
                    if used + size <= self.max_bytes:
                        break
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p)
                        used -= s
                        log.debug("shard cache: evicted %s (%d bytes)", os.path.basename(p), s)
                if used + size <= self.max_bytes:
                    part = os.path.join(self.root, f"{key}.{size}.{os.getpid()}.{secrets.token_hex(4)}.part")
                    open(part, "xb").close()
                    return part
            if time.monotonic() > deadline:
                raise TimeoutError(f"shard cache {self.root}: no room for {size} bytes in cache_bytes={self.max_bytes} "
                                   f"after {ROOM_WAIT_S:.0f} s (the other fetches in flight hold it)")
            time.sleep(wait)  # the others' fetches in flight hold the room: they end, or die and are removed
            wait = min(wait * 2, 1.0)
