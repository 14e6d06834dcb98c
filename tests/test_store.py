"""The store contract over every backend, each backend's own checks, shared PostgreSQL stores, and kill -9 durability."""

from __future__ import annotations

import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from croupier.server._memory_store import MemoryStore
from croupier.server._pg_store import PRUNE_MARGIN, PostgresStore
from croupier.server._pg_store import SCHEMA_VERSION as PG_SCHEMA_VERSION
from croupier.server._sqlite_store import SCHEMA_VERSION, SqliteStore
from croupier.server._store import (
    Recovered,
    Store,
    StoreConflict,
    StoreCorrupt,
    StoreUnavailable,
    StoreVersionError,
    parse_url,
    redact_url,
)
from croupier.server._stores import open_store

if TYPE_CHECKING:
    from _postgres import Postgres

ROOT = Path(__file__).resolve().parents[1]

#: The fixtures postgres (the session's server) and postgres_url (a fresh database per test).
pytest_plugins = ["_postgres"]


def _payload(tag: int) -> bytes:
    """A distinct payload for ``tag``, with NUL and high bytes in it."""
    return b"\x00rec\xff" + tag.to_bytes(8, "little") + bytes(tag % 7)


class StoreContract:
    """What every backend MUST do; a subclass per backend says how to open and reopen one.

    Reopening stands for a coordinator restart: a file or database store is closed and opened
    again from its URL; the memory store lives as long as its process, so it is handed back as
    it is.
    """

    def _open(self, tmp: Path) -> Store:
        raise NotImplementedError

    def _reopen(self, store: Store) -> Store:
        raise NotImplementedError

    def margin(self, store: Store) -> int:
        """How many records before its snapshot a store keeps (0: a single-writer store prunes them all)."""
        return 0

    @pytest.fixture(autouse=True)
    def _close_all(self) -> Iterator[None]:
        self._opened: list[Store] = []
        yield
        for s in self._opened:
            s.close()

    def open(self, tmp: Path) -> Store:
        """Opens a new, empty store whose files (if any) go under ``tmp``; closed after the test."""
        s = self._open(tmp)
        self._opened.append(s)
        return s

    def reopen(self, store: Store) -> Store:
        """What a restarted coordinator would open in place of ``store``; closed after the test."""
        s = self._reopen(store)
        self._opened.append(s)
        return s

    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return self.open(tmp_path)

    def test_is_a_store(self, store: Store) -> None:
        assert isinstance(store, Store)
        assert isinstance(store.url, str)
        assert isinstance(store.shared, bool)

    def test_empty_store_loads_nothing(self, store: Store) -> None:
        assert store.load() == Recovered(None, 0, [])
        assert store.read_since(0) == Recovered(None, 0, [])
        assert store.last_seq() == 0
        assert self.reopen(store).load() == Recovered(None, 0, [])

    def test_append_round_trips(self, store: Store) -> None:
        assert store.append([b"first"]) == 1
        # Other bytes-like records are taken too, and read back as bytes.
        assert store.append([b"", b"\x00\xff" * 3, bytearray(b"ba")]) == 4  # type: ignore[list-item]
        big = os.urandom(1 << 20)
        assert store.append([memoryview(big)]) == 5  # type: ignore[list-item]
        expected = [(1, b"first"), (2, b""), (3, b"\x00\xff" * 3), (4, b"ba"), (5, big)]
        assert store.load() == Recovered(None, 0, expected)
        store = self.reopen(store)
        assert store.load() == Recovered(None, 0, expected)
        assert all(type(p) is bytes for _, p in store.load().records)
        assert all(type(p) is bytes for _, p in store.read_since(0).records)

    def test_sequences_are_contiguous(self, store: Store) -> None:
        rng = random.Random(0)
        last = 0
        for i in range(100):
            k = rng.randint(1, 5)
            got = store.append([_payload(i)] * k) if i % 2 else store.append_at(last, [_payload(i)] * k)
            assert got == last + k
            last = got
        seqs = [s for s, _ in store.load().records]
        assert seqs == list(range(1, last + 1))
        assert store.last_seq() == last

    def test_numbering_continues_after_reopen(self, store: Store) -> None:
        store.append([b"a", b"b"])
        store = self.reopen(store)
        assert store.last_seq() == 2
        assert store.append([b"c"]) == 3
        assert store.append_at(3, [b"d"]) == 4
        assert store.load().records == [(1, b"a"), (2, b"b"), (3, b"c"), (4, b"d")]

    def test_snapshot_prunes_and_load_returns_only_later_records(self, store: Store) -> None:
        for i in range(10):
            store.append([_payload(i)])
        store.write_snapshot(6, b"state@6")
        want = Recovered(b"state@6", 6, [(s, _payload(s - 1)) for s in range(7, 11)])
        assert store.load() == want
        assert store.append([b"after"]) == 11
        store = self.reopen(store)
        got = store.load()
        assert (got.snapshot, got.snapshot_seq) == (b"state@6", 6)
        assert got.records == [*want.records, (11, b"after")]
        assert got.last_seq == 11

    def test_newer_snapshot_replaces_older(self, store: Store) -> None:
        store.append([b"a", b"b", b"c"])
        store.write_snapshot(1, b"s1")
        store.write_snapshot(1, b"s1 again")  # replaces on a single-writer store, ignored on a shared one
        assert store.load().snapshot == (b"s1" if store.shared else b"s1 again")
        store.write_snapshot(3, b"s3")
        got = self.reopen(store).load()
        assert got == Recovered(b"s3", 3, [])
        assert got.last_seq == 3

    def test_snapshot_of_everything_then_append(self, store: Store) -> None:
        store.append([b"a", b"b"])
        store.write_snapshot(2, b"all")
        assert store.load() == Recovered(b"all", 2, [])
        assert store.last_seq() == 2
        assert store.append([b"c"]) == 3
        assert self.reopen(store).load() == Recovered(b"all", 2, [(3, b"c")])

    def test_snapshot_of_empty_store(self, store: Store) -> None:
        store.write_snapshot(0, b"")
        assert store.load() == Recovered(b"", 0, [])
        assert store.last_seq() == 0
        assert store.append([b"x"]) == 1

    def test_snapshot_seq_is_checked(self, store: Store) -> None:
        store.append([b"a", b"b", b"c"])
        with pytest.raises(ValueError, match=r"<= the last acknowledged record 3 \(got seq=4\)"):
            store.write_snapshot(4, b"s")
        with pytest.raises(ValueError, match=r">= 0 \(got seq=-1\)"):
            store.write_snapshot(-1, b"s")
        store.write_snapshot(2, b"s")
        if store.shared:  # another replica may have written a newer one: not an error
            store.write_snapshot(1, b"older")
        else:
            with pytest.raises(ValueError, match=r">= the current snapshot's 2 \(got seq=1\)"):
                store.write_snapshot(1, b"s")
        with pytest.raises(TypeError, match="seq must be an int"):
            store.write_snapshot(True, b"s")
        with pytest.raises(TypeError, match="payload must be bytes"):
            store.write_snapshot(2, "s")  # type: ignore[arg-type]
        assert store.load() == Recovered(b"s", 2, [(3, b"c")])

    def test_append_arguments_are_checked(self, store: Store) -> None:
        with pytest.raises(ValueError, match="at least one record"):
            store.append([])
        with pytest.raises(TypeError, match=r"records\[1\] must be bytes \(got str\)"):
            store.append([b"ok", "no"])  # type: ignore[list-item]
        with pytest.raises(TypeError, match="not a single bytes"):
            store.append(b"abc")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="at least one record"):
            store.append_at(0, [])
        with pytest.raises(TypeError, match="not a single bytes"):
            store.append_at(0, b"abc")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"expected_last must be an int \(got bool\)"):
            store.append_at(False, [b"x"])
        with pytest.raises(TypeError, match=r"expected_last must be an int \(got str\)"):
            store.append_at("0", [b"x"])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"expected_last must be >= 0 \(got expected_last=-1\)"):
            store.append_at(-1, [b"x"])
        assert store.load() == Recovered(None, 0, [])
        assert store.append([b"x"]) == 1

    def test_append_at_appends_only_at_the_journals_end(self, store: Store) -> None:
        assert store.append_at(0, [b"a", b"b"]) == 2
        assert store.append_at(2, [b"c"]) == 3
        for stale in (0, 1, 2):
            with pytest.raises(StoreConflict, match=f"at record 3, past expected_last {stale}|appended record {stale + 1} first"):
                store.append_at(stale, [b"lost"])
        with pytest.raises(ValueError, match="expected_last 4 is beyond the journal's last record 3") as info:
            store.append_at(4, [b"gap"])
        assert store.url in str(info.value)
        want = [(1, b"a"), (2, b"b"), (3, b"c")]
        assert store.load() == Recovered(None, 0, want)  # nothing from the refused calls
        store.write_snapshot(3, b"s3")  # the journal's end is the snapshot's, even with every record pruned
        assert store.last_seq() == 3
        with pytest.raises(StoreConflict):
            store.append_at(2, [b"lost"])
        assert store.append_at(3, [b"d"]) == 4
        store = self.reopen(store)
        with pytest.raises(StoreConflict):
            store.append_at(3, [b"lost"])
        assert store.append_at(4, [b"e", b"f"]) == 6
        assert store.load() == Recovered(b"s3", 3, [(4, b"d"), (5, b"e"), (6, b"f")])

    def test_read_since(self, store: Store) -> None:
        assert store.append([_payload(i) for i in range(1, 11)]) == 10
        everything = [(s, _payload(s)) for s in range(1, 11)]
        for x in (0, 3, 9, 10):
            assert store.read_since(x) == Recovered(None, x, everything[x:])
        store.write_snapshot(8, b"s8")
        margin = self.margin(store)
        for x in range(11):
            got = store.read_since(x)
            if x >= 8 or x + 1 > 8 - margin:  # record x + 1 is still held: catch up by records
                assert got == Recovered(None, x, everything[x:]), x
            else:  # pruned: start again from the snapshot
                assert got == Recovered(b"s8", 8, everything[8:]), x
                assert got == store.load()
        store = self.reopen(store)
        assert store.read_since(10) == Recovered(None, 10, [])
        assert store.read_since(0) == (store.load() if margin < 8 else Recovered(None, 0, everything))

    def test_read_since_arguments_are_checked(self, store: Store) -> None:
        store.append([b"a", b"b"])
        with pytest.raises(ValueError, match=r"seq must be .*\(got seq=-1\)"):
            store.read_since(-1)
        with pytest.raises(ValueError, match=r"seq must be in \[0, 2\], the journal's last record \(got seq=3\)"):
            store.read_since(3)
        with pytest.raises(TypeError, match=r"seq must be an int \(got bool\)"):
            store.read_since(True)
        with pytest.raises(TypeError, match=r"seq must be an int \(got float\)"):
            store.read_since(1.0)  # type: ignore[arg-type]

    def test_closed_store_refuses(self, tmp_path: Path) -> None:
        store = self.open(tmp_path)
        store.append([b"x"])
        store.close()
        store.close()
        with pytest.raises(StoreUnavailable, match="closed"):
            store.append([b"y"])
        with pytest.raises(StoreUnavailable, match="closed"):
            store.append_at(1, [b"y"])
        with pytest.raises(StoreUnavailable, match="closed"):
            store.write_snapshot(1, b"s")
        with pytest.raises(StoreUnavailable, match="closed"):
            store.load()
        with pytest.raises(StoreUnavailable, match="closed"):
            store.read_since(0)
        with pytest.raises(StoreUnavailable, match="closed"):
            store.last_seq()

    def test_matches_a_model(self) -> None:
        """Any mix of appends (at the end, stale, past the end), snapshots, reads and reopens goes as a plain list model says."""
        ops = st.lists(
            st.one_of(
                st.tuples(st.just("append"), st.integers(1, 4)),
                st.tuples(st.just("append_at"), st.integers(1, 4)),
                st.tuples(st.just("stale"), st.integers(1, 4)),
                st.tuples(st.just("gap"), st.integers(1, 4)),
                st.tuples(st.just("snapshot"), st.integers(0, 5)),
                st.tuples(st.just("old snapshot"), st.integers(1, 3)),
                st.tuples(st.just("read_since"), st.integers(0, 8)),
                st.tuples(st.just("reopen"), st.just(0)),
            ),
            max_size=25,
        )

        # Defined per call so that each backend's class runs its own hypothesis test.
        @settings(max_examples=25, deadline=None)
        @given(ops=ops)
        def check(ops: list[tuple[str, int]]) -> None:
            with tempfile.TemporaryDirectory() as tmp:
                store = self.open(Path(tmp))
                margin = self.margin(store)
                records: list[tuple[int, bytes]] = []  # every record ever acknowledged
                snapshot: tuple[int, bytes] | None = None
                try:
                    for n, (op, arg) in enumerate(ops):
                        last = records[-1][0] if records else 0
                        snap_seq = snapshot[0] if snapshot else 0
                        held = [r for r in records if r[0] > snap_seq - margin] if snapshot else records
                        if op in ("append", "append_at"):
                            batch = [_payload(n * 10 + i) for i in range(arg)]
                            got = store.append(batch) if op == "append" else store.append_at(last, batch)
                            assert got == last + arg
                            records += [(last + 1 + i, p) for i, p in enumerate(batch)]
                        elif op == "stale" and last > 0:
                            with pytest.raises(StoreConflict):
                                store.append_at(max(0, last - arg), [b"stale"])
                        elif op == "gap":
                            with pytest.raises(ValueError, match="gap"):
                                store.append_at(last + arg, [b"gap"])
                        elif op == "snapshot":
                            seq = max(snap_seq, last - arg)
                            store.write_snapshot(seq, b"snap%d" % n)
                            if snapshot is None or seq > snap_seq or not store.shared:
                                snapshot = (seq, b"snap%d" % n)
                        elif op == "old snapshot" and snap_seq > 0:
                            seq = max(0, snap_seq - arg)
                            if store.shared:
                                store.write_snapshot(seq, b"old")  # ignored
                            else:
                                with pytest.raises(ValueError, match="current snapshot"):
                                    store.write_snapshot(seq, b"old")
                        elif op == "read_since":
                            x = max(0, last - arg)
                            if x >= snap_seq or any(s == x + 1 for s, _ in held):
                                want = Recovered(None, x, [r for r in records if r[0] > x])
                            else:
                                want = Recovered(snapshot[1] if snapshot else None, snap_seq, [r for r in records if r[0] > snap_seq])
                            assert store.read_since(x) == want
                        elif op == "reopen":
                            store = self.reopen(store)
                        snap_seq = snapshot[0] if snapshot else 0
                        want = Recovered(snapshot[1] if snapshot else None, snap_seq, [r for r in records if r[0] > snap_seq])
                        assert store.load() == want
                        assert store.last_seq() == (records[-1][0] if records else 0)
                finally:
                    store.close()

        check()


