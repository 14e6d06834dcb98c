"""The reader group's demand board: what the plan has announced of each shard and what the node has read, shared
by every process of the node in one small file, and the cache's eviction orders that read it."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

import numpy as np

from croupier.core.checks import check_int
from croupier.core.cursor import Cursor
from croupier.core.shards import consumed_rows, has_own_shard_order
from croupier.core.spec import Spec

#: The board's header: its format, the clock (indices announced by every process so far), the resume point it was
#: seeded at (0: none; see DemandBoard.seed), a spare field.
_HEADER = 4
_VERSION = 1
_CLOCK, _SEEDED = 1, 2
#: Per shard: rows announced and not yet read, the clock when the first of them was announced, rows read
#: in this pass over the shard, and a spare field.
_PENDING, _NEED, _READ = 0, 1, 2
_FIELDS = 4


class Eviction(Protocol):
    """How a :class:`croupier.data.ShardCache` picks what to evict: `order` MUST return the entries it is given
    (each once), the first to evict first. It is asked under the cache's lock, so it MUST NOT take that lock."""

    name: str

    def order(self, held: list[tuple[float, int, str]]) -> list[tuple[float, int, str]]:
        """`held` ((last use, bytes, path) of each entry) in the order to evict them."""
        ...


class LeastRecentlyUsed:
    """Evicts the entry used longest ago first (a read touches its entry)."""

    name = "lru"

    def order(self, held: list[tuple[float, int, str]]) -> list[tuple[float, int, str]]:
        return sorted(held)


