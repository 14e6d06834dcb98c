"""The coordinator's durable storage: a journal of opaque event records plus the latest snapshot.

This module is the interface: the :class:`Store` protocol and the invariants every backend
MUST keep, the errors, what a store reads back (:class:`Recovered`), the argument checks
every backend shares, and opening a store from its URL. Each backend lives in a module of its
own: ``memory://`` in ``_memory_store``, ``sqlite:///`` in ``_sqlite_store``;
:func:`open_store` imports the one a URL names when it is asked for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = [
    "SCHEMES",
    "Recovered",
    "Store",
    "StoreCorrupt",
    "StoreError",
    "StoreUnavailable",
    "StoreVersionError",
    "as_bytes",
    "check_records",
    "check_seq",
    "check_snapshot_seq",
    "open_store",
    "parse_url",
]

#: URL schemes :func:`open_store` accepts.
SCHEMES = ("memory://", "sqlite:///")


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
    raises it too (see ``SqliteStore``).
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

    A store has one writer. Group commit is the caller's job, done in one place: the
    coordinator's writer thread takes everything queued since its last append and hands it to
    one ``append`` call, so one durable commit acknowledges all of it. A store does not batch
    callers of its own.

    Invariants every backend MUST keep:

    - Sequence numbers start at 1 and are contiguous: the n-th record ever appended has seq n.
    - ``append`` MUST NOT return before its records are durable (for a file, fsync'd); when it
      raises, the caller MUST treat the records as not acknowledged.
    - ``load`` MUST return exactly what was acknowledged (or more: records whose ``append`` was
      cut short by a crash after they became durable), verified, or raise
      :class:`StoreCorrupt`; it MUST NOT return a state it could not verify.
    - A snapshot at ``seq`` stands for every record with sequence number <= ``seq``; those
      records MAY be pruned once it is durable.

    What callers MUST do:

    - ``append``, ``write_snapshot``, ``load`` and ``close`` MUST NOT be called concurrently:
      one thread at a time drives a store (the coordinator's writer, after ``load`` at start).
      A backend need not batch or order concurrent calls.

    Attributes:
        url: The URL the store was opened with.
    """

    url: str

    def append(self, records: Sequence[bytes]) -> int:
        """Durably appends records to the journal, in one durable commit.

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


def check_seq(seq: object) -> int:
    """The ``seq`` argument of :meth:`Store.write_snapshot`, checked to be an int (not a bool).

    Raises:
        TypeError: If it is not.
    """
    if isinstance(seq, bool) or not isinstance(seq, int):
        raise TypeError(f"seq must be an int (got {type(seq).__name__})")
    return seq


def check_snapshot_seq(seq: int, snapshot_seq: int, last_seq: int) -> None:
    """Refuses a snapshot beyond the journal or older than the current one.

    Args:
        seq: The new snapshot's seq.
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
        TypeError: If ``url`` is not a str.
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

    The backend's module is imported here, so importing this module loads no backend (and no
    ``sqlite3``).

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
        from croupier.server._memory_store import MemoryStore

        return MemoryStore(url)
    from croupier.server._sqlite_store import SqliteStore

    return SqliteStore(url, path)
