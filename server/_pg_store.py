"""The ``postgresql://`` store: one journal and snapshot in a PostgreSQL database, shared by every replica."""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
import psycopg.errors
import psycopg_pool
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from croupier.core.checks import check_int, check_seconds, is_int
from croupier.server._pg_watch import JournalWatch
from croupier.server._store import (
    Recovered,
    StoreConflict,
    StoreCorrupt,
    StoreUnavailable,
    StoreVersionError,
    as_bytes,
    check_expected_last,
    check_records,
    check_seq,
    record_crc,
    redact_url,
)

__all__ = ["PRUNE_MARGIN", "SCHEMA_VERSION", "PostgresStore"]

#: The layout this module writes (in ``croupier_meta``); a database with a newer one is refused.
SCHEMA_VERSION = 1

#: Records a snapshot leaves in the journal before it (see :class:`PostgresStore`).
PRUNE_MARGIN = 10_000

#: The advisory lock that serializes creating and migrating the schema: "croupier" as an int64.
_SCHEMA_LOCK = int.from_bytes(b"croupier", "big")

#: What each schema version adds to the one before it; ``croupier_meta`` itself comes first.
_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        "CREATE TABLE croupier_journal ("
        " seq bigint PRIMARY KEY CHECK (seq > 0), crc bigint NOT NULL, payload bytea NOT NULL)",
        "CREATE TABLE croupier_snapshot ("
        " id smallint PRIMARY KEY CHECK (id = 1), seq bigint NOT NULL CHECK (seq >= 0),"
        " crc bigint NOT NULL, payload bytea NOT NULL)",
    ),
}
_TABLES = frozenset({"croupier_meta", "croupier_journal", "croupier_snapshot"})

#: Connection settings croupier sets when the URL does not: fail fast, notice a dead peer.
_DEFAULTS = {
    "connect_timeout": "5",
    "application_name": "croupier",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
}

_LAST = (
    "GREATEST((SELECT COALESCE(max(seq), 0) FROM croupier_journal),"
    " (SELECT COALESCE(max(seq), 0) FROM croupier_snapshot))"
)

# One statement, so one snapshot of the database: the check and the insert are atomic, and two
# writers that both saw `expected` collide on the primary key (the second gets UniqueViolation).
# It notifies the replicas' watches of the new last seq (with the schema: one database may hold
# several), in the same transaction: the notification goes out when the records are committed.
_APPEND_AT = f"""
WITH cur AS (SELECT {_LAST} AS last),
ins AS (
    INSERT INTO croupier_journal (seq, crc, payload)
    SELECT t.seq, t.crc, t.payload
    FROM unnest(%(seqs)s::bigint[], %(crcs)s::bigint[], %(payloads)s::bytea[]) AS t(seq, crc, payload), cur
    WHERE cur.last = %(expected)s
    RETURNING 1
),
note AS (
    SELECT pg_notify('croupier_journal', current_schema() || ':' || (%(expected)s::bigint + n)::text)
    FROM (SELECT count(*) AS n FROM ins) AS c WHERE c.n > 0
)
SELECT (SELECT last FROM cur), (SELECT count(*) FROM ins), (SELECT count(*) FROM note)
"""

# Kind 0: the snapshot; kind 2: the records after it, in order.
_LOAD = """
SELECT 0, seq, crc, payload FROM croupier_snapshot
UNION ALL
SELECT 2, seq, crc, payload FROM croupier_journal
WHERE seq > COALESCE((SELECT seq FROM croupier_snapshot), 0)
ORDER BY 1, 2
"""

# Kind 0: the snapshot; kind 1: (the last seq, where the records start); kind 2: those records.
# They start right after %(x)s if record x + 1 is still held (or nothing was pruned past x),
# else right after the snapshot.
_READ_SINCE = f"""
WITH snap AS (SELECT seq, crc, payload FROM croupier_snapshot),
pos AS (
    SELECT CASE WHEN %(x)s >= COALESCE((SELECT seq FROM snap), 0)
                  OR EXISTS (SELECT 1 FROM croupier_journal WHERE seq = %(x)s + 1)
                THEN %(x)s ELSE (SELECT seq FROM snap) END AS after
)
SELECT 0, seq, crc, payload FROM snap
UNION ALL
SELECT 1, {_LAST}, (SELECT after FROM pos), NULL
UNION ALL
SELECT 2, seq, crc, payload FROM croupier_journal WHERE seq > (SELECT after FROM pos)
ORDER BY 1, 2
"""

