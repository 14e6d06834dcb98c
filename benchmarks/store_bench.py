"""Durable append latency and throughput of the sqlite store, by records per append.

The store does one transaction and one durable commit per ``append``; the coordinator's writer
thread is what groups records (everything queued while the previous commit was in flight goes
into the next append). So this measures what that grouping buys: one writer appending batches
of 1, 8, 64, ... records in a row, against a bare SQLite connection doing the same (same table
and pragmas, no checksums, no checks): the floor of a durable commit.
"""

from __future__ import annotations

import argparse
import math
import os
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from croupier.server._sqlite_store import SqliteStore

RECORD_BYTES = 128


class BareSqlite:
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
        self._seq = 0

    def append(self, records: Sequence[bytes]) -> int:
        """Appends in a transaction of its own.

        Args:
            records: The payloads.

        Returns:
            The last record's sequence number.
        """
        first = self._seq + 1
        rows = [(first + i, 0, r) for i, r in enumerate(records)]
        self._conn.execute("BEGIN IMMEDIATE")
        self._conn.executemany("INSERT INTO journal (seq, crc, payload) VALUES (?, ?, ?)", rows)
        self._conn.execute("COMMIT")
        self._seq += len(records)
        return self._seq

    def close(self) -> None:
        """Closes the connection."""
        self._conn.close()


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
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches must be comma-separated integers (got {args.batches!r})")
    if any(b < 1 for b in batches):
        parser.error(f"--batches must be positive integers (got {args.batches!r})")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1 (got {args.rounds})")
    total = args.appends if args.appends is not None else (16 if args.quick else 2000)
    if total < 1:
        parser.error(f"--appends must be >= 1 (got {total})")
    rounds = 1 if args.quick else args.rounds

    with tempfile.TemporaryDirectory(prefix="store_bench-", dir=args.dir) as tmp:
        where = Path(tmp)
        print(
            f"sqlite {sqlite3.sqlite_version}, WAL, synchronous=FULL, {RECORD_BYTES}-byte records, "
            "one writer appending batches one after the other"
        )
        print(f"databases in {where} ({filesystem(where)}); {os.cpu_count()} CPUs")
        print("store: croupier's SqliteStore (checksums, checks); bare: the same pragmas and table, nothing else")
        print()
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
