"""Durable append latency and throughput of the sqlite store, by records per append.

The store does one transaction and one durable commit per ``append``; the coordinator's writer
thread is what groups records (everything queued while the previous commit was in flight goes
into the next append). So this measures what that grouping buys: one writer appending batches
of 1, 8, 64, ... records in a row, against a bare SQLite connection doing the same (same table
and pragmas, no checksums, no checks): the floor of a durable commit.

A second table (``--joins``) measures the same grouping end to end: a ``croupier serve`` on a
SQLite store answering joins of new one-rank jobs (each a durable commit: the coordinator
answers once its events are fsync'd), one at a time and 32 at a time, in rounds interleaved
with a bare one-row fsync commit on the same disk; it shows the joins per second beside that
floor's commits per second and, from the coordinator's /metrics, how many records each of its
journal appends carried.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import socket
import sqlite3
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from baseline import Serving, baseline

from croupier.server._sqlite_store import SqliteStore
from croupier.tools.serve import ServeProcess

RECORD_BYTES = 128
#: The dataset size of the jobs the joins table makes (the feistel order: nothing grows with it).
JOIN_N = 10**8
#: Issue 52's target: joins 32 in flight at this many times the floor's one-row commits per second.
TARGET_X = 3.0


class _BareJournal:
    """A journal table on one connection, one transaction per append: what a subclass inserts (`_insert`)."""

    _seq = 0
    _conn: Any

    def append(self, records: Sequence[bytes]) -> int:
        """Appends in a transaction of its own (committed and durable when it returns).

        Args:
            records: The payloads.

        Returns:
            The last record's sequence number.
        """
        first = self._seq + 1
        self._insert([(first + i, 0, r) for i, r in enumerate(records)])
        self._seq += len(records)
        return self._seq

    def _insert(self, rows: list[tuple[int, int, bytes]]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Closes the connection."""
        self._conn.close()


class BareSqlite(_BareJournal):
    """The floor: the same table and pragmas as the store, one transaction per append, nothing else."""

    def __init__(self, path: Path) -> None:
        """Creates the database at ``path``.

        Args:
            path: A file that does not exist yet.
        """
        self._conn = sqlite3.connect(path, isolation_level=None)
        self._conn.execute("PRAGMA locking_mode=EXCLUSIVE")
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute(
            "CREATE TABLE journal (seq INTEGER PRIMARY KEY, crc INTEGER NOT NULL, payload BLOB NOT NULL)"
        )

    def _insert(self, rows: list[tuple[int, int, bytes]]) -> None:
        self._conn.execute("BEGIN IMMEDIATE")
        self._conn.executemany("INSERT INTO journal (seq, crc, payload) VALUES (?, ?, ?)", rows)
        self._conn.execute("COMMIT")


class BarePostgres(_BareJournal):
    """The floor on PostgreSQL: a table like the store's journal, one transaction per append (the WAL flushed),
    one connection."""

    def __init__(self, url: str) -> None:
        """Connects to the (empty) database at ``url`` and makes the table.

        Args:
            url: A ``postgresql://`` URL.
        """
        import psycopg

        self._conn = psycopg.connect(url, autocommit=True)
        self._conn.execute("SET synchronous_commit = on")
        self._conn.execute("CREATE TABLE bare_journal (seq BIGINT PRIMARY KEY, crc BIGINT NOT NULL, payload BYTEA NOT NULL)")

    def _insert(self, rows: list[tuple[int, int, bytes]]) -> None:
        with self._conn.transaction(), self._conn.cursor() as cur:
            cur.executemany("INSERT INTO bare_journal (seq, crc, payload) VALUES (%s, %s, %s)", rows)


def run(append: Callable[[Sequence[bytes]], int], batch: int, appends: int) -> tuple[list[float], float]:
    """Makes ``appends`` appends of ``batch`` records each, one after the other.

    Args:
        append: The store's append.
        batch: Records per append.
        appends: How many appends.

    Returns:
        Every append's latency in seconds, and the wall time of all of them.
    """
    records = [os.urandom(RECORD_BYTES) for _ in range(batch)]
    latencies: list[float] = []
    t0 = time.perf_counter()
    for _ in range(appends):
        t = time.perf_counter()
        append(records)
        latencies.append(time.perf_counter() - t)
    return latencies, time.perf_counter() - t0