_UPSERT_SNAPSHOT = """
INSERT INTO croupier_snapshot (id, seq, crc, payload) VALUES (1, %(seq)s, %(crc)s, %(payload)s)
ON CONFLICT (id) DO UPDATE SET seq = EXCLUDED.seq, crc = EXCLUDED.crc, payload = EXCLUDED.payload
WHERE croupier_snapshot.seq < EXCLUDED.seq
"""

_PRUNE = "DELETE FROM croupier_journal WHERE seq <= (SELECT seq FROM croupier_snapshot) - %(margin)s"

Connection = psycopg.Connection[tuple[Any, ...]]


def _configure(conn: Connection) -> None:
    """Every connection: autocommit (each statement its own transaction unless in ``transaction()``), durable commits."""
    conn.autocommit = True
    row = conn.execute("SHOW synchronous_commit").fetchone()
    if row is not None and row[0] == "off":
        # Set off for the database or role: a commit could return before its WAL is flushed.
        conn.execute("SET synchronous_commit = on")


def _secrets_in(url: str, whole: bool = False) -> tuple[str, ...]:
    """The password in ``url`` (or ``url`` itself if ``whole``), as written and percent-decoded; to scrub from messages."""
    found: list[str] = []
    if whole:
        found.append(url)
    else:
        netloc, _, tail = url.partition("://")[2].partition("/")
        userinfo = netloc.rpartition("@")[0]
        if ":" in userinfo:
            found.append(userinfo.partition(":")[2])
        for param in tail.partition("?")[2].split("&"):
            key, _, value = param.partition("=")
            if urllib.parse.unquote(key) == "password":
                found.append(value)
    out = {v for s in found for v in (s, urllib.parse.unquote(s), urllib.parse.quote(s, safe="")) if s}
    return tuple(sorted(out, key=len, reverse=True))  # longest first: no partial replacement left behind


