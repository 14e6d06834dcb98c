"""The coordinator's durable storage: a journal of opaque event records plus the latest snapshot.

This module is the interface: the :class:`Store` protocol and the invariants every backend
MUST keep, the errors, what a store reads back (:class:`Recovered`), the argument checks
every backend shares, and opening a store from its URL. Each backend lives in a module of its
own: ``memory://`` in ``_memory_store``, ``sqlite:///`` in ``_sqlite_store``,
``postgresql://`` in ``_pg_store``; ``croupier.server._stores.open_store`` imports the one a URL names when it is
asked for it.
"""

from __future__ import annotations

import dataclasses
import struct
import urllib.parse
import zlib
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from croupier.core.checks import check_int, check_type

__all__ = [
    "SCHEMES",
    "Recovered",
    "Store",
    "StoreCorrupt",
    "StoreConflict",
    "StoreError",
    "StoreUnavailable",
    "StoreVersionError",
    "as_bytes",
    "check_expected_last",
    "check_records",
    "check_seq",
    "check_snapshot_seq",
    "parse_url",
    "record_crc",
    "redact_url",
]

#: URL schemes ``croupier.server._stores.open_store`` accepts.
SCHEMES = ("memory://", "sqlite:///", "postgresql://", "postgres://")


class StoreError(Exception):
    """Base of every error a store raises."""


class StoreCorrupt(StoreError):
    """The store's contents could not be verified or read (not a database, bad checksum, a gap, ...).

    The message names the store and what is wrong. A coordinator MUST NOT serve from a store
    that raised this.
    """


class StoreUnavailable(StoreError):
    """The store cannot make a change durable, or cannot be reached; nothing was acknowledged.

    Once a sqlite store raised this from ``append`` or ``write_snapshot``, every later write
    raises it too (see ``SqliteStore``). A shared store raises it while its database cannot be
    reached and works again once it can (the same store object reconnects); when the connection
    was lost during a commit, the records may or may not be durable: the caller re-reads.
    """


class StoreFull(StoreUnavailable):
    """The store had no room for a write (the disk or the file system is full); nothing of it was stored.

    Unlike other write failures of a sqlite store, this one does not poison it: the write failed
    before anything reached the disk for good (SQLite rolls the transaction back), so the store
    takes writes again once there is room (see :meth:`Store.has_room`).
    """


