"""A shared store in memory for in-process replicas: one Journal (the database), one SharedStore per replica."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from croupier.server._store import Recovered, StoreConflict, StoreUnavailable

__all__ = ["Journal", "SharedStore"]


class Journal:
    """One database: records with contiguous seqs, and one snapshot."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: list[bytes] = []
        self.snapshot: tuple[int, bytes] | None = None
        self.down = False


class SharedStore:
    """One replica's connection to a Journal: the shared-store part of the Store contract."""

    shared = True

    def __init__(self, journal: Journal, name: str) -> None:
        self.j, self.url = journal, f"shared://{name}"
        self.appends = 0

    def _up(self) -> None:
        if self.j.down:
            raise StoreUnavailable(f"{self.url}: the database is down")

    def last_seq(self, *, deadline: float | None = None) -> int:
        with self.j.lock:
            self._up()
            return len(self.j.records)

    def append_at(self, expected_last: int, records: Sequence[bytes], *, deadline: float | None = None) -> int:
        with self.j.lock:
            self._up()
            if expected_last != len(self.j.records):
                raise StoreConflict(f"{self.url}: the journal is at {len(self.j.records)}, not {expected_last}")
            self.j.records.extend(records)
            self.appends += 1
            return len(self.j.records)

    def append(self, records: Sequence[bytes]) -> int:
        with self.j.lock:
            self._up()
            self.j.records.extend(records)
            return len(self.j.records)

    def read_since(self, seq: int, *, deadline: float | None = None) -> Recovered:
        with self.j.lock:
            self._up()
            return Recovered(None, seq, [(i + 1, r) for i, r in enumerate(self.j.records) if i + 1 > seq])

    def load(self) -> Recovered:
        return self.read_since(0)

    def write_snapshot(self, seq: int, payload: bytes) -> None:
        with self.j.lock:
            self._up()
            if self.j.snapshot is None or seq > self.j.snapshot[0]:
                self.j.snapshot = (seq, payload)

    def has_room(self) -> bool:
        return True

    def close(self) -> None:
        pass