class TestMemoryStore(StoreContract):
    def _open(self, tmp: Path) -> Store:
        return open_store("memory://")

    def _reopen(self, store: Store) -> Store:
        return store

    def test_open_store_gives_a_memory_store(self) -> None:
        s = open_store("memory://")
        assert isinstance(s, MemoryStore)
        assert s.url == "memory://"


class TestSqliteStore(StoreContract):
    def _open(self, tmp: Path) -> Store:
        return open_store(f"sqlite:///{tmp}/store.db")

    def _reopen(self, store: Store) -> Store:
        store.close()
        return open_store(store.url)

    # -- URLs and files ---------------------------------------------------------------------------

    def test_relative_url(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.chdir(tmp_path)
        store = open_store("sqlite:///state/rel.db")
        try:
            assert isinstance(store, SqliteStore)
            assert store.path == tmp_path / "state" / "rel.db"
            assert store.path.is_file()
        finally:
            store.close()

    def test_absolute_url_creates_parent_directories(self, tmp_path: Path) -> None:
        url = f"sqlite:///{tmp_path}/a/b/c/abs.db"
        assert url.startswith("sqlite:////")
        store = open_store(url)
        try:
            assert isinstance(store, SqliteStore)
            assert store.path == tmp_path / "a" / "b" / "c" / "abs.db"
            assert store.url == url
            store.append([b"x"])
        finally:
            store.close()
        assert (tmp_path / "a" / "b" / "c" / "abs.db").is_file()

    def test_parse_url(self) -> None:
        assert parse_url("memory://") == ("memory", "")
        assert parse_url("sqlite:///rel/x.db") == ("sqlite", "rel/x.db")
        assert parse_url("sqlite:////abs/x.db") == ("sqlite", "/abs/x.db")
        assert parse_url("postgresql://u:p@h:5/db") == ("postgresql", "postgresql://u:p@h:5/db")
        assert parse_url("postgres://h/db") == ("postgresql", "postgres://h/db")
        assert parse_url("postgresql://h/?dbname=db") == ("postgresql", "postgresql://h/?dbname=db")

    @pytest.mark.parametrize(
        ("url", "why"),
        [
            ("mysql://db/x", "supported schemes are memory://, sqlite:///, postgresql://, postgres://"),
            ("sqlite:x.db", "supported schemes are memory://, sqlite:///"),
            ("/tmp/x.db", "supported schemes are memory://, sqlite:///"),
            ("", "supported schemes are memory://, sqlite:///"),
            ("sqlite://host/x.db", "sqlite URLs have no host"),
            ("sqlite://", "sqlite URLs have no host"),
            ("sqlite:///", "no database file"),
            ("sqlite:////tmp/dir/", "no database file"),
            ("memory://name", "memory:// takes nothing"),
            ("postgresql://host", "name the database"),
            ("postgres://host:5432/", "name the database"),
            ("postgresql:///", "name the database"),
        ],
    )
    def test_bad_urls(self, url: str, why: str) -> None:
        with pytest.raises(ValueError, match=why) as info:
            open_store(url)
        assert repr(url) in str(info.value)

    @pytest.mark.parametrize(
        "url",
        ["postgresql://croupier:hunter2@db:5432/", "mysql://croupier:hunter2@db/x", "postgresql://h/?user=u&password=hunter2"],
    )
    def test_bad_urls_hide_the_password(self, url: str) -> None:
        with pytest.raises(ValueError, match=r"croupier:\*\*\*@|password=\*\*\*") as info:
            open_store(url)
        assert "hunter2" not in str(info.value)

    def test_redact_url(self) -> None:
        assert redact_url("postgresql://u:p%40ss@h:1,h2:2/db?sslmode=require") == "postgresql://u:***@h:1,h2:2/db?sslmode=require"
        assert redact_url("postgres://u@h/db") == "postgres://u@h/db"
        assert redact_url("postgresql://h/db?user=u&password=pw&x=1") == "postgresql://h/db?user=u&password=***&x=1"
        assert redact_url("sqlite:///x.db") == "sqlite:///x.db"
        assert redact_url("memory://") == "memory://"

    def test_unwritable_directory_is_unavailable(self, tmp_path: Path) -> None:
        (tmp_path / "file").write_bytes(b"")
        with pytest.raises(StoreUnavailable, match="cannot create its directory") as info:
            open_store(f"sqlite:///{tmp_path}/file/sub/x.db")
        assert str(tmp_path / "file" / "sub" / "x.db") in str(info.value)

    def test_second_open_is_refused_while_the_first_is_open(self, tmp_path: Path) -> None:
        self.open(tmp_path).close()
        store = open_store(f"sqlite:///{tmp_path}/store.db")  # an existing file, opened again
        try:
            with pytest.raises(StoreUnavailable, match="second coordinator") as info:
                open_store(store.url)
            assert str(tmp_path / "store.db") in str(info.value)
            other = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    f"from croupier.server._stores import open_store; open_store({store.url!r})",
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            assert other.returncode != 0
            assert "StoreUnavailable" in other.stderr and "second coordinator" in other.stderr, other.stderr
            assert store.append([b"still mine"]) == 1
        finally:
            store.close()
        reopened = open_store(store.url)  # closing lets go of the lock
        reopened.close()

    # -- commits ---------------------------------------------------------------------------------------

    def test_each_append_is_one_commit(self, store: Store) -> None:
        """Grouping records is the caller's: one append, however many records, is one transaction."""
        assert isinstance(store, SqliteStore)
        for k in (1, 2, 64, 1):
            store.append([b"r"] * k)
        assert store.commits == 4
        assert store.load().last_seq == 68

    def test_failed_commit_acknowledges_nothing_and_poisons(self, tmp_path: Path) -> None:
        store = self.open(tmp_path)
        assert isinstance(store, SqliteStore)
        store.append([b"kept"])

        def deny_inserts(action: int, *_: object) -> int:
            return sqlite3.SQLITE_DENY if action == sqlite3.SQLITE_INSERT else sqlite3.SQLITE_OK

        store._conn.set_authorizer(deny_inserts)  # the next INSERT fails inside sqlite
        with pytest.raises(StoreUnavailable, match="cannot append") as info:
            store.append([b"lost"])
        assert str(store.path) in str(info.value)
        store._conn.set_authorizer(None)
        with pytest.raises(StoreUnavailable, match="an earlier write failed"):
            store.append([b"after"])
        with pytest.raises(StoreUnavailable, match="an earlier write failed"):
            store.write_snapshot(1, b"s")
        store.close()
        store = open_store(store.url)
        try:
            assert store.load() == Recovered(None, 0, [(1, b"kept")])
            assert store.append([b"again"]) == 2
        finally:
            store.close()

    # -- corruption ----------------------------------------------------------------------------------

    def _filled(self, tmp_path: Path, n: int = 10, snapshot: int = 0) -> Path:
        store = self.open(tmp_path)
        assert isinstance(store, SqliteStore)
        for i in range(n):
            store.append([_payload(i)])
        if snapshot:
            store.write_snapshot(snapshot, b"snapshot")
        store.close()
        return store.path

    def _corrupt(self, path: Path, match: str) -> StoreCorrupt:
        with pytest.raises(StoreCorrupt, match=match) as info:
            open_store(f"sqlite:///{path}")
        assert str(path) in str(info.value)
        return info.value

    def test_garbage_file_is_corrupt(self, tmp_path: Path) -> None:
        path = tmp_path / "garbage.db"
        path.write_bytes(os.urandom(8192))
        self._corrupt(path, "not a database")

    def test_truncated_file_is_corrupt(self, tmp_path: Path) -> None:
        path = self._filled(tmp_path, n=300)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        self._corrupt(path, "malformed")

    def test_damaged_page_is_corrupt(self, tmp_path: Path) -> None:
        path = self._filled(tmp_path, n=300)
        data = bytearray(path.read_bytes())
        page = 4096
        data[2 * page : 2 * page + 64] = bytes(b ^ 0xFF for b in data[2 * page : 2 * page + 64])
        path.write_bytes(bytes(data))
        self._corrupt(path, "is corrupt")

    def test_flipped_record_fails_its_checksum(self, tmp_path: Path) -> None:
        path = self._filled(tmp_path)
        with sqlite3.connect(path) as db:
            (payload,) = db.execute("SELECT payload FROM journal WHERE seq = 5").fetchone()
            flipped = bytes([payload[0] ^ 0x01]) + payload[1:]
            db.execute("UPDATE journal SET payload = ? WHERE seq = 5", (flipped,))
        db.close()
        self._corrupt(path, "record 5 fails its checksum")

    def test_record_moved_to_another_seq_fails_its_checksum(self, tmp_path: Path) -> None:
        path = self._filled(tmp_path)
        with sqlite3.connect(path) as db:
            db.execute("DELETE FROM journal WHERE seq = 10")
            db.execute("UPDATE journal SET seq = 10 WHERE seq = 9")
            db.execute("INSERT INTO journal SELECT 9, crc, payload FROM journal WHERE seq = 8")
        db.close()
        self._corrupt(path, "record 9 fails its checksum")

    def test_flipped_snapshot_fails_its_checksum(self, tmp_path: Path) -> None:
        path = self._filled(tmp_path, snapshot=4)
        with sqlite3.connect(path) as db:
            db.execute("UPDATE snapshot SET payload = ?", (b"Snapshot",))
        db.close()
        self._corrupt(path, "snapshot 4 fails its checksum")

    def test_text_payload_is_corrupt(self, tmp_path: Path) -> None:
        path = self._filled(tmp_path)
        with sqlite3.connect(path) as db:
            db.execute("UPDATE journal SET payload = 'text' WHERE seq = 3")
        db.close()
        self._corrupt(path, "record 3 has a payload of type str")

    @pytest.mark.parametrize(("missing", "snapshot"), [(1, 0), (5, 0), (5, 4), (9, 4)])
    def test_gap_is_corrupt(self, tmp_path: Path, missing: int, snapshot: int) -> None:
        path = self._filled(tmp_path, snapshot=snapshot)
        with sqlite3.connect(path) as db:
            db.execute("DELETE FROM journal WHERE seq = ?", (missing,))
        db.close()
        self._corrupt(path, f"journal gap: expected record {missing} .* found record {missing + 1}")

    def test_two_snapshots_are_corrupt(self, tmp_path: Path) -> None:
        path = self._filled(tmp_path, snapshot=4)
        with sqlite3.connect(path) as db:
            db.execute("INSERT INTO snapshot SELECT 3, crc, payload FROM snapshot")
        db.close()
        self._corrupt(path, "2 snapshots")

    def test_foreign_database_is_refused(self, tmp_path: Path) -> None:
        path = tmp_path / "other.db"
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE users (name TEXT)")
        db.close()
        self._corrupt(path, r"not a croupier store \(tables: \['users'\]\)")
        with sqlite3.connect(path) as db:  # and left as it was
            assert db.execute("SELECT name FROM sqlite_master").fetchall() == [("users",)]
        db.close()

    def test_missing_table_is_corrupt(self, tmp_path: Path) -> None:
        path = self._filled(tmp_path)
        with sqlite3.connect(path) as db:
            db.execute("DROP TABLE snapshot")
        db.close()
        self._corrupt(path, r"tables \['snapshot'\] are missing")

    def test_newer_schema_is_refused(self, tmp_path: Path) -> None:
        path = self._filled(tmp_path)
        with sqlite3.connect(path) as db:
            db.execute("UPDATE croupier_schema SET version = ?", (SCHEMA_VERSION + 1,))
        db.close()
        with pytest.raises(StoreVersionError, match=f"schema version {SCHEMA_VERSION + 1}, newer") as info:
            open_store(f"sqlite:///{path}")
        assert str(path) in str(info.value)


# -- PostgreSQL ------------------------------------------------------------------------------------------


def _sql(url: str, query: str, params: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
    """Runs one statement on the database at ``url`` behind the store's back; returns its rows."""
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(query, params)  # type: ignore[arg-type]
        return cur.fetchall() if cur.description else []


class TestPostgresStore(StoreContract):
    """The contract on PostgreSQL: each store in a schema of its own (a fresh database per test), pruning margin 3."""

    MARGIN = 3

    @pytest.fixture(autouse=True)
    def _database(self, postgres_url: str) -> None:
        self.db_url = postgres_url
        self.urls: dict[int, str] = {}  # id(store) -> its URL with the password
        self.schemas = 0

    def _open(self, tmp: Path) -> Store:
        self.schemas += 1
        _sql(self.db_url, f"CREATE SCHEMA s{self.schemas}")
        url = f"{self.db_url}?options=-csearch_path%3Ds{self.schemas}"
        store = PostgresStore(url, prune_margin=self.MARGIN)
        self.urls[id(store)] = url
        return store

    def _reopen(self, store: Store) -> Store:
        store.close()
        url = self.urls[id(store)]
        again = PostgresStore(url, prune_margin=self.MARGIN)
        self.urls[id(again)] = url
        return again

    def margin(self, store: Store) -> int:
        return self.MARGIN

    # -- URLs and connecting -----------------------------------------------------------------------

    def test_open_store_gives_a_postgres_store_without_the_password(self, postgres: Postgres) -> None:
        for url in (self.db_url, self.db_url.replace("postgresql://", "postgres://", 1)):
            s = open_store(url)
            try:
                assert isinstance(s, PostgresStore)
                assert s.shared is True
                assert postgres.password not in s.url and ":***@" in s.url
                assert s.url == url.replace(postgres.password, "***")
                assert s.append([b"x"]) >= 1
            finally:
                s.close()

    def test_unreachable_server_is_unavailable(self, postgres: Postgres) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))  # a port nobody listens on
            url = postgres.url("x").replace(f":{postgres.port}/", f":{sock.getsockname()[1]}/")
            with pytest.raises(StoreUnavailable, match="cannot connect: .*Connection refused") as info:
                open_store(url)
        assert postgres.password not in str(info.value) and ":***@" in str(info.value)

    def test_wrong_password_and_missing_database_are_unavailable(self, postgres: Postgres) -> None:
        with pytest.raises(StoreUnavailable, match="password authentication failed") as info:
            open_store(self.db_url.replace(postgres.password, "not-the-password"))
        assert "not-the-password" not in str(info.value)
        with pytest.raises(StoreUnavailable, match='database "no_such_db" does not exist') as info:
            open_store(postgres.url("no_such_db"))
        assert postgres.password not in str(info.value)

    def test_commits_are_synchronous_even_if_the_database_says_otherwise(self) -> None:
        dbname = self.db_url.rsplit("/", 1)[1]
        _sql(self.db_url, f"ALTER DATABASE {dbname} SET synchronous_commit = off")
        store = self.open(Path())
        assert isinstance(store, PostgresStore)
        with store._pool.connection() as conn:
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
        assert _sql(self.db_url, "SHOW synchronous_commit") == [("off",)]

    # -- the schema ---------------------------------------------------------------------------------

    def test_schema_is_prefixed_and_versioned(self) -> None:
        store = PostgresStore(self.db_url)
        store.close()
        tables = _sql(self.db_url, "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1")
        assert tables == [("croupier_journal",), ("croupier_meta",), ("croupier_snapshot",)]
        assert _sql(self.db_url, "SELECT key, value FROM croupier_meta") == [("schema_version", PG_SCHEMA_VERSION)]

    def test_replicas_starting_at_once_create_the_schema_once(self) -> None:
        barrier = threading.Barrier(4)

        def start(_: int) -> PostgresStore:
            barrier.wait()
            return PostgresStore(self.db_url)

        with ThreadPoolExecutor(4) as pool:
            stores = list(pool.map(start, range(4)))
        for s in stores:
            s.close()
        assert _sql(self.db_url, "SELECT value FROM croupier_meta") == [(PG_SCHEMA_VERSION,)]

    def test_other_tables_are_left_alone(self) -> None:
        _sql(self.db_url, "CREATE TABLE users (name text)")
        PostgresStore(self.db_url).close()
        assert _sql(self.db_url, "SELECT count(*) FROM users") == [(0,)]

    def test_newer_schema_is_refused(self, postgres: Postgres) -> None:
        PostgresStore(self.db_url).close()
        _sql(self.db_url, "UPDATE croupier_meta SET value = %s", (PG_SCHEMA_VERSION + 1,))
        with pytest.raises(StoreVersionError, match=f"schema version {PG_SCHEMA_VERSION + 1}, newer") as info:
            open_store(self.db_url)
        assert postgres.password not in str(info.value) and ":***@" in str(info.value)

    @pytest.mark.parametrize(
        ("damage", "match"),
        [
            ("DROP TABLE croupier_meta", r"croupier tables \['croupier_journal', 'croupier_snapshot'\] without croupier_meta"),
            ("DROP TABLE croupier_snapshot", r"tables \['croupier_snapshot'\] are missing"),
            ("DELETE FROM croupier_meta", "must hold one schema_version"),
        ],
    )
    def test_damaged_schema_is_corrupt(self, damage: str, match: str) -> None:
        PostgresStore(self.db_url).close()
        _sql(self.db_url, damage)
        with pytest.raises(StoreCorrupt, match=match):
            open_store(self.db_url)

    # -- checksums ------------------------------------------------------------------------------------

    def _filled(self, n: int = 10, snapshot: int = 0) -> PostgresStore:
        store = PostgresStore(self.db_url)
        self._opened.append(store)
        for i in range(n):
            store.append([_payload(i)])
        if snapshot:
            store.write_snapshot(snapshot, b"snapshot")
        return store

    def _corrupt(self, store: PostgresStore, match: str, postgres: Postgres, *, read_since: int = 0) -> None:
        """Both a running store and a new one refuse, naming the store (without its password)."""
        for call in (store.load, lambda: store.read_since(read_since), lambda: open_store(self.db_url)):
            with pytest.raises(StoreCorrupt, match=match) as info:
                call()
            assert store.url in str(info.value) and postgres.password not in str(info.value)

    def test_flipped_record_fails_its_checksum(self, postgres: Postgres) -> None:
        store = self._filled()
        _sql(self.db_url, "UPDATE croupier_journal SET payload = set_byte(payload, 0, get_byte(payload, 0) # 1) WHERE seq = 5")
        self._corrupt(store, "record 5 fails its checksum", postgres)

    def test_record_moved_to_another_seq_fails_its_checksum(self, postgres: Postgres) -> None:
        store = self._filled()
        _sql(self.db_url, "DELETE FROM croupier_journal WHERE seq = 10")
        _sql(self.db_url, "UPDATE croupier_journal SET seq = 10 WHERE seq = 9")
        _sql(self.db_url, "INSERT INTO croupier_journal SELECT 9, crc, payload FROM croupier_journal WHERE seq = 8")
        self._corrupt(store, "record 9 fails its checksum", postgres)

    def test_flipped_snapshot_fails_its_checksum(self, postgres: Postgres) -> None:
        store = self._filled(snapshot=4)
        _sql(self.db_url, "UPDATE croupier_snapshot SET payload = 'Snapshot'::bytea")
        self._corrupt(store, "snapshot 4 fails its checksum", postgres)

    @pytest.mark.parametrize(("missing", "snapshot"), [(1, 0), (5, 0), (6, 4), (9, 4)])
    def test_gap_is_corrupt(self, postgres: Postgres, missing: int, snapshot: int) -> None:
        store = self._filled(snapshot=snapshot)
        _sql(self.db_url, "DELETE FROM croupier_journal WHERE seq = %s", (missing,))
        self._corrupt(store, f"journal gap: expected record {missing} .* found record {missing + 1}", postgres,
                      read_since=max(snapshot, missing - 1))

    # -- shared-store behaviour -----------------------------------------------------------------------

    def test_pruning_keeps_a_margin_before_the_snapshot(self) -> None:
        store = PostgresStore(self.db_url, prune_margin=5)
        self._opened.append(store)
        store.append([_payload(s) for s in range(1, 21)])
        store.write_snapshot(15, b"s15")
        assert _sql(self.db_url, "SELECT min(seq), max(seq) FROM croupier_journal") == [(11, 20)]
        assert store.load() == Recovered(b"s15", 15, [(s, _payload(s)) for s in range(16, 21)])
        assert store.read_since(10) == Recovered(None, 10, [(s, _payload(s)) for s in range(11, 21)])
        assert store.read_since(9) == store.load()
        assert PostgresStore.__init__.__kwdefaults__["prune_margin"] == PRUNE_MARGIN == 10_000  # type: ignore[index]


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("postgresql://u:p%zzhunter2@h/db", "invalid percent-encoded token"),
        ("postgresql://u:hunter2@h/db?bogus=1", "invalid URI query parameter"),
        ("postgresql://h/db?user=u&password=hunter2&bogus=1", "invalid URI query parameter"),
    ],
)
def test_unreadable_postgres_urls_hide_the_password(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as info:
        PostgresStore(url)
    assert "hunter2" not in str(info.value) and "***" in str(info.value)


def test_postgres_store_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"timeout must be > 0 seconds \(got timeout=0\)"):
        PostgresStore("postgresql://h/db", timeout=0)
    with pytest.raises(TypeError, match="prune_margin must be an int"):
        PostgresStore("postgresql://h/db", prune_margin=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"prune_margin must be >= 0 \(got prune_margin=-1\)"):
        PostgresStore("postgresql://h/db", prune_margin=-1)