def quantile(xs: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``xs``."""
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def filesystem(path: Path) -> str:
    """The type of the filesystem holding ``path`` (from /proc/mounts; ``?`` where unknown)."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "?"
    real = str(path.resolve())
    best = max(
        (m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
        key=lambda m: len(m[0]),
        default=None,
    )
    return best[1] if best else "?"


def free_port() -> int:
    """A TCP port of loopback that was free a moment ago (for the coordinator's /metrics)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def journal_counts(metrics: str) -> tuple[float, float]:
    """The coordinator's journal appends and the records they carried so far, from its /metrics.

    Args:
        metrics: The metrics endpoint's ``host:port``.

    Returns:
        ``(appends, records)``.
    """
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("croupier_journal_commit_seconds_count", "croupier_journal_records_total"):
            found[name] = float(value)
    return found.get("croupier_journal_commit_seconds_count", 0.0), found.get("croupier_journal_records_total", 0.0)


async def calls(address: str, tag: str, count: int, concurrent: int, empty: bool = False) -> tuple[list[float], float]:
    """Joins of ``count`` new one-rank jobs (or, with `empty`, as many empty calls), ``concurrent`` in flight at a time.

    Args:
        address: The coordinator's ``host:port``.
        tag: Makes the jobs' names unique within one coordinator.
        count: How many calls.
        concurrent: How many are in flight at once.
        empty: Make gRPC health checks instead, which the server answers without the coordinator: the ceiling
            of any call on this machine.

    Returns:
        Every call's latency in seconds, and the wall time of all of them.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from croupier.client import CHANNEL_OPTIONS
    from croupier.core.spec import Spec
    from croupier.core.wire import spec_to_proto
    from croupier.v1 import coordinator_pb2 as pb
    from croupier.v1 import coordinator_pb2_grpc as pb_grpc

    spec = spec_to_proto(Spec(n=JOIN_N, seed=0, permutation="feistel", batch_size=1))
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        names = iter(range(count))

        async def worker() -> None:
            for i in names:
                t = time.perf_counter()
                if empty:
                    await health.Check(health_pb2.HealthCheckRequest())  # type: ignore[attr-defined]  # the stub is untyped
                else:
                    await stub.Join(pb.JoinRequest(request_id=f"{tag}-{i}", job=f"{tag}-{i}", spec=spec,
                                                   incarnation="t", world=1, rank=0))
                latencies.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrent)))
        wall = time.perf_counter() - t0
    return latencies, wall


@dataclasses.dataclass
class Side:
    """One row of the joins table: latencies, wall time and the coordinator's journal appends and records."""

    latencies: list[float] = dataclasses.field(default_factory=list)
    wall: float = 0.0
    appends: float = 0.0
    records: float = 0.0

    def add(self, latencies: list[float], wall: float, after: tuple[float, float] = (0.0, 0.0),
            before: tuple[float, float] = (0.0, 0.0)) -> None:
        """Adds one round: its latencies, wall time and the journal counts before and after it."""
        self.latencies += latencies
        self.wall += wall
        self.appends += after[0] - before[0]
        self.records += after[1] - before[1]

    def rate(self) -> float:
        """Calls per second over the wall time of all rounds."""
        return len(self.latencies) / self.wall


@dataclasses.dataclass
class Coordinator:
    """One ``croupier serve`` the joins table measures: what its rows are called, and where its /metrics are."""

    label: str
    process: ServeProcess
    metrics: str
    sides: dict[int, Side]


def start_coordinators(stores: Sequence[tuple[str, str, Mapping[str, str]]], concurrency: Sequence[int],
                       stack: contextlib.ExitStack) -> list[Coordinator]:
    """Starts one ``croupier serve`` per ``(label, store URL, environment)``, each stopped when `stack` closes."""
    out = []
    for label, url, env in stores:
        port = free_port()
        process = ServeProcess(url, sys.stderr, args=["--metrics-port", str(port)], env=env).start()
        stack.callback(process.terminate, 30)
        out.append(Coordinator(label, process, f"127.0.0.1:{port}", {c: Side() for c in concurrency}))
    return out