class DemandBoard:
    """The demand of one dataset's shards, as the node's processes announce and read them.

    A rank's sampler announces each lease of indices (:meth:`announce`, from ``ShardedDataset.read_ahead``)
    before its loop reads them; every process that reads rows records them (:meth:`consumed`). For each
    shard the board keeps the rows announced and not yet read (pending), the clock when the first of those
    was announced (its next need: the clock counts the indices every process announced before), and the
    rows read in this pass over the shard (a shard whose every row was read is done: the plan reads each
    row of an epoch once, so it needs the shard no more this epoch; a new announcement after that starts
    the next pass).

    The board is the file ``ROOT/KEY.board`` (KEY: the dataset's manifest), int64 fields mapped by every
    process. Invariants:

    - an update MUST hold ``KEY.lock`` (an exclusive flock taken through a file descriptor of the process's
      own, and a lock of the process's threads): the counts are exact however many processes update;
    - the first process to open a board that no live process holds (``KEY.live``, which every process that
      opened the board holds shared until it exits) starts it at zero: a board left by a killed run does
      not steer the next one;
    - a resume point is seeded once (:meth:`seed`): the first process to seed it sets every shard's rows read
      to what the epoch consumed before it; the node's other processes, seeding the same point, change
      nothing, so the reads counted since stay.

    NOTE: readers of the board (eviction) take no lock: a stale value only makes a worse choice of what to
    evict, never a wrong read. The board counts shards, not row groups: a shard order reads a window's
    shards together, every row group of them throughout the window.

    Args:
        root: The folder (created if need be); the same for every process of the node.
        key: The dataset's name among the boards (its manifest's fingerprint).
        samples: Each shard's rows.
    """

    def __init__(self, root: str | os.PathLike[str], key: str, samples: tuple[int, ...]) -> None:
        self.root, self.key, self.samples = os.fspath(root), key, samples
        self._open()

    def __getstate__(self) -> dict[str, object]:
        return {"root": self.root, "key": self.key, "samples": self.samples}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["root"], state["key"], state["samples"])  # type: ignore[misc]

    def _open(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        base = os.path.join(self.root, self.key)
        self._live = os.open(f"{base}.live", os.O_RDWR | os.O_CREAT, 0o644)  # held shared until the process exits
        try:
            fcntl.flock(self._live, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fresh = True  # no live process holds the board: this one starts it
        except BlockingIOError:
            fresh = False
            fcntl.flock(self._live, fcntl.LOCK_SH)  # waits while a process starts the board
        self._pid = os.getpid()
        self._lock_fd = os.open(f"{base}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        self._threads = threading.Lock()
        size = (_HEADER + _FIELDS * len(self.samples)) * 8
        path = f"{base}.board"
        with self._locked():
            if not os.path.exists(path) or os.path.getsize(path) != size:
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "wb") as f:
                    f.truncate(size)
                os.replace(tmp, path)
            mm = np.memmap(path, dtype="<i8", mode="r+", shape=(size // 8,))
            if fresh:
                mm[:] = 0
            mm[0] = _VERSION
        if fresh:
            fcntl.flock(self._live, fcntl.LOCK_SH)
        self._head = mm[:_HEADER]
        self._shards = mm[_HEADER:].reshape(len(self.samples), _FIELDS)  # (S, fields)
        self._sizes = np.asarray(self.samples, dtype=np.int64)  # (S,)
        self._closer = weakref.finalize(self, _close_fds, [self._live, self._lock_fd])

    def close(self) -> None:
        """Lets go of the board (this process no longer holds it live)."""
        self._closer()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if self._pid != os.getpid():
            # a forked process (a DataLoader worker): locks of its own. A descriptor shared with the parent
            # would not exclude it, and the parent's thread lock may have been held by a thread not here.
            self._threads = threading.Lock()
            self._lock_fd = os.open(os.path.join(self.root, f"{self.key}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
            self._pid = os.getpid()
        with self._threads:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield None
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def seed(self, point: int, read: Callable[[], np.ndarray]) -> bool:
        """Starts the board at the resume point `point` (an int in [1, 2**63) naming it), unless it was seeded there
        already: each shard's rows read become ``read()`` (the rows of the point's epoch consumed before it, in
        the dataset's shard order), nothing is announced. ``read`` is called only when the board is seeded, under
        the board's lock (the node's other processes wait, then find it seeded).

        Returns:
            Whether this call seeded the board (False: a process had seeded it at `point` before).

        Raises:
            TypeError: `point` is not an int.
            ValueError: `point` is out of its range, or ``read()`` is not one count in [0, rows] a shard (the
                board is left as it was).
        """
        point = check_int("resume point", point, 1, 2**63)
        with self._locked():
            if int(self._head[_SEEDED]) == point:
                return False
            got = np.asarray(read())
            if got.shape != self._sizes.shape or not np.issubdtype(got.dtype, np.integer):
                raise ValueError(f"seed: rows read must be {self._sizes.size} ints, one a shard (got dtype={got.dtype}, "
                                 f"shape={got.shape})")
            bad = np.flatnonzero((got < 0) | (got > self._sizes))
            if bad.size:
                s = int(bad[0])
                raise ValueError(f"seed: shard {s} holds {int(self._sizes[s])} rows, so its rows read must be in "
                                 f"[0, {int(self._sizes[s])}] (got {int(got[s])}; {bad.size} shards out of range)")
            self._shards[:, _PENDING] = 0
            self._shards[:, _NEED] = 0
            self._shards[:, _READ] = got
            self._head[_SEEDED] = point
            return True

    def announce(self, shards: np.ndarray, rows: np.ndarray, at: np.ndarray, total: int) -> None:
        """Records a lease of `total` indices: `rows[i]` of them in shard `shards[i]`, the first at place `at[i]`
        of the lease."""
        with self._locked():
            clock = int(self._head[_CLOCK])
            t = self._shards
            idle = t[shards, _PENDING] == 0  # (len,)
            t[shards[idle], _NEED] = clock + at[idle]
            done = idle & (t[shards, _READ] >= self._sizes[shards])
            t[shards[done], _READ] = 0  # the shard's next pass
            t[shards, _PENDING] += rows
            self._head[_CLOCK] = clock + total

    def consumed(self, shards: np.ndarray, rows: np.ndarray) -> None:
        """Records `rows[i]` rows of shard `shards[i]` read (each shard once in `shards`)."""
        with self._locked():
            t = self._shards
            t[shards, _PENDING] = np.maximum(0, t[shards, _PENDING] - rows)
            t[shards[t[shards, _PENDING] == 0], _NEED] = 0  # no announced need left
            t[shards, _READ] += rows

    def view(self) -> np.ndarray:
        """A copy of (pending, need, read) of every shard; (S, 3)."""
        out: np.ndarray = np.array(self._shards[:, :3])
        return out

    def clock(self) -> int:
        """Indices announced by every process so far."""
        return int(self._head[_CLOCK])


def seed_at(board: DemandBoard, spec: Spec, cursor: Cursor) -> bool:
    """Seeds `board` at the resume point `cursor` of a shard order (:meth:`DemandBoard.seed`): each shard's rows
    read are those the cursor's epoch consumed (:func:`croupier.core.shards.consumed_rows`: whole windows before
    the cursor count whole, the windows it cuts are counted position by position).

    NOTE: the rows counted are what the epoch consumed, whoever read them: a shard whose last rows the node reads
    after the resume is finished then, even if another node (of the generation before) read its first rows. A
    spec that is not a shard order of one dataset (another permutation; a mixture, whose positions are the
    mixture's) is not seeded: its board counts reads from zero.

    Returns:
        Whether this call seeded the board.
    """
    if not has_own_shard_order(spec):
        return False
    text = f"{spec.fingerprint}/{cursor.epoch}/{cursor.remaining}".encode()
    point = int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1 or 1  # names the point: [1, 2**63)
    return board.seed(point, lambda: consumed_rows(spec, cursor))


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class PlanDriven:
    """Evicts first the entries of shards that the plan needs no more this epoch (every row read by the reader
    group), then those no announced lease needs (least recently used first: needed beyond what the sampler
    announced, if at all), then those needed, furthest in the future first.

    An entry the board does not know (another dataset's in a shared cache) counts among the second.

    Args:
        board: The dataset's demand board.
        shard_of_key: The shard each cache key of the dataset names (a piece's key is ``KEY-k``).
    """

    name = "plan"

    def __init__(self, board: DemandBoard, shard_of_key: Mapping[str, int]) -> None:
        self.board = board
        self.shard_of_key = dict(shard_of_key)

    def order(self, held: list[tuple[float, int, str]]) -> list[tuple[float, int, str]]:
        if not held:
            return []
        state = self.board.view()  # (S, 3)
        sizes = self.board._sizes

        def rank(entry: tuple[float, int, str]) -> tuple[int, float]:
            name = os.path.basename(entry[2]).removesuffix(".data")
            s = self.shard_of_key.get(name.split("-", 1)[0])
            if s is None:
                return 1, entry[0]
            pending, need, read = (int(x) for x in state[s])
            if pending > 0:
                return 2, -float(need)
            return (0 if read >= sizes[s] else 1), entry[0]

        return sorted(held, key=rank)