def _two_stores(url: str, **kw: Any) -> tuple[PostgresStore, PostgresStore]:
    return PostgresStore(url, **kw), PostgresStore(url, **kw)


def test_two_threads_racing_for_one_seq_one_wins(postgres_url: str) -> None:
    """Two replicas (two pools) append at the same expected_last at the same moment: one wins, the other conflicts."""
    a, b = _two_stores(postgres_url)
    barrier = threading.Barrier(2)

    def race(store: PostgresStore, name: bytes, expected: int) -> bool:
        barrier.wait()
        try:
            store.append_at(expected, [name])
        except StoreConflict:
            return False
        return True

    try:
        with ThreadPoolExecutor(2) as pool:
            for expected in range(40):
                wa, wb = pool.submit(race, a, b"a%d" % expected, expected), pool.submit(race, b, b"b%d" % expected, expected)
                won = [wa.result(), wb.result()]
                assert won.count(True) == 1, (expected, won)
                winner = b"a%d" % expected if won[0] else b"b%d" % expected
                assert a.read_since(expected) == Recovered(None, expected, [(expected + 1, winner)])
        assert [s for s, _ in b.load().records] == list(range(1, 41))
    finally:
        a.close()
        b.close()


#: A replica in a child process. ``lockstep``: for each line ``E`` on stdin, append_at(E) once and
#: print ``won E`` or ``lost E``. ``free``: N times, append at the seq it knows and catch up with
#: read_since on a conflict; print ``won SEQ`` for each of its records.
REPLICA = textwrap.dedent(
    """
    import sys
    from croupier.server._store import StoreConflict
    from croupier.server._stores import open_store

    url, name, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    store = open_store(url)
    print("ready", flush=True)
    if mode == "lockstep":
        for line in sys.stdin:
            e = int(line)
            try:
                store.append_at(e, [b"%s:%d" % (name.encode(), e + 1)])
                print("won", e, flush=True)
            except StoreConflict:
                print("lost", e, flush=True)
    else:
        pos, n = store.last_seq(), int(mode)
        while n:
            try:
                pos = store.append_at(pos, [b"%s:%d" % (name.encode(), pos + 1)])
                print("won", pos, flush=True)
                n -= 1
            except StoreConflict:
                pos = store.read_since(pos).last_seq
    store.close()
    """
)