class PostgresStore:
    """A store in a PostgreSQL database (``postgresql://``), shared by every coordinator replica.

    Three tables in the connection's current schema: ``croupier_meta`` (the schema version),
    ``croupier_journal`` (seq PRIMARY KEY, crc, payload) and ``croupier_snapshot`` (one row).
    Each record and the snapshot carry a CRC32 of (seq, payload), as in the sqlite store;
    :meth:`load` and :meth:`read_since` verify them and that the records are contiguous. The
    first croupier to open a database creates the schema, under an advisory lock so that
    replicas starting at once do not race; a later croupier migrates it forward.

    :meth:`append_at` is one statement, so one transaction and one commit: it inserts the
    records only if the journal ends at ``expected_last`` when the statement starts, and a
    concurrent writer that checked at the same time fails on the primary key; both cases are
    :class:`StoreConflict`. Commits use ``synchronous_commit`` as the server has it (on, by
    default, and turned back on for croupier's sessions if it is off).

    NOTE: A snapshot prunes only the records more than ``prune_margin`` (default
    :data:`PRUNE_MARGIN`) before it. Another replica that was a little behind when it was
    written catches up with :meth:`read_since` by records, keeping its state, instead of
    rebuilding from the snapshot.

    NOTE: Connections come from a small pool (psycopg_pool) that checks each one before use, so
    after the server restarts, or a connection is cut, the next call reconnects. While the
    server cannot be reached, each call waits up to ``timeout`` seconds for a connection, then
    raises :class:`StoreUnavailable`. Unlike the sqlite store, a failed commit does not poison
    the store: the database stays the one truth, and the caller re-reads it. Calls from several
    threads are safe (each takes a connection of its own), though the contract asks for one.

    Attributes:
        url: The URL, with its password replaced by ``***``.
        shared: True: any number of processes may open the same database.
        timeout: Seconds a call waits for a connection.
        prune_margin: Records a snapshot leaves before it.
    """

    shared = True

    def __init__(self, url: str, *, timeout: float = 5.0, prune_margin: int = PRUNE_MARGIN) -> None:
        """Connects, creates or migrates the schema, and verifies what the database holds.

        Args:
            url: ``postgresql://user:password@host:port/dbname?params`` (or ``postgres://``).
            timeout: Seconds a call waits for a connection before :class:`StoreUnavailable`.
            prune_margin: Records a snapshot leaves in the journal before it.

        Raises:
            ValueError: If the URL cannot be read as a libpq connection string, or an argument
                is out of range.
            StoreUnavailable: If the server cannot be reached or refuses the connection.
            StoreCorrupt: If the croupier tables are incomplete or hold something that does not
                verify.
            StoreVersionError: If the database has a newer croupier schema.
        """
        self.url = redact_url(url)
        self.timeout = check_seconds("timeout", timeout)
        self.prune_margin = check_int("prune_margin", prune_margin, 0)
        self._closed = False
        self._close_lock = threading.Lock()
        self._secrets = _secrets_in(url)
        try:
            params = conninfo_to_dict(url)
        except psycopg.Error as exc:
            raise ValueError(f"store URL {self.url!r} is not a PostgreSQL URL libpq reads: {self._reason(exc)}") from None
        self._secrets += _secrets_in(str(params.get("password") or ""), whole=True)
        conninfo = make_conninfo(url, **{k: v for k, v in _DEFAULTS.items() if k not in params})
        self._conninfo = conninfo
        self._watch: JournalWatch | None = None

        try:
            conn = psycopg.connect(conninfo)
        except psycopg.Error as exc:
            raise self._unavailable("cannot connect", exc) from None
        try:
            with conn:
                _configure(conn)
                self._migrate(conn)
                self._load(conn)  # verify before serving
        except psycopg.Error as exc:
            raise self._translate("cannot open", exc) from None

        self._pool: psycopg_pool.ConnectionPool[Connection] = psycopg_pool.ConnectionPool(
            conninfo,
            min_size=1,
            max_size=2,
            open=False,
            configure=_configure,
            check=psycopg_pool.ConnectionPool.check_connection,
            name=self.url,
            timeout=self.timeout,
            # Give up a reconnection chain soon: the next call then tries at once, instead of
            # waiting out a backoff that grew during a long outage.
            reconnect_timeout=self.timeout,
            num_workers=2,
        )
        try:
            self._pool.open(wait=True, timeout=self.timeout)
        except psycopg.Error as exc:
            self._pool.close(timeout=1.0)
            raise self._unavailable("cannot open a connection pool", exc) from None

    # -- errors -------------------------------------------------------------------------------

    def _reason(self, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {str(exc).strip()}"
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _unavailable(self, doing: str, exc: BaseException, hint: str = "", waited: float | None = None) -> StoreUnavailable:
        if isinstance(exc, psycopg_pool.PoolTimeout):
            if waited is not None and waited < self.timeout:
                why = f"no connection to the database within the {waited:.3g} s left to the call's deadline"
            else:
                why = f"no connection to the database within {self.timeout:g} s (is the server up and reachable?)"
        else:
            why = self._reason(exc)
        return StoreUnavailable(f"postgresql store {self.url}: {doing}: {why}{hint}")

    def _corrupt(self, what: str) -> StoreCorrupt:
        return StoreCorrupt(f"postgresql store {self.url} is corrupt: {what}")

    def _translate(self, doing: str, exc: psycopg.Error) -> StoreCorrupt | StoreUnavailable:
        if isinstance(exc, (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn)):
            return self._corrupt(f"{doing}: the croupier tables changed under it: {self._reason(exc)}")
        return self._unavailable(doing, exc)

    @contextlib.contextmanager
    def _connection(self, doing: str, hint: str = "", deadline: float | None = None) -> Iterator[Connection]:
        """A pooled connection; psycopg errors leave as :class:`StoreUnavailable` (or corrupt).

        NOTE: the checkout waits at most ``timeout``, and no longer than what is left to `deadline`, the
        deadline of the call that asks (``time.monotonic()``; see ``croupier.server._store.Store``); a
        call past its deadline gets no connection at all: its caller is gone.
        """
        if self._closed:
            raise StoreUnavailable(f"postgresql store {self.url} is closed")
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if left is not None and left <= 0:
            raise StoreUnavailable(f"postgresql store {self.url}: {doing}: the call's deadline passed: not asked")
        wait = self.timeout if left is None else min(self.timeout, left)
        used: Connection | None = None
        try:
            with self._pool.connection(timeout=wait) as conn:
                used = conn
                yield conn
        except psycopg.Error as exc:
            if used is not None and used.closed:  # lost mid-call, not refused by the server
                raise self._unavailable(doing, exc, hint) from exc
            if isinstance(exc, psycopg_pool.PoolTimeout):
                raise self._unavailable(doing, exc, waited=wait) from exc  # nothing was sent
            raise self._translate(doing, exc) from exc

    # -- the schema ---------------------------------------------------------------------------

    def _migrate(self, conn: Connection) -> None:
        """Creates the schema, or brings an older one up to :data:`SCHEMA_VERSION`; one transaction."""
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            tables = self._tables(conn)
            if "croupier_meta" not in tables:
                if tables:
                    raise self._corrupt(f"croupier tables {sorted(tables)} without croupier_meta (its schema version)")
                conn.execute("CREATE TABLE croupier_meta (key text PRIMARY KEY, value bigint NOT NULL)")
                conn.execute("INSERT INTO croupier_meta (key, value) VALUES ('schema_version', 0)")
                version = 0
            else:
                rows = conn.execute("SELECT value FROM croupier_meta WHERE key = 'schema_version'").fetchall()
                if len(rows) != 1:
                    raise self._corrupt(f"croupier_meta must hold one schema_version (holds {len(rows)})")
                version = int(rows[0][0])
            if version > SCHEMA_VERSION:
                raise StoreVersionError(
                    f"postgresql store {self.url} has schema version {version}, newer than the newest this "
                    f"croupier knows ({SCHEMA_VERSION}); use the croupier that wrote it"
                )
            if version < 0 or (version == 0 and tables):
                raise self._corrupt(f"schema version must be >= 1 (got {version})")
            for step in range(version + 1, SCHEMA_VERSION + 1):
                for ddl in _MIGRATIONS[step]:
                    conn.execute(ddl)
            if version < SCHEMA_VERSION:
                conn.execute("UPDATE croupier_meta SET value = %s WHERE key = 'schema_version'", (SCHEMA_VERSION,))
            if missing := sorted(_TABLES - self._tables(conn)):
                raise self._corrupt(f"schema version {version} but tables {missing} are missing")

    @staticmethod
    def _tables(conn: Connection) -> set[str]:
        rows = conn.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p') AND c.relname = ANY(%s)",
            (sorted(_TABLES),),
        ).fetchall()
        return {str(name) for (name,) in rows}

    # -- reading ------------------------------------------------------------------------------

    def _verified(self, what: str, seq: object, crc: object, payload: object) -> tuple[int, bytes]:
        if not is_int(seq) or not isinstance(payload, bytes):
            raise self._corrupt(f"{what} {seq!r} has a seq or payload of the wrong type")
        if crc != record_crc(seq, payload):
            raise self._corrupt(
                f"{what} {seq} fails its checksum (stored {crc!r}, computed {record_crc(seq, payload)}, "
                f"{len(payload)} bytes)"
            )
        return seq, payload

    def _recovered(self, rows: list[tuple[Any, ...]], since: int | None) -> tuple[Recovered, int]:
        """Verifies the rows of ``_LOAD`` (``since`` None) or ``_READ_SINCE``; returns what they hold and the last seq."""
        snapshot: bytes | None = None
        snapshot_seq = 0
        last = 0
        after: int | None = None
        records: list[tuple[int, bytes]] = []
        for kind, seq, crc, payload in rows:
            if kind == 0:
                snapshot_seq, snapshot = self._verified("snapshot", seq, crc, payload)
            elif kind == 1:
                last, after = int(seq), int(crc)
            else:
                records.append(self._verified("record", seq, crc, payload))
        if since is not None and after == since:
            snapshot, snapshot_seq = None, since  # the reader keeps its state and applies the records
        for expected, (seq, _) in enumerate(records, start=snapshot_seq + 1):
            if seq != expected:
                raise self._corrupt(
                    f"journal gap: expected record {expected} after record {expected - 1}, found record {seq}"
                )
        return Recovered(snapshot, snapshot_seq, records), last

    def _load(self, conn: Connection) -> Recovered:
        return self._recovered(conn.execute(_LOAD, binary=True).fetchall(), None)[0]

    def load(self) -> Recovered:
        """See :meth:`Store.load`: one statement, so one consistent view of the database."""
        with self._connection("cannot read") as conn:
            return self._load(conn)

    def read_since(self, seq: int, *, deadline: float | None = None) -> Recovered:
        """See :meth:`Store.read_since`: the records after ``seq`` while the journal still holds them."""
        seq = check_seq(seq)
        with self._connection("cannot read", deadline=deadline) as conn:
            rows = conn.execute(_READ_SINCE, {"x": seq}, binary=True).fetchall()
        rec, last = self._recovered(rows, seq)
        if seq > last:
            raise ValueError(f"postgresql store {self.url}: seq must be in [0, {last}], the journal's last record (got {seq=})")
        return rec

    def last_seq(self, *, deadline: float | None = None) -> int:
        """See :meth:`Store.last_seq`: one query."""
        with self._connection("cannot read", deadline=deadline) as conn:
            row = conn.execute(f"SELECT {_LAST}").fetchone()
        return int(row[0]) if row is not None else 0

    # -- writing ------------------------------------------------------------------------------

    def append(self, records: Sequence[bytes]) -> int:
        """See :meth:`Store.append`: ``append_at(last_seq(), records)``, so :class:`StoreConflict` if another writer is first."""
        payloads = check_records(records)
        return self.append_at(self.last_seq(), payloads)

    def append_at(self, expected_last: int, records: Sequence[bytes], *, deadline: float | None = None) -> int:
        """See :meth:`Store.append_at`: one statement, one transaction, one commit."""
        expected_last = check_seq(expected_last, "expected_last")
        payloads = check_records(records)
        seqs = list(range(expected_last + 1, expected_last + 1 + len(payloads)))
        params = {
            "seqs": seqs,
            "crcs": [record_crc(s, p) for s, p in zip(seqs, payloads)],
            "payloads": payloads,
            "expected": expected_last,
        }
        unknown = " (the connection was lost with the commit in flight: the records may be durable; re-read the journal)"
        with self._connection("cannot append", hint=unknown, deadline=deadline) as conn:
            try:
                row = conn.execute(_APPEND_AT, params).fetchone()
            except psycopg.errors.UniqueViolation:
                raise StoreConflict(
                    f"postgresql store {self.url}: another writer appended record {expected_last + 1} first "
                    "(nothing was written)"
                ) from None
        assert row is not None  # the statement always returns one row
        last, inserted = int(row[0]), int(row[1])
        if inserted != len(payloads):
            check_expected_last(expected_last, last, self.url)
            raise self._corrupt(f"append at {expected_last} inserted {inserted} of {len(payloads)} records")
        return seqs[-1]

    def known_last(self, max_age_s: float) -> int | None:
        """The journal's last seq without a query, if this store's watch confirmed it within `max_age_s`
        (None: ask, with :meth:`last_seq`). The first call starts the watch (a LISTEN connection that
        confirms every third of `max_age_s`): see ``croupier.server._pg_watch``."""
        if self._closed:
            return None
        if self._watch is None:
            with self._close_lock:
                if self._watch is None and not self._closed:
                    self._watch = JournalWatch(self._conninfo, f"SELECT {_LAST}", max(max_age_s / 3, 0.01), self.url)
        return None if self._watch is None else self._watch.known_last(max_age_s)

    def write_snapshot(self, seq: int, payload: bytes) -> None:
        """See :meth:`Store.write_snapshot`: replaces an older snapshot, ignores one not newer; prunes with a margin."""
        seq = check_seq(seq)
        data = as_bytes(payload, "payload")
        with self._connection("cannot write a snapshot") as conn, conn.transaction():
            row = conn.execute(f"SELECT {_LAST}").fetchone()
            last = int(row[0]) if row is not None else 0
            if seq > last:
                raise ValueError(f"snapshot seq must be <= the last acknowledged record {last} (got {seq=})")
            conn.execute(_UPSERT_SNAPSHOT, {"seq": seq, "crc": record_crc(seq, data), "payload": data})
            conn.execute(_PRUNE, {"margin": self.prune_margin})

    def has_room(self) -> bool:
        """See :meth:`Store.has_room`: always; the database server keeps its own disk (a full one there
        is :class:`StoreUnavailable`, retried like any outage of the database)."""
        return True

    def close(self) -> None:
        """See :meth:`Store.close`: closes the pool."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._watch is not None:
            self._watch.close()
        self._pool.close(timeout=5.0)
