"""The ``sqlite:///`` store: the journal and the latest snapshot in one SQLite file, checksummed."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

from croupier.core.checks import is_int
from croupier.server._store import (
    Recovered,
    StoreCorrupt,
    StoreError,
    StoreFull,
    StoreUnavailable,
    StoreVersionError,
    as_bytes,
    check_expected_last,
    check_records,
    check_seq,
    check_snapshot_seq,
    record_crc,
)

__all__ = ["SCHEMA_VERSION", "SqliteStore"]

#: The on-disk layout this module writes; a file with a newer version is refused.
SCHEMA_VERSION = 1

#: Seconds a SQLite call waits for a lock held by another connection before it fails.
_BUSY_TIMEOUT_S = 1.0


_SCHEMA = (
    "CREATE TABLE croupier_schema (version INTEGER NOT NULL)",
    "CREATE TABLE journal (seq INTEGER PRIMARY KEY, crc INTEGER NOT NULL, payload BLOB NOT NULL)",
    "CREATE TABLE snapshot (seq INTEGER PRIMARY KEY, crc INTEGER NOT NULL, payload BLOB NOT NULL)",
)
_TABLES = frozenset({"croupier_schema", "journal", "snapshot"})


#: Free bytes a store that found its file system full waits for before it writes again.
_ROOM_BYTES = 1 << 20


def _full(exc: BaseException) -> bool:
    """A write refused for want of room (SQLITE_FULL: SQLite met ENOSPC or EDQUOT writing, and rolled back)."""
    return getattr(exc, "sqlite_errorname", None) == "SQLITE_FULL"


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
    """A store in one SQLite file (``sqlite:///path``): WAL mode, ``synchronous=FULL``.

    Each record and the snapshot carry a CRC32 of (seq, payload). Opening the file runs
    ``PRAGMA quick_check`` and verifies every checksum and that the records after the snapshot
    are contiguous; :meth:`load` verifies again.

    Each :meth:`append` is one transaction and one durable commit, whatever the number of
    records it carries: batching records into one append is the caller's group commit (the
    coordinator's writer thread; see :class:`Store`).

    NOTE: A failed commit poisons the store: every later write raises :class:`StoreUnavailable`.
    After a failed fsync the OS may have dropped the dirty pages, so going on could acknowledge
    records that sit after lost ones; the caller reopens the store (which verifies it) instead.

    NOTE: The connection holds SQLite's exclusive lock for its whole life, so a second
    coordinator on the same file fails at open (:class:`StoreUnavailable`) instead of
    interleaving sequence numbers. The OS drops the lock when the process dies, kill -9 too.

    Attributes:
        url: The URL the store was opened with.
        shared: False: one coordinator per file, which the lock enforces.
        path: The database file, absolute.
        commits: The number of journal transactions :meth:`append` has committed.
    """

    shared = False

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
        self._closed = False
        self._failure: StoreUnavailable | None = None
        #: Free bytes :meth:`has_room` asks for (0 until a write found the file system full).
        self._wanted = 0
        # Callers MUST NOT overlap (see Store); the lock only keeps one that does from
        # interleaving two transactions on the connection.
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

    def _full(self, doing: str, exc: BaseException, size: int = 0) -> StoreFull:
        self._wanted = max(_ROOM_BYTES, size)
        return StoreFull(f"sqlite store {self.path}: {doing}: {_sqlite_reason(exc)}: the file system of "
                         f"{self.path.parent} has no room; nothing of this write was stored, and the store "
                         "takes writes again once there is room")

    def has_room(self) -> bool:
        """See :meth:`Store.has_room`: whether the file system of the store has room again after a
        :class:`StoreFull` (always, before one): 1 MiB free, or twice the write that found it full if more."""
        try:
            st = os.statvfs(self.path.parent)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize >= self._wanted

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
        if len(versions) != 1 or not is_int(versions[0][0]):
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
        if not is_int(seq):
            raise self._corrupt(f"{what} has a non-integer seq {seq!r}")
        if not isinstance(payload, bytes):
            raise self._corrupt(f"{what} {seq} has a payload of type {type(payload).__name__}, not a blob")
        if not is_int(crc) or crc != record_crc(seq, payload):
            raise self._corrupt(
                f"{what} {seq} fails its checksum (stored {crc!r}, computed {record_crc(seq, payload)}, "
                f"{len(payload)} bytes)"
            )
        return seq, payload

    def load(self) -> Recovered:
        """See :meth:`Store.load`."""
        with self._db:
            self._check_open()
            return self._read()

    def read_since(self, seq: int, *, deadline: float | None = None) -> Recovered:
        """See :meth:`Store.read_since`: the records after ``seq``, or the whole store if the snapshot is past it."""
        seq = check_seq(seq)
        with self._db:
            self._check_open()
            if not 0 <= seq <= self._last_seq:
                raise ValueError(
                    f"sqlite store {self.path}: seq must be in [0, {self._last_seq}], the journal's last record (got {seq=})"
                )
            rec = self._read()
        if seq < rec.snapshot_seq:
            return rec  # the records up to the snapshot are pruned with it
        return Recovered(None, seq, [(s, p) for s, p in rec.records if s > seq])

    # -- writing ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable(f"sqlite store {self.path} is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self._failure is not None:
            raise StoreUnavailable(f"{self._failure} (an earlier write failed; reopen the store)")

    def append(self, records: Sequence[bytes]) -> int:
        """See :meth:`Store.append`: one transaction, one durable commit."""
        payloads = check_records(records)
        with self._db:
            self._check_writable()
            return self._append(payloads)

    def append_at(self, expected_last: int, records: Sequence[bytes], *, deadline: float | None = None) -> int:
        """See :meth:`Store.append_at`. The file has one writer, so the check is against what it wrote."""
        expected_last = check_seq(expected_last, "expected_last")
        payloads = check_records(records)
        with self._db:
            self._check_writable()
            check_expected_last(expected_last, self._last_seq, self.url)
            return self._append(payloads)

    def last_seq(self, *, deadline: float | None = None) -> int:
        """See :meth:`Store.last_seq`."""
        with self._db:
            self._check_open()
            return self._last_seq

    def _append(self, payloads: list[bytes]) -> int:
        """One transaction, one durable commit; the caller holds _db and checked the store is writable."""
        first = self._last_seq + 1
        rows = [(seq, record_crc(seq, p), p) for seq, p in enumerate(payloads, start=first)]
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany("INSERT INTO journal (seq, crc, payload) VALUES (?, ?, ?)", rows)
            conn.execute("COMMIT")  # synchronous=FULL: returns once the WAL is fsync'd
        except sqlite3.Error as exc:
            self._rollback()
            if _full(exc):
                raise self._full("cannot append", exc, 2 * sum(len(p) for p in payloads)) from exc
            self._failure = self._unavailable("cannot append", exc)
            raise self._failure from exc
        except BaseException as exc:  # e.g. KeyboardInterrupt mid-commit: durable or not, unknown
            self._rollback()
            self._failure = StoreUnavailable(
                f"sqlite store {self.path}: append interrupted by {type(exc).__name__}: {exc}"
            )
            raise
        self._last_seq = rows[-1][0]
        self.commits += 1
        return self._last_seq

    def _rollback(self) -> None:
        try:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # the store is poisoned either way

    def write_snapshot(self, seq: int, payload: bytes) -> None:
        """See :meth:`Store.write_snapshot`. Keeps the latest snapshot only; prunes in the same transaction."""
        seq = check_seq(seq)
        data = as_bytes(payload, "payload")
        with self._db:
            self._check_writable()
            check_snapshot_seq(seq, self._snapshot_seq, self._last_seq)
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("DELETE FROM snapshot")
                conn.execute(
                    "INSERT INTO snapshot (seq, crc, payload) VALUES (?, ?, ?)", (seq, record_crc(seq, data), data)
                )
                conn.execute("DELETE FROM journal WHERE seq <= ?", (seq,))
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback()
                if _full(exc):
                    raise self._full("cannot write a snapshot", exc) from exc
                self._failure = self._unavailable("cannot write a snapshot", exc)
                raise self._failure from exc
            except BaseException:
                self._rollback()
                raise
            self._snapshot_seq = seq

    def close(self) -> None:
        """See :meth:`Store.close`."""
        with self._db:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