def _replicas(tmp_path: Path, url: str, mode: str) -> list[subprocess.Popen[str]]:
    script = tmp_path / "replica.py"
    script.write_text(REPLICA)
    procs = [
        subprocess.Popen([sys.executable, str(script), url, name, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, cwd=tmp_path)
        for name in ("p", "q")
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return procs


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_two_processes_racing_for_one_seq_one_wins(tmp_path: Path, postgres_url: str) -> None:
    procs = _replicas(tmp_path, postgres_url, "lockstep")
    try:
        for e in range(30):
            for p in procs:
                assert p.stdin is not None
                p.stdin.write(f"{e}\n")
                p.stdin.flush()
            answers = [p.stdout.readline().split() for p in procs if p.stdout is not None]
            assert sorted(a[0] for a in answers) == ["lost", "won"], (e, answers)
            winner = "pq"[[a[0] for a in answers].index("won")]
            assert _sql(postgres_url, "SELECT payload FROM croupier_journal WHERE seq = %s", (e + 1,)) == [(f"{winner}:{e + 1}".encode(),)]
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
            assert p.wait(timeout=30) == 0


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_two_processes_appending_freely_never_write_one_seq_twice(tmp_path: Path, postgres_url: str) -> None:
    """Each appends 150 records at the seq it knows, catching up on conflicts: one contiguous journal, every win in it."""
    procs = _replicas(tmp_path, postgres_url, "150")
    wins: dict[int, str] = {}
    for p, name in zip(procs, "pq"):
        assert p.stdin is not None and p.stdout is not None
        p.stdin.close()
        out = p.stdout.read()  # not communicate(): it would skip what readline() already buffered
        assert p.wait(timeout=90) == 0
        for line in out.splitlines():
            seq = int(line.split()[1])
            assert seq not in wins, f"seq {seq} won by both"
            wins[seq] = name
    store = PostgresStore(postgres_url)
    try:
        got = store.load()
    finally:
        store.close()
    assert [s for s, _ in got.records] == list(range(1, 301)) == sorted(wins)
    assert all(p == f"{wins[s]}:{s}".encode() for s, p in got.records)


def test_read_since_catches_a_replica_up(postgres_url: str) -> None:
    a, b = _two_stores(postgres_url, prune_margin=4)
    try:
        assert a.append_at(0, [b"a1", b"a2", b"a3"]) == 3
        assert b.last_seq() == 3
        caught = b.read_since(0)
        assert caught == Recovered(None, 0, [(1, b"a1"), (2, b"a2"), (3, b"a3")])
        assert b.append_at(caught.last_seq, [b"b4"]) == 4
        with pytest.raises(StoreConflict):
            a.append_at(3, [b"a4"])
        assert a.read_since(3) == Recovered(None, 3, [(4, b"b4")])
        a.append_at(4, [b"a%d" % s for s in range(5, 13)])
        a.write_snapshot(10, b"s10")  # keeps 7.. (margin 4)
        assert b.read_since(6) == Recovered(None, 6, [(s, b"a%d" % s) for s in range(7, 13)])  # a little behind: records
        assert b.read_since(4) == Recovered(b"s10", 10, [(11, b"a11"), (12, b"a12")])  # far behind: the snapshot
    finally:
        a.close()
        b.close()


def test_snapshots_from_two_writers_keep_the_newest(postgres_url: str) -> None:
    a, b = _two_stores(postgres_url)
    try:
        a.append([_payload(s) for s in range(1, 101)])
        a.write_snapshot(8, b"a8")
        b.write_snapshot(5, b"b5")  # older: ignored
        b.write_snapshot(8, b"b8")  # as old: ignored
        assert (b.load().snapshot, b.load().snapshot_seq) == (b"a8", 8)
        b.write_snapshot(10, b"b10")
        assert (a.load().snapshot, a.load().snapshot_seq) == (b"b10", 10)
        seqs = random.Random(7).sample(range(11, 101), 40)

        def write(store: PostgresStore, mine: list[int]) -> None:
            for s in mine:
                store.write_snapshot(s, b"s%d" % s)

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(write, (a, b), (seqs[::2], seqs[1::2])))
        top = max(seqs)
        assert a.load() == Recovered(b"s%d" % top, top, [(s, _payload(s)) for s in range(top + 1, 101)])
    finally:
        a.close()
        b.close()


@pytest.mark.e2e
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_a_server_restart_loses_nothing_acknowledged(postgres: Postgres, postgres_url: str, mode: str) -> None:
    """Down: every call raises StoreUnavailable (no password in it). Up again: the same store objects work.

    Then a writer appends without pause through ``pg_ctl restart -m MODE``: every append it saw
    acknowledged is in the database afterwards, and nothing else fails than StoreUnavailable.
    """
    a, b = _two_stores(postgres_url, timeout=1.0)
    acked: dict[int, bytes] = {}
    try:
        for i in range(5):
            acked[a.append_at(i, [b"before%d" % i])] = b"before%d" % i
        postgres.stop(mode)
        calls: list[Callable[[], object]] = [
            lambda: a.append_at(5, [b"down"]), lambda: a.append([b"down"]), a.last_seq, a.load,
            lambda: b.read_since(0), lambda: b.write_snapshot(5, b"down"),
        ]
        for call in calls:
            with pytest.raises(StoreUnavailable, match="no connection to the database|server closed|terminat") as info:
                call()
            assert postgres.password not in str(info.value) and ":***@" in str(info.value)
        postgres.start()
        assert a.last_seq() == 5  # the first call after the outage, on the same object
        acked[a.append_at(5, [b"after"])] = b"after"
        assert b.read_since(5) == Recovered(None, 5, [(6, b"after")])

        stop = threading.Event()
        errors: list[BaseException] = []

        def writer() -> None:
            pos, n = 6, 0
            while not stop.is_set():
                n += 1
                payload = b"w%d" % n
                try:
                    acked[a.append_at(pos, [payload])] = payload
                    pos += 1
                except StoreUnavailable as e:  # the outcome of that commit is unknown: re-read
                    errors.append(e)
                except StoreConflict:  # it was committed after all: catch up
                    pos = a.last_seq()
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)
                    return

        thread = threading.Thread(target=writer)
        thread.start()
        try:
            while len(acked) < 30:
                thread.join(0.01)
            postgres.restart(mode)
            seen = len(acked)
            while len(acked) < seen + 30 and thread.is_alive():
                thread.join(0.01)
        finally:
            stop.set()
            thread.join()
        assert all(isinstance(e, StoreUnavailable) and postgres.password not in str(e) for e in errors), errors
        got = b.load()
        held = dict(got.records)
        assert [s for s, _ in got.records] == list(range(1, got.last_seq + 1))
        lost = {s: p for s, p in acked.items() if held.get(s) != p}
        assert not lost, f"acknowledged records lost or changed after restart -m {mode}: {sorted(lost)}"
        print(f"\nrestart -m {mode}: {len(acked)} acknowledged appends, each found; {len(errors)} StoreUnavailable")
    finally:
        a.close()
        b.close()


