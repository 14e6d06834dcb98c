"""The store contract on PostgreSQL, its own checks, and several writers (threads, processes) sharing one database."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from _store_contract import StoreContract, _payload

from croupier.server._pg_store import PRUNE_MARGIN, PostgresStore
from croupier.server._pg_store import SCHEMA_VERSION as PG_SCHEMA_VERSION
from croupier.server._store import (
    Recovered,
    Store,
    StoreConflict,
    StoreCorrupt,
    StoreUnavailable,
    StoreVersionError,
)
from croupier.server._stores import open_store

if TYPE_CHECKING:
    from _postgres import Postgres

#: The fixtures postgres (the session's server) and postgres_url (a fresh database per test).
pytest_plugins = ["_postgres"]


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
                except BaseException as e:  # reported below
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
