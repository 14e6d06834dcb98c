"""The coordinator's durable storage: a journal of opaque event records plus the latest snapshot."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sqlite3
import struct
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = [
    "SCHEMA_VERSION",
    "SCHEMES",
    "MemoryStore",
    "Recovered",
    "SqliteStore",
    "Store",
    "StoreCorrupt",
    "StoreError",
    "StoreUnavailable",
    "StoreVersionError",
    "open_store",
    "parse_url",
]

#: URL schemes :func:`open_store` accepts.
SCHEMES = ("memory://", "sqlite:///")

#: The on-disk layout this module writes; a file with a newer version is refused.
SCHEMA_VERSION = 1

#: Seconds a SQLite call waits for a lock held by another connection before it fails.
_BUSY_TIMEOUT_S = 1.0


class StoreError(Exception):
    """Base of every error a store raises."""


class StoreCorrupt(StoreError):
    """The store's contents could not be verified (not a database, bad checksum, a gap, ...).

    The message names the file and what is wrong. A coordinator MUST NOT serve from a store
    that raised this.
    """


class StoreUnavailable(StoreError):
    """The store cannot make a change durable, or cannot be reached; nothing was acknowledged.

    Once a sqlite store raised this from ``append`` or ``write_snapshot``, every later write
    raises it too (see :class:`SqliteStore`).
    """


class StoreVersionError(StoreError):
    """The store was written by a newer croupier whose layout this one does not know."""


@dataclasses.dataclass(frozen=True)
class Recovered:
    """What a store holds: the latest snapshot and every journal record after it.

    Attributes:
        snapshot: The latest snapshot's payload, or ``None`` if none was written.
        snapshot_seq: The sequence number the snapshot covers (0 if there is none).
        records: ``(seq, payload)`` of every record with ``seq > snapshot_seq``, in order;
            the sequence numbers are ``snapshot_seq + 1, snapshot_seq + 2, ...`` without a gap.
    """

    snapshot: bytes | None
    snapshot_seq: int
    records: list[tuple[int, bytes]]

    @property
    def last_seq(self) -> int:
        """The sequence number of the last record the store holds (``snapshot_seq`` if none)."""
        return self.records[-1][0] if self.records else self.snapshot_seq


@runtime_checkable
class Store(Protocol):
    """A journal of opaque records with contiguous sequence numbers, plus the latest snapshot.

    Invariants every backend MUST keep:

    - Sequence numbers start at 1 and are contiguous: the n-th record ever appended has seq n,
      whatever the number of threads appending.
    - ``append`` MUST NOT return before its records are durable (for a file, fsync'd); when it
      raises, the caller MUST treat the records as not acknowledged.
    - ``append`` and ``write_snapshot`` MUST be safe to call from many threads at once.
    - ``load`` MUST return exactly what was acknowledged (or more: records whose ``append`` was
      cut short by a crash after they became durable), verified, or raise
      :class:`StoreCorrupt`; it MUST NOT return a state it could not verify.
    - A snapshot at ``seq`` stands for every record with sequence number <= ``seq``; those
      records MAY be pruned once it is durable.

    Attributes:
        url: The URL the store was opened with.
    """

    url: str

    def append(self, records: Sequence[bytes]) -> int:
        """Durably appends records to the journal.

        Args:
            records: One or more opaque payloads, in the order they get sequence numbers.

        Returns:
            The sequence number of the last of ``records``.

        Raises:
            ValueError: If ``records`` is empty.
            TypeError: If a record is not bytes-like.
            StoreUnavailable: If the records could not be made durable, or the store is closed.
        """
        ...

    def write_snapshot(self, seq: int, payload: bytes) -> None:
        """Durably stores a snapshot of the whole state as of journal record ``seq``.

        Args:
            seq: The last record the snapshot covers; MUST be acknowledged already and no
                smaller than the current snapshot's.
            payload: The opaque snapshot.

        Raises:
            ValueError: If ``seq`` is beyond the journal or before the current snapshot.
            TypeError: If ``seq`` is not an int or ``payload`` is not bytes-like.
            StoreUnavailable: If the snapshot could not be made durable, or the store is closed.
        """
        ...

    def load(self) -> Recovered:
        """Reads back the latest snapshot and every record after it, verified.

        Returns:
            The store's contents; ``Recovered(None, 0, [])`` for an empty store.

        Raises:
            StoreCorrupt: If anything could not be verified.
            StoreUnavailable: If the store could not be read, or is closed.
        """
        ...

    def close(self) -> None:
        """Finishes the writes in flight and releases the store; later calls raise, close is idempotent."""
        ...


def _as_bytes(value: object, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{what} must be bytes (got {type(value).__name__})")


def _check_records(records: Sequence[bytes]) -> list[bytes]:
    if isinstance(records, (bytes, bytearray, memoryview, str)):
        raise TypeError(
            f"records must be a sequence of bytes, not a single {type(records).__name__}; "
            "wrap one record in a list"
        )
    out = [_as_bytes(r, f"records[{i}]") for i, r in enumerate(records)]
    if not out:
        raise ValueError("records must hold at least one record (got an empty sequence)")
    return out


def _check_seq(seq: object) -> int:
    if isinstance(seq, bool) or not isinstance(seq, int):
        raise TypeError(f"seq must be an int (got {type(seq).__name__})")
    return seq


def _check_snapshot_seq(seq: int, snapshot_seq: int, last_seq: int) -> None:
    if seq > last_seq:
        raise ValueError(f"snapshot seq must be <= the last acknowledged record {last_seq} (got {seq=})")
    if seq < snapshot_seq:
        raise ValueError(f"snapshot seq must be >= the current snapshot's {snapshot_seq} (got {seq=})")


class MemoryStore:
    """An in-process store (``memory://``): the same semantics as the others, durable for the process's life.

    Attributes:
        url: The URL the store was opened with.
    """

    def __init__(self, url: str = "memory://") -> None:
        """Creates an empty store.

        Args:
            url: The URL to report as :attr:`url`.
        """
        self.url = url
        self._lock = threading.Lock()
        self._records: list[tuple[int, bytes]] = []
        self._snapshot: bytes | None = None
        self._snapshot_seq = 0
        self._last_seq = 0
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable(f"store {self.url} is closed")

    def append(self, records: Sequence[bytes]) -> int:
        """See :meth:`Store.append`."""
        payloads = _check_records(records)
        with self._lock:
            self._check_open()
            first = self._last_seq + 1
            self._records.extend(zip(range(first, first + len(payloads)), payloads, strict=True))
            self._last_seq += len(payloads)
            return self._last_seq

    def write_snapshot(self, seq: int, payload: bytes) -> None:
        """See :meth:`Store.write_snapshot`. Keeps the latest snapshot only and prunes the records it covers."""
        seq = _check_seq(seq)
        data = _as_bytes(payload, "payload")
        with self._lock:
            self._check_open()
            _check_snapshot_seq(seq, self._snapshot_seq, self._last_seq)
            self._snapshot, self._snapshot_seq = data, seq
            self._records = [(s, p) for s, p in self._records if s > seq]

    def load(self) -> Recovered:
        """See :meth:`Store.load`."""
        with self._lock:
            self._check_open()
            return Recovered(self._snapshot, self._snapshot_seq, list(self._records))

    def close(self) -> None:
        """See :meth:`Store.close`."""
        with self._lock:
            self._closed = True


def _crc(seq: int, payload: bytes) -> int:
    # The sequence number is part of the checksum, so a record moved to another seq fails too.
    return zlib.crc32(payload, zlib.crc32(struct.pack("<q", seq)))


class _Pending:
    """One caller's records waiting for a group commit."""

    __slots__ = ("error", "last_seq", "payloads")

    def __init__(self, payloads: list[bytes]) -> None:
        self.payloads = payloads
        self.last_seq = 0
        self.error: StoreError | None = None

    @property
    def done(self) -> bool:
        return self.last_seq > 0 or self.error is not None


_SCHEMA = (
    "CREATE TABLE croupier_schema (version INTEGER NOT NULL)",
    "CREATE TABLE journal (seq INTEGER PRIMARY KEY, crc INTEGER NOT NULL, payload BLOB NOT NULL)",
    "CREATE TABLE snapshot (seq INTEGER PRIMARY KEY, crc INTEGER NOT NULL, payload BLOB NOT NULL)",
)
_TABLES = frozenset({"croupier_schema", "journal", "snapshot"})


def _sqlite_reason(exc: BaseException) -> str:
    name = getattr(exc, "sqlite_errorname", None)
    return f"{exc} ({name})" if name else str(exc)


def _fsync_dir(path: Path) -> None:
    """Makes a new directory entry in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class SqliteStore:
    """A store in one SQLite file (``sqlite:///path``): WAL mode, ``synchronous=FULL``, group commit.

    Each record and the snapshot carry a CRC32 of (seq, payload). Opening the file runs
    ``PRAGMA quick_check`` and verifies every checksum and that the records after the snapshot
    are contiguous; :meth:`load` verifies again.

    NOTE: Group commit. A thread that calls :meth:`append` while another thread is committing
    queues its records and waits. When the commit in flight is durable, one waiting thread
    becomes the leader and commits everything queued, in one transaction with one fsync; every
    caller in that group is released when it is durable. So N concurrent callers cost about
    two fsyncs of latency each, not N.

    NOTE: A failed commit poisons the store: every later write raises :class:`StoreUnavailable`.
    After a failed fsync the OS may have dropped the dirty pages, so going on could acknowledge
    records that sit after lost ones; the caller reopens the store (which verifies it) instead.

    NOTE: The connection holds SQLite's exclusive lock for its whole life, so a second
    coordinator on the same file fails at open (:class:`StoreUnavailable`) instead of
    interleaving sequence numbers. The OS drops the lock when the process dies, kill -9 too.

    Attributes:
        url: The URL the store was opened with.
        path: The database file, absolute.
        commits: The number of journal transactions :meth:`append` has committed.
    """

    def __init__(self, url: str, path: str | os.PathLike[str]) -> None:
        """Opens (creating if needed) and verifies the store at ``path``.

        Args:
            url: The URL to report as :attr:`url`.
            path: The database file; missing parent directories are created.

        Raises:
            StoreCorrupt: If the file is not a database, fails its integrity check, holds a
                record whose checksum does not match, or has a gap in its sequence numbers.
            StoreVersionError: If the file was written with a newer schema.
            StoreUnavailable: If the file cannot be created, opened or locked.
        """
        self.url = url
        self.path = Path(path).absolute()
        self.commits = 0
        self._cond = threading.Condition(threading.Lock())
        self._queue: list[_Pending] = []
        self._leading = False
        self._closed = False
        self._failure: StoreUnavailable | None = None
        # The connection is used by one thread at a time: whoever holds _db.
        self._db = threading.Lock()
        self._snapshot_seq = 0
        self._last_seq = 0

        created_dirs = self._make_parents()
        is_new = not self.path.exists() or self.path.stat().st_size == 0
        try:
            self._conn = sqlite3.connect(
                self.path, timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise self._unavailable("cannot open", exc) from exc
        try:
            self._configure()
            self._init_schema()
            recovered = self._read()
        except BaseException:
            self._conn.close()
            raise
        self._snapshot_seq = recovered.snapshot_seq
        self._last_seq = recovered.last_seq
        if is_new:
            _fsync_dir(self.path.parent)
            for d in created_dirs:
                _fsync_dir(d.parent)

    # -- errors -------------------------------------------------------------------------------

    def _unavailable(self, doing: str, exc: BaseException) -> StoreUnavailable:
        hint = ""
        if "locked" in str(exc) or getattr(exc, "sqlite_errorname", "") == "SQLITE_BUSY":
            hint = " (another connection holds its lock: is a second coordinator using the same store?)"
        return StoreUnavailable(f"sqlite store {self.path}: {doing}: {_sqlite_reason(exc)}{hint}")

    def _corrupt(self, what: str) -> StoreCorrupt:
        return StoreCorrupt(f"sqlite store {self.path} is corrupt: {what}")

    def _translate(self, doing: str, exc: Exception) -> StoreError:
        """Maps a sqlite3 error met while reading to the store error it means."""
        if isinstance(exc, sqlite3.OperationalError):
            return self._unavailable(doing, exc)
        return self._corrupt(f"{doing}: {_sqlite_reason(exc)}")

    # -- opening ------------------------------------------------------------------------------

    def _make_parents(self) -> list[Path]:
        missing = [p for p in reversed(self.path.parents) if not p.exists()]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(
                f"sqlite store {self.path}: cannot create its directory {self.path.parent}: {exc}"
            ) from exc
        return missing

    def _configure(self) -> None:
        try:
            # EXCLUSIVE before WAL: the WAL index then lives in heap memory, not a -shm file.
            self._conn.execute("PRAGMA locking_mode=EXCLUSIVE")
            (mode,) = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute("PRAGMA fullfsync=ON")  # macOS: F_FULLFSYNC; ignored elsewhere
        except sqlite3.Error as exc:
            raise self._translate("cannot open", exc) from exc
        if str(mode).lower() != "wal":
            raise StoreUnavailable(
                f"sqlite store {self.path}: cannot switch to WAL mode (journal_mode is {mode!r}); "
                "is the file on a filesystem that does not support it?"
            )

    def _init_schema(self) -> None:
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")  # takes (and, in EXCLUSIVE mode, keeps) the write lock
            try:
                tables = {
                    name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                }
                if not tables:
                    for ddl in _SCHEMA:
                        conn.execute(ddl)
                    conn.execute("INSERT INTO croupier_schema (version) VALUES (?)", (SCHEMA_VERSION,))
                    conn.execute("COMMIT")
                    return
                conn.execute("ROLLBACK")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            (check, *rest) = [row[0] for row in conn.execute("PRAGMA quick_check")]
        except sqlite3.Error as exc:
            raise self._translate("cannot read", exc) from exc
        if check != "ok" or rest:
            problems = "; ".join(str(p) for p in [check, *rest][:5])
            raise self._corrupt(f"PRAGMA quick_check reports: {problems}")
        if "croupier_schema" not in tables:
            raise self._corrupt(f"it is a SQLite database but not a croupier store (tables: {sorted(tables)})")
        try:
            versions = conn.execute("SELECT version FROM croupier_schema").fetchall()
        except sqlite3.Error as exc:
            raise self._translate("cannot read the schema version", exc) from exc
        if len(versions) != 1 or isinstance(versions[0][0], bool) or not isinstance(versions[0][0], int):
            raise self._corrupt(f"croupier_schema must hold one integer version (holds {versions!r})")
        version = versions[0][0]
        if version > SCHEMA_VERSION:
            raise StoreVersionError(
                f"sqlite store {self.path} has schema version {version}, newer than the newest this "
                f"croupier knows ({SCHEMA_VERSION}); open it with the croupier that wrote it"
            )
        if version < 1:
            raise self._corrupt(f"schema version must be >= 1 (got {version})")
        if missing := sorted(_TABLES - tables):
            raise self._corrupt(f"schema version {version} but tables {missing} are missing")

    # -- reading ------------------------------------------------------------------------------

    def _read(self) -> Recovered:
        """Reads and verifies the snapshot and the records after it; the caller holds _db or owns the store."""
        try:
            snapshots = self._conn.execute("SELECT seq, crc, payload FROM snapshot").fetchall()
            if len(snapshots) > 1:
                raise self._corrupt(f"{len(snapshots)} snapshots, expected at most one")
            snapshot: bytes | None = None
            snapshot_seq = 0
            if snapshots:
                snapshot_seq, snapshot = self._verified("snapshot", *snapshots[0])
                if snapshot_seq < 0:
                    raise self._corrupt(f"snapshot has a negative seq {snapshot_seq}")
            records: list[tuple[int, bytes]] = []
            expected = snapshot_seq + 1
            cursor = self._conn.execute(
                "SELECT seq, crc, payload FROM journal WHERE seq > ? ORDER BY seq", (snapshot_seq,)
            )
            for row in cursor:
                seq, payload = self._verified("record", *row)
                if seq != expected:
                    raise self._corrupt(
                        f"journal gap: expected record {expected} after the snapshot at {snapshot_seq} "
                        f"and the records before it, found record {seq}"
                    )
                records.append((seq, payload))
                expected += 1
        except sqlite3.Error as exc:
            raise self._translate("cannot read", exc) from exc
        return Recovered(snapshot, snapshot_seq, records)

    def _verified(self, what: str, seq: object, crc: object, payload: object) -> tuple[int, bytes]:
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise self._corrupt(f"{what} has a non-integer seq {seq!r}")
        if not isinstance(payload, bytes):
            raise self._corrupt(f"{what} {seq} has a payload of type {type(payload).__name__}, not a blob")
        if not isinstance(crc, int) or crc != _crc(seq, payload):
            raise self._corrupt(
                f"{what} {seq} fails its checksum (stored {crc!r}, computed {_crc(seq, payload)}, "
                f"{len(payload)} bytes)"
            )
        return seq, payload

    def load(self) -> Recovered:
        """See :meth:`Store.load`."""
        with self._db:
            self._check_open()
            return self._read()

    # -- writing ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable(f"sqlite store {self.path} is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self._failure is not None:
            raise StoreUnavailable(f"{self._failure} (an earlier write failed; reopen the store)")

    def append(self, records: Sequence[bytes]) -> int:
        """See :meth:`Store.append`; concurrent callers share commits (see the class NOTE)."""
        mine = _Pending(_check_records(records))
        group: list[_Pending] = []
        with self._cond:
            self._check_writable()
            self._queue.append(mine)
            try:
                while self._leading and not mine.done:
                    self._cond.wait()
            except BaseException:  # e.g. KeyboardInterrupt: withdraw the records unless a leader took them
                if mine in self._queue:
                    self._queue.remove(mine)
                raise
            if not mine.done:
                # No commit in flight and ours is still queued: lead one for the whole queue.
                self._leading = True
                group, self._queue = self._queue, []
        if group:
            self._lead(group)
        if mine.error is not None:
            raise mine.error
        return mine.last_seq

    def _lead(self, group: list[_Pending]) -> None:
        error: StoreError | None = None
        try:
            with self._db:
                if self._failure is not None:
                    error = self._failure
                else:
                    self._commit(group)
        except sqlite3.Error as exc:
            error = self._failure = self._unavailable("cannot append", exc)
            raise error from exc
        except BaseException as exc:
            error = self._failure = StoreUnavailable(
                f"sqlite store {self.path}: append interrupted by {type(exc).__name__}: {exc}"
            )
            raise
        finally:
            with self._cond:
                for p in group:
                    if error is not None:
                        p.error = error
                self._leading = False
                self._cond.notify_all()

    def _commit(self, group: list[_Pending]) -> None:
        """Writes a group in one transaction; called with _db held. Sets each member's last_seq once durable."""
        conn = self._conn
        seq = self._last_seq
        rows: list[tuple[int, int, bytes]] = []
        ends: list[int] = []
        for p in group:
            for payload in p.payloads:
                seq += 1
                rows.append((seq, _crc(seq, payload), payload))
            ends.append(seq)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany("INSERT INTO journal (seq, crc, payload) VALUES (?, ?, ?)", rows)
            conn.execute("COMMIT")  # synchronous=FULL: returns once the WAL is fsync'd
        except BaseException:
            self._rollback()
            raise
        self._last_seq = seq
        self.commits += 1
        for p, end in zip(group, ends, strict=True):
            p.last_seq = end

    def _rollback(self) -> None:
        try:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # the store is poisoned either way

    def write_snapshot(self, seq: int, payload: bytes) -> None:
        """See :meth:`Store.write_snapshot`. Keeps the latest snapshot only; prunes in the same transaction."""
        seq = _check_seq(seq)
        data = _as_bytes(payload, "payload")
        with self._db:
            self._check_writable()
            _check_snapshot_seq(seq, self._snapshot_seq, self._last_seq)
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("DELETE FROM snapshot")
                conn.execute(
                    "INSERT INTO snapshot (seq, crc, payload) VALUES (?, ?, ?)", (seq, _crc(seq, data), data)
                )
                conn.execute("DELETE FROM journal WHERE seq <= ?", (seq,))
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback()
                self._failure = self._unavailable("cannot write a snapshot", exc)
                raise self._failure from exc
            except BaseException:
                self._rollback()
                raise
            self._snapshot_seq = seq

    def close(self) -> None:
        """See :meth:`Store.close`. Appends already queued are committed first."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.wait_for(lambda: not self._leading and not self._queue)
        with self._db, contextlib.suppress(sqlite3.Error):
            self._conn.close()


def parse_url(url: str) -> tuple[str, str]:
    """Splits a store URL into its scheme and path.

    ``memory://`` is an in-process store. ``sqlite:///PATH`` is a SQLite file, following
    SQLAlchemy's convention: what follows the third slash is the path, so
    ``sqlite:///state/croupier.db`` is relative to the working directory and
    ``sqlite:////var/lib/croupier.db`` (four slashes) is absolute.

    Args:
        url: The store URL.

    Returns:
        ``("memory", "")`` or ``("sqlite", path)``.

    Raises:
        ValueError: If the URL has another scheme, a host, or no path.
    """
    if not isinstance(url, str):
        raise TypeError(f"store URL must be a str (got {type(url).__name__})")
    scheme, sep, rest = url.partition("://")
    if sep and scheme == "memory":
        if rest:
            raise ValueError(f"store URL {url!r}: memory:// takes nothing after the scheme")
        return "memory", ""
    if sep and scheme == "sqlite":
        if not rest.startswith("/"):
            raise ValueError(
                f"store URL {url!r}: sqlite URLs have no host; use sqlite:///relative/path.db "
                "or sqlite:////absolute/path.db"
            )
        path = rest[1:]
        if not path or path.endswith("/"):
            raise ValueError(f"store URL {url!r}: no database file named after sqlite:///")
        return "sqlite", path
    raise ValueError(f"unsupported store URL {url!r}: supported schemes are {', '.join(SCHEMES)}")


def open_store(url: str) -> Store:
    """Opens the store a URL names; see :func:`parse_url` for the URL forms.

    Args:
        url: ``memory://`` or ``sqlite:///PATH``.

    Returns:
        The open, verified store.

    Raises:
        ValueError: If the URL is not one of the supported forms.
        StoreCorrupt: If the store's contents could not be verified.
        StoreVersionError: If the store was written with a newer schema.
        StoreUnavailable: If the store cannot be created, opened or locked.
    """
    scheme, path = parse_url(url)
    if scheme == "memory":
        return MemoryStore(url)
    return SqliteStore(url, path)