def test_the_interface_loads_no_backend() -> None:
    """Importing the interface loads no backend; open_store loads the one a URL names, and only it."""
    code = (
        "import sys\n"
        "from croupier.server._stores import open_store\n"
        "loaded = lambda: [m for m in ('sqlite3', 'psycopg', 'psycopg_pool', 'croupier.server._sqlite_store', "
        "'croupier.server._pg_store', 'croupier.server._memory_store') if m in sys.modules]\n"
        "print(loaded())\n"
        "open_store('memory://').close()\n"
        "print(loaded())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[]", "['croupier.server._memory_store']"], out


# -- kill -9 --------------------------------------------------------------------------------------------

#: The one writer a store has (see Store), appending batches of 1 to ``max_batch`` records as the
#: coordinator's writer does and printing each acknowledgement as soon as ``append`` returns:
#: ``A <last seq> <payload hex> ...``. Every ``snapshot_every`` appends it writes a snapshot and
#: prints ``S <seq>`` once it is durable. Snapshots only cover records that were in the store when
#: the child started, which the parent has already checked byte for byte after the previous kill.
CHILD = textwrap.dedent(
    """
    import random, sys
    from croupier.server._stores import open_store

    url, round_no, max_batch, snapshot_every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    store = open_store(url)
    start = store.load()
    rng = random.Random(round_no)

    def say(line):
        sys.stdout.write(line + "\\n")
        sys.stdout.flush()

    n = 0
    appends = 0
    while True:
        k = rng.randint(1, max_batch)
        names = [b"%d:%d:" % (round_no, n + i) for i in range(k)]
        payloads = [name + rng.randbytes(rng.randint(0, 48)) for name in names]
        n += k
        last = store.append(payloads)
        say("A %d %s" % (last, " ".join(p.hex() for p in payloads)))
        appends += 1
        if snapshot_every and appends % snapshot_every == 0:
            seq = min(start.last_seq, start.snapshot_seq + 40 * appends // snapshot_every)
            store.write_snapshot(seq, b"snapshot@%d" % seq)
            say("S %d" % seq)
    """
)