def joins_table(stores: Sequence[tuple[str, str, Mapping[str, str]]], bare: BareSqlite | BarePostgres, count: int,
                rounds: int, concurrency: Sequence[int]) -> None:
    """Prints durable joins through ``croupier serve`` on each of `stores` beside a bare one-row durable commit.

    Every round measures, one after the other: the floor (``count`` bare one-row commits), then on each
    coordinator and for each concurrency ``count`` joins, then ``count`` empty calls at the highest
    concurrency on the first coordinator (the ceiling of any call). Rates are over the wall time of all rounds.

    Args:
        stores: ``(label, store URL, environment)`` of each coordinator: this tree's first, then any other.
        bare: The floor's database, on the same disk (closed here).
        count: Calls per round and per row (and bare commits per round).
        rounds: Interleaved rounds.
        concurrency: Joins in flight at once, one row each.
    """
    widest = max(concurrency)
    floor, ceiling = Side(), Side()
    load = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        stack.callback(bare.close)
        coordinators = start_coordinators(stores, concurrency, stack)
        for co in coordinators:
            asyncio.run(calls(co.process.address, "warm", min(count, 64), widest))
        for r in range(rounds):
            floor.add(*run(bare.append, 1, count))
            for co in coordinators:
                for c in concurrency:
                    before = journal_counts(co.metrics)
                    lat, wall = asyncio.run(calls(co.process.address, f"r{r}-c{c}", count, c))
                    co.sides[c].add(lat, wall, journal_counts(co.metrics), before)
            ceiling.add(*asyncio.run(calls(coordinators[0].process.address, "", count, widest, empty=True)))
    kind = "PostgreSQL" if isinstance(bare, BarePostgres) else "SQLite"
    print(f"durable joins through croupier serve ({kind} store, one new one-rank job each), {rounds} interleaved "
          f"round(s) of {count} per row, load average {load:.2f} -> {os.getloadavg()[0]:.2f}; floor: a bare "
          "one-row commit (fsync), same disk; empty: gRPC health checks, the ceiling of any call")
    header = (f"{'coordinator':<20} {'in flight':>9} {'calls':>6} {'p50 ms':>8} {'p99 ms':>8} {'calls/s':>9} "
              f"{'records/append':>14} {'x floor':>8} {'x empty':>8}")
    print(header)
    print("-" * len(header))
    floor_rate, empty_rate = floor.rate(), ceiling.rate()
    rows = [("floor", "", floor), *((co.label, str(c), side) for co in coordinators for c, side in co.sides.items()),
            ("empty", str(widest), ceiling)]
    for label, flight, side in rows:
        per_append = f"{side.records / side.appends:.2f}" if side.appends else "-"
        print(f"{label:<20} {flight:>9} {len(side.latencies):>6} {quantile(side.latencies, 0.5) * 1e3:>8.2f} "
              f"{quantile(side.latencies, 0.99) * 1e3:>8.2f} {side.rate():>9.0f} {per_append:>14} "
              f"{side.rate() / floor_rate:>7.2f}x {side.rate() / empty_rate:>7.2f}x", flush=True)
    ours = coordinators[0].sides
    got = ours[widest].rate() / floor_rate
    grouped = ", ".join(f"{c} in flight {s.records / s.appends:.2f}" for c, s in ours.items() if s.appends)
    print(f"{widest} in flight: {got:.2f}x the floor's rate (target >= {TARGET_X:g}x: "
          f"{'met' if got >= TARGET_X else 'MISSED'}){'; records per append: ' + grouped if grouped else ''}")
    if not any(s.appends for s in ours.values()):
        print("(a shared store's coordinator does not time its appends: no records per append)")


