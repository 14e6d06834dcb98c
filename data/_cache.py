"""A node's cache of whole shards on local disk: bounded in bytes, evicting in the order an eviction policy gives
(the plan's, or least recently used), shared safely by every process of the node (its ranks and their DataLoader
workers)."""

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
from croupier.data._board import Eviction, LeastRecentlyUsed

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
    """Whole shards in one local folder, at most `max_bytes` of them, evicted in the order `eviction` gives.

    A shard is held as ``KEY.data`` (KEY names its content: its URL with its size and etag or mtime, so a
    changed shard is never read from an old copy). Its fetch writes ``KEY.SIZE.PID.TOKEN.part`` and renames it
    to ``KEY.data`` when complete, so a reader never sees half a shard. Invariants, for every process that
    shares the folder:

    - a fetch MUST hold ``KEY.lock`` (an exclusive flock) from before it checks for ``KEY.data`` until the
      rename: two processes asking for one shard fetch it once, the second finds it fetched;
    - room is made under ``.cache.lock``: the ``.data`` files plus the sizes the ``.part`` files announce
      stay within `max_bytes`, the ``.data`` files going in `eviction`'s order;
    - ``.cache.bytes`` (written under ``.cache.lock``) MUST never be below those bytes: a fetch adds its size
      before it creates its ``.part``, an entry's bytes are taken off after it is removed; a fetch that finds
      room below the bound there reserves it without a look at the folder, and otherwise the folder is
      counted (its count written back), and evicted from, as above; a ``.part`` whose ``KEY.lock``
      nobody holds is left from a killed process and removed;
    - a read touches its ``.data`` file (its mtime is its last use).

    NOTE: the count in ``.cache.bytes`` is an upper bound, not the truth (a process killed between a change
    and its count, or a file removed by hand, leaves it high): a count too high costs a look at the folder,
    which sets it right, never the bound. Without it, every fetch of every process of the node would list
    and stat the whole folder under the one lock (a resumed node's first batch: a hundred fetches at once).

    NOTE: evicting a shard that another process is reading is safe: the reader holds it open, and the file's
    blocks are freed when it closes it. A shard evicted between its fetch and the reader's open is fetched
    again (:meth:`ShardedDataset` opens through :meth:`ensure` in a loop).

    Args:
        root: The folder (created if need be); the same path for every process of the node.
        max_bytes: The bound on the shards held, in bytes.
        eviction: What goes first when room is needed (default: the least recently used).
    """

    def __init__(self, root: str | os.PathLike[str], max_bytes: int, eviction: Eviction | None = None) -> None:
        self.root = os.fspath(root)
        self.max_bytes = check_int("cache_bytes", max_bytes, 1)
        self.eviction: Eviction = eviction or LeastRecentlyUsed()
        os.makedirs(self.root, exist_ok=True)
        self._count_lock = threading.Lock()
        self.fetches = 0
        """Shards this process fetched into the cache (not counting those another process had fetched)."""

    def __getstate__(self) -> dict[str, object]:
        return {"root": self.root, "max_bytes": self.max_bytes, "eviction": self.eviction}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.root = str(state["root"])
        self.max_bytes = int(state["max_bytes"])  # type: ignore[call-overload]
        self.eviction = state["eviction"]  # type: ignore[assignment]
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
                self._count(-size)
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
            size = os.stat(self.path(key)).st_size
            os.unlink(self.path(key))
            self._count(-size)

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
        """Makes room for `size` bytes (evicting in `eviction`'s order) and announces the fetch: returns
        its ``.part`` file, created empty."""
        deadline = time.monotonic() + ROOM_WAIT_S
        wait = 0.01
        while True:
            with _flock(os.path.join(self.root, ".cache.lock")):
                counted = self._counted()
                if counted is not None and counted + size <= self.max_bytes:  # room: no look at the folder
                    return self._announce(key, size, counted)
                held = self.eviction.order(self._held())  # the first to go first
                used = sum(s for _, s, _ in held) + self._in_flight(key)
                for _, s, p in held:
                    if used + size <= self.max_bytes:
                        break
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p)
                        used -= s
                        log.debug("shard cache: evicted %s (%d bytes)", os.path.basename(p), s)
                if used + size <= self.max_bytes:
                    return self._announce(key, size, used)
                self._write_count(used)
            if time.monotonic() > deadline:
                raise TimeoutError(f"shard cache {self.root}: no room for {size} bytes in cache_bytes={self.max_bytes} "
                                   f"after {ROOM_WAIT_S:.0f} s (the other fetches in flight hold it)")
            time.sleep(wait)  # the others' fetches in flight hold the room: they end, or die and are removed
            wait = min(wait * 2, 1.0)

    def _announce(self, key: str, size: int, used: int) -> str:
        """Counts `size` more bytes than `used` and creates the fetch's ``.part`` (under ``.cache.lock``)."""
        self._write_count(used + size)
        part = os.path.join(self.root, f"{key}.{size}.{os.getpid()}.{secrets.token_hex(4)}.part")
        open(part, "xb").close()
        return part

    def _counted(self) -> int | None:
        """The count in ``.cache.bytes`` (under ``.cache.lock``), or None if there is none to trust."""
        try:
            with open(os.path.join(self.root, ".cache.bytes")) as f:
                return int(f.read())
        except (FileNotFoundError, ValueError):
            return None

    def _write_count(self, used: int) -> None:
        """Writes `used` to ``.cache.bytes`` (under ``.cache.lock``)."""
        tmp = os.path.join(self.root, f".cache.bytes.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            f.write(str(used))
        os.replace(tmp, os.path.join(self.root, ".cache.bytes"))

    def _count(self, change: int) -> None:
        """Takes `change` bytes (negative: bytes removed) into ``.cache.bytes``, under ``.cache.lock``."""
        with _flock(os.path.join(self.root, ".cache.lock")):
            counted = self._counted()
            if counted is not None:
                self._write_count(max(0, counted + change))