def _kill_rounds(
    tmp_path: Path, rounds: int, acks: tuple[int, int], max_batch: int, seed: int, url: str | None = None
) -> tuple[int, int]:
    """Runs ``rounds`` children on one store (``url``, or a sqlite file), each killed with SIGKILL after a random number of acks.

    After every kill, the store MUST hold every acknowledged record (exact payload) that its
    snapshot does not cover, a snapshot no older than the last acknowledged one, contiguous
    sequence numbers, and no record twice.

    Returns:
        (acknowledged appends, acknowledged records), every record checked byte for byte after
        the kill that ended the round it was acknowledged in.
    """
    rng = random.Random(seed)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    url = url or f"sqlite:///{tmp_path}/kill.db"
    acked: dict[int, bytes] = {}
    acked_snapshot = 0
    ack_lines = 0
    verified: set[int] = set()
    for r in range(1, rounds + 1):
        target = rng.randint(*acks)
        log = tmp_path / f"child-{r}.err"
        with log.open("wb") as err:
            child = subprocess.Popen(
                [sys.executable, str(script), url, str(r), str(max_batch), "10"],
                stdout=subprocess.PIPE,
                stderr=err,
                cwd=tmp_path,
            )
        assert child.stdout is not None
        lines: list[bytes] = []
        try:
            seen = 0
            while seen < target:
                line = child.stdout.readline()
                if not line:
                    pytest.fail(
                        f"round {r}: child exited ({child.wait()}) after {seen} acks: {log.read_text()}"
                    )
                lines.append(line)
                seen += line.startswith(b"A ")
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            lines += child.stdout.read().splitlines(keepends=True)  # acks printed before the kill
            child.stdout.close()
            child.wait()
        assert child.returncode == -signal.SIGKILL
        for line in lines:
            if not line.endswith(b"\n"):
                continue  # cut short by the kill
            kind, *fields = line.split()
            if kind == b"S":
                acked_snapshot = max(acked_snapshot, int(fields[0]))
                continue
            ack_lines += 1
            last = int(fields[0])
            for i, hexed in enumerate(fields[1:]):
                seq = last - len(fields) + 2 + i
                assert seq not in acked, f"round {r}: seq {seq} acknowledged twice"
                acked[seq] = bytes.fromhex(hexed.decode())

        store = open_store(url)
        try:
            got = store.load()
        finally:
            store.close()
        ctx = f"round {r} (seed {seed})"
        assert got.snapshot_seq >= acked_snapshot, ctx
        if got.snapshot is not None:
            assert got.snapshot == b"snapshot@%d" % got.snapshot_seq, ctx
        assert [s for s, _ in got.records] == list(range(got.snapshot_seq + 1, got.last_seq + 1)), ctx
        top, end = max(acked), got.last_seq
        assert top <= end, f"{ctx}: acknowledged up to {top}, the store ends at {end}"
        held = dict(got.records)
        for seq, payload in acked.items():
            if seq > got.snapshot_seq:
                assert held.get(seq) == payload, f"{ctx}: acknowledged record {seq} lost or changed"
                verified.add(seq)
        names = [p.split(b":")[:2] for _, p in got.records]
        assert len(set(map(tuple, names))) == len(names), f"{ctx}: a record is stored twice"
        assert all(int(name[0]) <= r for name in names), ctx
        assert verified == set(acked), f"{ctx}: a snapshot covered records acknowledged in this round"
    return ack_lines, len(acked)