def positive_ints(parser: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """The comma-separated positive integers of option `flag`; a usage error (exit 2) names the flag and the value."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        parser.error(f"{flag} must be comma-separated integers (got {text!r})")
    if any(v < 1 for v in values):
        parser.error(f"{flag} must be positive integers (got {text!r})")
    return values


def appends_table(where: Path, batches: Sequence[int], total: int, rounds: int) -> None:
    """Prints durable appends of the store by records per append, beside the bare connection's, one row per batch.

    Args:
        where: The directory of the databases.
        batches: Records per append, one row each.
        total: Appends per row and per side.
        rounds: Rounds alternating between the store and the bare connection.
    """
    header = (
        f"{'batch':>5} {'appends':>7} {'p50 ms':>8} {'p99 ms':>8} {'appends/s':>10} {'records/s':>10} "
        f"{'bare p50':>8} {'bare p99':>8} {'bare rec/s':>10} {'store/bare':>10}"
    )
    print(header)
    print("-" * len(header))
    for row, batch in enumerate(batches):
        per_round = max(1, total // rounds)
        store = SqliteStore(f"sqlite:///{where}/store-{row}.db", where / f"store-{row}.db")
        bare = BareSqlite(where / f"bare-{row}.db")
        st_lat: list[float] = []
        bare_lat: list[float] = []
        st_wall = bare_wall = 0.0
        # Rounds alternate between the two so that both see the same phases of the disk.
        for _ in range(rounds):
            lat, wall = run(store.append, batch, per_round)
            st_lat += lat
            st_wall += wall
            lat, wall = run(bare.append, batch, per_round)
            bare_lat += lat
            bare_wall += wall
        if store.commits != len(st_lat):
            raise RuntimeError(f"the store made {store.commits} commits for {len(st_lat)} appends, not one each")
        store.close()
        bare.close()
        n = len(st_lat)
        print(
            f"{batch:>5} {n:>7} {quantile(st_lat, 0.5) * 1e3:>8.2f} {quantile(st_lat, 0.99) * 1e3:>8.2f} "
            f"{n / st_wall:>10.0f} {n * batch / st_wall:>10.0f} {quantile(bare_lat, 0.5) * 1e3:>8.2f} "
            f"{quantile(bare_lat, 0.99) * 1e3:>8.2f} {n * batch / bare_wall:>10.0f} "
            f"{st_wall / bare_wall:>9.2f}x",
            flush=True,
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark and prints its table.

    Args:
        argv: Command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny run that only checks the program works")
    parser.add_argument(
        "--batches", default="1,8,64", help="comma-separated records per append, one row each (default: %(default)s)"
    )
    parser.add_argument(
        "--appends", type=int, default=None, help="appends per row and per side (default: 2000, --quick: 16)"
    )
    parser.add_argument(
        "--rounds", type=int, default=8, help="alternating rounds per row (default: %(default)s; --quick: 1)"
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the databases go (default: a new temporary directory)"
    )
    parser.add_argument(
        "--joins", type=int, default=None,
        help="durable joins per round and per row of the joins table, 0 for none (default: 1000, --quick: 16)"
    )
    parser.add_argument(
        "--postgres", action="store_true",
        help="also the joins table on a throwaway PostgreSQL server (its binaries from pg_config; as root, run as postgres)"
    )
    parser.add_argument(
        "--baseline", metavar="REF",
        help="also the joins rows of REF's coordinator (a commit, e.g. HEAD), in the same rounds (benchmarks/baseline.py)"
    )
    parser.add_argument(
        "--in-flight", default="1,32", help="comma-separated joins in flight at once, one row each (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    batches = positive_ints(parser, "--batches", args.batches)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1 (got {args.rounds})")
    total = args.appends if args.appends is not None else (16 if args.quick else 2000)
    if total < 1:
        parser.error(f"--appends must be >= 1 (got {total})")
    rounds = 1 if args.quick else args.rounds
    join_count = args.joins if args.joins is not None else (16 if args.quick else 1000)
    if join_count < 0:
        parser.error(f"--joins must be >= 0 (got {join_count})")
    in_flight = positive_ints(parser, "--in-flight", args.in_flight)

    with tempfile.TemporaryDirectory(prefix="store_bench-", dir=args.dir) as tmp:
        where = Path(tmp)
        print(
            f"sqlite {sqlite3.sqlite_version}, WAL, synchronous=FULL, {RECORD_BYTES}-byte records, "
            "one writer appending batches one after the other"
        )
        print(f"databases in {where} ({filesystem(where)}); {os.cpu_count()} CPUs")
        print("store: croupier's SqliteStore (checksums, checks); bare: the same pragmas and table, nothing else")
        print()
        appends_table(where, batches, total, rounds)
        if join_count:
            with contextlib.ExitStack() as stack:
                old = stack.enter_context(baseline(args.baseline)) if args.baseline else None
                print()
                stores: list[tuple[str, str, Mapping[str, str]]] = [("this tree", f"sqlite:///{where}/coordinator.db", {})]
                if old is not None:
                    stores.append((f"{old.ref}", f"sqlite:///{where}/coordinator-{old.ref}.db", old.environ()))
                joins_table(stores, BareSqlite(where / "bare-joins.db"), join_count, rounds, in_flight)
                if args.postgres:
                    print()
                    postgres_joins(join_count, rounds, in_flight, old)
    return 0


def postgres_joins(count: int, rounds: int, concurrency: Sequence[int], old: Serving | None) -> None:
    """The joins table on a throwaway PostgreSQL server of this machine (``tests/_postgres.py``), ``fsync=on``.

    Args:
        count: Calls per round and per row.
        rounds: Interleaved rounds.
        concurrency: Joins in flight at once, one row each.
        old: Another commit's coordinator to measure beside this tree's, or None.
    """
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from _postgres import Postgres

    pg = Postgres()
    try:
        pg.start()
        stores: list[tuple[str, str, Mapping[str, str]]] = [("this tree", pg.create_database("coordinator"), {})]
        if old is not None:
            stores.append((f"{old.ref}", pg.create_database("old"), old.environ()))
        joins_table(stores, BarePostgres(pg.create_database("floor")), count, rounds, concurrency)
    finally:
        pg.close()


if __name__ == "__main__":
    sys.exit(main())