class StoreConflict(StoreError):
    """``append_at`` found the journal past the seq its caller expected: another writer got there first.

    Nothing was written. The caller reads what it missed (``read_since``) and decides again.
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

    A store is either single-writer (``memory://``, ``sqlite:///``: ``shared`` is False) or
    shared (``postgresql://``: ``shared`` is True), where several coordinator processes
    ("replicas") use one database at once, with no leader: each appends with
    :meth:`append_at` at the seq it has applied up to, exactly one of several writers racing
    for the same seq wins, and the others catch up with :meth:`read_since` and decide again.

    Group commit is the caller's job, done in one place (``croupier.server._commits``): on a
    single-writer store the coordinator's writer thread takes everything queued since its last
    append and hands it to one ``append`` call, so one durable commit acknowledges all of it; on
    a shared store each decision is one ``append_at``, and the progress reports gathered
    meanwhile one more. A store does not batch callers of its own.

    Invariants every backend MUST keep:

    - Sequence numbers start at 1 and are contiguous: the n-th record ever appended has seq n,
      whichever process appended it; no seq is ever written twice.
    - ``append`` and ``append_at`` MUST NOT return before their records are durable (for a
      file, fsync'd; for PostgreSQL, committed with ``synchronous_commit`` on); when they
      raise, the caller MUST treat the records as not acknowledged (and, after
      :class:`StoreUnavailable` from a shared store, MUST re-read: the commit may have happened).
    - ``append_at(expected_last, records)`` writes all of ``records`` or none, and only if the
      journal's last seq is exactly ``expected_last`` when it commits; two callers at the same
      ``expected_last`` MUST NOT both succeed, from any number of threads or processes.
    - ``load`` and ``read_since`` MUST return exactly what was acknowledged (or more: records
      whose append was cut short by a crash after they became durable), verified, or raise
      :class:`StoreCorrupt`; they MUST NOT return a state they could not verify.
    - A snapshot at ``seq`` stands for every record with sequence number <= ``seq``; those
      records MAY be pruned once it is durable. A single-writer store prunes all of them; a
      shared store keeps some (see its class) so that a replica a little behind catches up by
      records instead of by the whole snapshot.
    - On a shared store, a snapshot older than or as old as the current one is ignored (another
      replica wrote a newer one first); a newer one replaces it.

    What callers MUST do:

    - Single-writer store: ``append``, ``append_at``, ``write_snapshot``, ``load``,
      ``read_since``, ``last_seq`` and ``close`` MUST NOT be called concurrently: one thread at
      a time drives a store (the coordinator's writer, after ``load`` at start), and one store
      object at a time uses its file. A backend need not batch or order concurrent calls.
    - Shared store: every process opens its own store object, and one thread at a time per
      process drives it; the database serializes the processes. A writer MUST use
      ``append_at`` with the last seq it has applied (``append`` numbers records after whatever
      the journal holds, which is only right for a caller that does not care what it follows).

    The ``deadline`` of :meth:`append_at`, :meth:`last_seq` and :meth:`read_since` (``time.monotonic()``;
    None: none) is the deadline of the call that asks (``croupier.server._deadline.Budget``), passed as a
    value: a store that waits for a connection MUST wait no longer, and past it MUST ask nothing
    (StoreUnavailable); a store with nothing to wait for (a single writer's) ignores it.

    Attributes:
        url: The URL the store was opened with, with any password replaced by ``***``: safe
            to log.
        shared: True when several coordinator processes may use the store at once.
    """

    url: str
    shared: bool

    def append(self, records: Sequence[bytes]) -> int:
        """Durably appends records after the journal's last, in one durable commit.

        On a shared store this is ``append_at(last_seq(), records)``: it raises
        :class:`StoreConflict` if another writer appends in between.

        Args:
            records: One or more opaque payloads, in the order they get sequence numbers.

        Returns:
            The sequence number of the last of ``records``.

        Raises:
            ValueError: If ``records`` is empty.
            TypeError: If a record is not bytes-like.
            StoreConflict: Shared stores only: another writer appended first; nothing written.
            StoreUnavailable: If the records could not be made durable, or the store is closed.
        """
        ...

    def append_at(self, expected_last: int, records: Sequence[bytes], *, deadline: float | None = None) -> int:
        """Durably appends records as ``expected_last + 1, ...``, only if the journal ends at ``expected_last``.

        One transaction: all of ``records`` or none. On a shared store the check and the
        insert are atomic against every other process (the database's unique key on seq
        decides between two writers that checked at the same time).

        Args:
            expected_last: The seq the caller has applied up to: the journal's last seq as it
                knows it (0 for an empty store).
            records: One or more opaque payloads, in the order they get sequence numbers.
            deadline: When the call that asks stops waiting (see :class:`Store`).

        Returns:
            ``expected_last + len(records)``, the sequence number of the last of ``records``.

        Raises:
            ValueError: If ``records`` is empty, ``expected_last`` is negative, or it is beyond
                the journal's last seq (a gap: a caller bug).
            TypeError: If ``expected_last`` is not an int or a record is not bytes-like.
            StoreConflict: If the journal's last seq is past ``expected_last``: another writer
                got there first; nothing was written.
            StoreUnavailable: If the records could not be made durable, the store is closed, or
                the connection was lost while committing (the outcome is unknown: re-read).
        """
        ...

    def last_seq(self, *, deadline: float | None = None) -> int:
        """The last durable record's seq (the snapshot's, if it pruned them all); 0 for an empty store.

        One cheap query on a shared store: what a replica compares with its own position. `deadline`:
        when the call that asks stops waiting (see :class:`Store`).

        Raises:
            StoreUnavailable: If the store could not be read, or is closed.
        """
        ...

    def write_snapshot(self, seq: int, payload: bytes) -> None:
        """Durably stores a snapshot of the whole state as of journal record ``seq``.

        Args:
            seq: The last record the snapshot covers; MUST be acknowledged already. On a
                single-writer store it MUST be no smaller than the current snapshot's; on a
                shared store a snapshot not newer than the current one is ignored.
            payload: The opaque snapshot.

        Raises:
            ValueError: If ``seq`` is beyond the journal, negative, or (single-writer stores)
                before the current snapshot.
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

    def read_since(self, seq: int, *, deadline: float | None = None) -> Recovered:
        """What a reader that has applied every record up to ``seq`` needs to catch up, verified.

        If the records after ``seq`` are all still held, that is ``Recovered(None, seq,
        [every record with seq > seq])``. If some were pruned (the latest snapshot is past
        ``seq`` and covers them), it is what :meth:`load` returns: that snapshot and every
        record after it; the reader replaces its state with the snapshot.

        Args:
            seq: The last record the reader has applied (0 for none).
            deadline: When the call that asks stops waiting (see :class:`Store`).

        Returns:
            The snapshot to start from (or ``None`` to keep the reader's state) and the records
            to apply after it, contiguous from ``snapshot_seq + 1``.

        Raises:
            ValueError: If ``seq`` is negative or beyond the journal's last seq.
            TypeError: If ``seq`` is not an int.
            StoreCorrupt: If anything could not be verified.
            StoreUnavailable: If the store could not be read, or is closed.
        """
        ...

    def has_room(self) -> bool:
        """Whether the store takes writes again after a write raised :class:`StoreFull`.

        True before any :class:`StoreFull`. After one, True once the room the failed write
        wants is free again. A backend whose writes never raise :class:`StoreFull` MUST
        return True. It MUST NOT raise (a store that cannot tell answers False, and is asked
        again later), and MUST answer on a closed store too. The coordinator asks it, with a
        backoff, before it takes writes again after a :class:`StoreFull`.
        """
        ...

    def close(self) -> None:
        """Releases the store; later calls raise, close is idempotent."""
        ...


# -- checks every backend shares ------------------------------------------------------------------


def as_bytes(value: object, what: str) -> bytes:
    """``value`` as bytes, if it is bytes-like.

    Args:
        value: The value to check.
        what: Its name, for the error.

    Returns:
        ``value`` as bytes.

    Raises:
        TypeError: If ``value`` is not bytes, bytearray or memoryview.
    """
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{what} must be bytes (got {type(value).__name__})")


def check_records(records: Sequence[bytes]) -> list[bytes]:
    """The argument of :meth:`Store.append`, checked.

    Args:
        records: What the caller passed.

    Returns:
        The records as a list of bytes.

    Raises:
        TypeError: If ``records`` is a single bytes-like value or str, or a record is not bytes-like.
        ValueError: If ``records`` is empty.
    """
    if isinstance(records, (bytes, bytearray, memoryview, str)):
        raise TypeError(
            f"records must be a sequence of bytes, not a single {type(records).__name__}; "
            "wrap one record in a list"
        )
    out = [as_bytes(r, f"records[{i}]") for i, r in enumerate(records)]
    if not out:
        raise ValueError("records must hold at least one record (got an empty sequence)")
    return out


def check_seq(seq: object, what: str = "seq") -> int:
    """A sequence-number argument, checked to be an int (not a bool) >= 0.

    Args:
        seq: The value to check.
        what: Its name, for the error.

    Returns:
        ``seq``.

    Raises:
        TypeError: If it is not an int.
        ValueError: If it is negative.
    """
    return check_int(what, seq, 0)


def check_expected_last(expected_last: int, last_seq: int, url: str) -> None:
    """Refuses an ``append_at`` whose ``expected_last`` is not the journal's last seq.

    Args:
        expected_last: What the caller passed (an int, checked by :func:`check_seq`).
        last_seq: The journal's last seq, read where the append is decided.
        url: The store's (redacted) URL, for the error.

    Raises:
        ValueError: If ``expected_last`` is beyond ``last_seq`` (a gap).
        StoreConflict: If ``expected_last < last_seq``: another writer got there first.
    """
    if expected_last > last_seq:
        raise ValueError(
            f"store {url}: expected_last {expected_last} is beyond the journal's last record {last_seq}; "
            "appending there would leave a gap"
        )
    if expected_last < last_seq:
        raise StoreConflict(
            f"store {url}: the journal is at record {last_seq}, past expected_last {expected_last}; "
            "another writer appended first (nothing was written)"
        )


def record_crc(seq: int, payload: bytes) -> int:
    """The CRC32 every backend stores beside a record or snapshot: of ``seq`` and ``payload``.

    The sequence number is part of the checksum, so a record moved to another seq fails too.
    """
    return zlib.crc32(payload, zlib.crc32(struct.pack("<q", seq)))


def check_snapshot_seq(seq: int, snapshot_seq: int, last_seq: int) -> None:
    """Refuses a snapshot beyond the journal or older than the current one.

    Args:
        seq: The new snapshot's seq (an int >= 0, checked by :func:`check_seq`).
        snapshot_seq: The current snapshot's seq (0 if none).
        last_seq: The last acknowledged record's seq.

    Raises:
        ValueError: If ``seq > last_seq`` or ``seq < snapshot_seq``.
    """
    if seq > last_seq:
        raise ValueError(f"snapshot seq must be <= the last acknowledged record {last_seq} (got {seq=})")
    if seq < snapshot_seq:
        raise ValueError(f"snapshot seq must be >= the current snapshot's {snapshot_seq} (got {seq=})")


# -- URLs ------------------------------------------------------------------------------------------


def redact_url(url: str) -> str:
    """``url`` with its password (``user:PASSWORD@``, ``?password=``) replaced by ``***``.

    Args:
        url: Any URL-like string.

    Returns:
        The URL, safe to print and log.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    if "@" in netloc:
        userinfo, _, hosts = netloc.rpartition("@")
        if ":" in userinfo:
            netloc = f"{userinfo.partition(':')[0]}:***@{hosts}"
    path, q, query = tail.partition("?")
    if q:
        params = [
            f"{k}=***" if urllib.parse.unquote(k) == "password" else f"{k}{e}{v}"
            for k, e, v in (p.partition("=") for p in query.split("&"))
        ]
        query = "&".join(params)
    return f"{scheme}{sep}{netloc}{slash}{path}{q}{query}"


def parse_url(url: str) -> tuple[str, str]:
    """Splits a store URL into its scheme and where the store is.

    ``memory://`` is an in-process store. ``sqlite:///PATH`` is a SQLite file, following
    SQLAlchemy's convention: what follows the third slash is the path, so
    ``sqlite:///state/croupier.db`` is relative to the working directory and
    ``sqlite:////var/lib/croupier.db`` (four slashes) is absolute.
    ``postgresql://user:password@host:port/dbname?param=value`` (or ``postgres://``) is a
    PostgreSQL database, as libpq reads the URL (several ``host:port`` pairs, ``sslmode``,
    ``target_session_attrs`` ...); it MUST name a database.

    Args:
        url: The store URL.

    Returns:
        ``("memory", "")``, ``("sqlite", path)`` or ``("postgresql", url)``.

    Raises:
        TypeError: If ``url`` is not a str.
        ValueError: If the URL has another scheme, or lacks a part its scheme needs; the message
            shows the URL without its password.
    """
    check_type("store URL", url, str)
    shown = repr(redact_url(url))
    scheme, sep, rest = url.partition("://")
    if sep and scheme == "memory":
        if rest:
            raise ValueError(f"store URL {shown}: memory:// takes nothing after the scheme")
        return "memory", ""
    if sep and scheme == "sqlite":
        if not rest.startswith("/"):
            raise ValueError(
                f"store URL {shown}: sqlite URLs have no host; use sqlite:///relative/path.db "
                "or sqlite:////absolute/path.db"
            )
        path = rest[1:]
        if not path or path.endswith("/"):
            raise ValueError(f"store URL {shown}: no database file named after sqlite:///")
        return "sqlite", path
    if sep and scheme in ("postgresql", "postgres"):
        _, _, tail = rest.partition("/")
        dbname, _, query = tail.partition("?")
        named = any(p.partition("=")[0] == "dbname" for p in query.split("&"))
        if not dbname and not named:
            raise ValueError(
                f"store URL {shown}: name the database, as in postgresql://user:password@host:5432/dbname"
            )
        return "postgresql", url
    raise ValueError(f"unsupported store URL {shown}: supported schemes are {', '.join(SCHEMES)}")


@runtime_checkable
class Watched(Protocol):
    """A shared store that knows the journal's last seq without a query while that knowledge is fresh
    (``postgresql://``: LISTEN and a heartbeat, see ``croupier.server._pg_watch``)."""

    def known_last(self, max_age_s: float) -> int | None:
        """The journal's last seq if confirmed within the last `max_age_s` seconds, else None (ask :meth:`Store.last_seq`)."""
        ...