def _report(rounds: int, result: tuple[int, int]) -> None:
    ack_lines, records = result
    print(
        f"\nkill -9: {rounds} kills; {ack_lines} acknowledged appends of {records} records, "
        "each found byte for byte"
    )


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_acknowledged_appends_survive_kill_9(tmp_path: Path) -> None:
    rounds = 10
    result = _kill_rounds(tmp_path, rounds, acks=(50, 300), max_batch=8, seed=1234)
    _report(rounds, result)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_acknowledged_appends_survive_kill_9_postgres(tmp_path: Path, postgres_url: str) -> None:
    """The same on PostgreSQL: the writer is killed mid-loop (mid-commit, often); the server keeps running."""
    rounds = 10
    result = _kill_rounds(tmp_path, rounds, acks=(50, 300), max_batch=8, seed=4321, url=postgres_url)
    _report(rounds, result)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_acknowledged_appends_survive_kill_9_long(tmp_path: Path) -> None:
    rounds = 100
    result = _kill_rounds(tmp_path, rounds, acks=(1, 2000), max_batch=16, seed=random.randrange(2**32))
    _report(rounds, result)


# -- the benchmark -----------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_store_bench_quick_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "store_bench.py"), "--quick", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [row[0] for row in rows] == ["1", "8", "64"], out.stdout
    assert "p99 ms" in out.stdout
