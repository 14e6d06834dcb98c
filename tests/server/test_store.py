"""The store contract on the memory and SQLite backends, each backend's own checks, and kill -9 durability."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _store_contract import StoreContract, _payload

from croupier.server._memory_store import MemoryStore
from croupier.server._sqlite_store import SCHEMA_VERSION, SqliteStore
from croupier.server._store import (
    Recovered,
    Store,
    StoreCorrupt,
    StoreUnavailable,
    StoreVersionError,
    parse_url,
    redact_url,
)
from croupier.server._stores import open_store

ROOT = Path(__file__).resolve().parents[2]

#: The fixtures postgres (the session's server) and postgres_url (a fresh database per test).
pytest_plugins = ["_postgres"]


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


@pytest.mark.exhaustive  # a benchmark's quick run: in make test, not in make check
@pytest.mark.timeout(120)
def test_store_bench_quick_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "store_bench.py"), "--quick", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if len(line.split()) == 10 and line.split()[0].isdigit()]
    assert [row[0] for row in rows] == ["1", "8", "64"], out.stdout
    assert "p99 ms" in out.stdout
    # the joins table: its floor, this tree's coordinator at 1 and 32 joins in flight, the empty calls' ceiling
    lines = out.stdout.splitlines()
    assert [line.split()[2] for line in lines if line.startswith("this tree ")] == ["1", "32"], out.stdout
    assert [line.split()[0] for line in lines if line.startswith(("floor ", "empty "))] == ["floor", "empty"], out.stdout
