"""The ``memory://`` store: a journal and snapshot in this process's memory."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from croupier.server._store import (
    Recovered,
    StoreUnavailable,
    as_bytes,
    check_expected_last,
    check_records,
    check_seq,
    check_snapshot_seq,
)

__all__ = ["MemoryStore"]


class MemoryStore:
    """An in-process store (``memory://``): the same semantics as the others, durable for the process's life.

    Attributes:
        url: The URL the store was opened with.
        shared: False: one process, one writer (see :class:`~croupier.server._store.Store`).
    """

    shared = False

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

    def _append(self, payloads: list[bytes]) -> int:
        first = self._last_seq + 1
        self._records.extend(zip(range(first, first + len(payloads)), payloads, strict=True))
        self._last_seq += len(payloads)
        return self._last_seq

    def append(self, records: Sequence[bytes]) -> int:
        """See :meth:`Store.append`."""
        payloads = check_records(records)
        with self._lock:
            self._check_open()
            return self._append(payloads)

    def append_at(self, expected_last: int, records: Sequence[bytes], *, deadline: float | None = None) -> int:
        """See :meth:`Store.append_at`."""
        expected_last = check_seq(expected_last, "expected_last")
        payloads = check_records(records)
        with self._lock:
            self._check_open()
            check_expected_last(expected_last, self._last_seq, self.url)
            return self._append(payloads)

    def last_seq(self, *, deadline: float | None = None) -> int:
        """See :meth:`Store.last_seq`."""
        with self._lock:
            self._check_open()
            return self._last_seq

    def write_snapshot(self, seq: int, payload: bytes) -> None:
        """See :meth:`Store.write_snapshot`. Keeps the latest snapshot only and prunes the records it covers."""
        seq = check_seq(seq)
        data = as_bytes(payload, "payload")
        with self._lock:
            self._check_open()
            check_snapshot_seq(seq, self._snapshot_seq, self._last_seq)
            self._snapshot, self._snapshot_seq = data, seq
            self._records = [(s, p) for s, p in self._records if s > seq]

    def load(self) -> Recovered:
        """See :meth:`Store.load`."""
        with self._lock:
            self._check_open()
            return Recovered(self._snapshot, self._snapshot_seq, list(self._records))

    def read_since(self, seq: int, *, deadline: float | None = None) -> Recovered:
        """See :meth:`Store.read_since`: the records after ``seq``, or the whole store if the snapshot is past it."""
        seq = check_seq(seq)
        with self._lock:
            self._check_open()
            if not 0 <= seq <= self._last_seq:
                raise ValueError(
                    f"store {self.url}: seq must be in [0, {self._last_seq}], the journal's last record (got {seq=})"
                )
            if seq < self._snapshot_seq:
                return Recovered(self._snapshot, self._snapshot_seq, list(self._records))
            return Recovered(None, seq, [(s, p) for s, p in self._records if s > seq])

    def has_room(self) -> bool:
        """See :meth:`Store.has_room`: always (this store's writes never find a file system full)."""
        return True

    def close(self) -> None:
        """See :meth:`Store.close`."""
        with self._lock:
            self._closed = True
