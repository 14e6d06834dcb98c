"""Durable append latency and throughput of the sqlite store: group commit against one commit per append."""

from __future__ import annotations

import argparse
import math
import os
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from croupier.server._store import SqliteStore

RECORD_BYTES = 128


class SerialStore:
    """The peer: the same table and pragmas, but one transaction (one fsync) per append, under a lock."""

    def __init__(self, path: Path) -> None:
        """Creates the database at ``path``.

        Args:
            path: A file that does not exist yet.
        """
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA locking_mode=EXCLUSIVE")
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute(
            "CREATE TABLE journal (seq INTEGER PRIMARY KEY, crc INTEGER NOT NULL, payload BLOB NOT NULL)"
        )
        self._seq = 0
        self.commits = 0

    def append(self, records: Sequence[bytes]) -> int:
        """Appends in a transaction of its own.

        Args:
            records: The payloads.

        Returns:
            The last record's sequence number.
        """
        with self._lock:
            first = self._seq + 1
            rows = [(first + i, 0, r) for i, r in enumerate(records)]
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.executemany("INSERT INTO journal (seq, crc, payload) VALUES (?, ?, ?)", rows)
            self._conn.execute("COMMIT")
            self._seq += len(records)
            self.commits += 1
            return self._seq

    def close(self) -> None:
        """Closes the connection."""
        self._conn.close()


def run(append: Callable[[Sequence[bytes]], int], writers: int, per_writer: int) -> tuple[list[float], float]:
    """Has ``writers`` threads each append ``per_writer`` single-record batches, all starting together.

    Args:
        append: The store's append.
        writers: Number of concurrent threads.
        per_writer: Appends per thread.

    Returns:
        Every append's latency in seconds, and the wall time from the common start to the last return.
    """
    payload = os.urandom(RECORD_BYTES)
    latencies: list[list[float]] = [[] for _ in range(writers)]
    start = threading.Barrier(writers + 1)

    def writer(i: int) -> None:
        out = latencies[i]
        start.wait()
        for _ in range(per_writer):
            t0 = time.perf_counter()
            append([payload])
            out.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return [x for xs in latencies for x in xs], wall


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
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a tiny run that only checks the program works")
    parser.add_argument(
        "--writers", default="1,8,64", help="comma-separated thread counts (default: %(default)s)"
    )
    parser.add_argument(
        "--appends",
        type=int,
        default=None,
        help="appends per row, spread over the writers (default: 4000, --quick: 64)",
    )
    parser.add_argument(
        "--rounds", type=int, default=8, help="alternating rounds per row (default: %(default)s; --quick: 1)"
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the databases go (default: a new temporary directory)"
    )
    args = parser.parse_args(argv)
    writer_counts = [int(w) for w in args.writers.split(",")]
    if any(w < 1 for w in writer_counts):
        parser.error(f"--writers must be positive integers (got {args.writers!r})")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1 (got {args.rounds})")
    total = args.appends if args.appends is not None else (64 if args.quick else 4000)
    rounds = 1 if args.quick else args.rounds

    with tempfile.TemporaryDirectory(prefix="store_bench-", dir=args.dir) as tmp:
        where = Path(tmp)
        print(
            f"sqlite {sqlite3.sqlite_version}, WAL, synchronous=FULL, "
            f"{RECORD_BYTES}-byte records, one record per append"
        )
        print(f"databases in {where} ({filesystem(where)}); {os.cpu_count()} CPUs")
        print("group: croupier's SqliteStore (group commit); serial: one transaction per append under a lock")
        print()
        header = (
            f"{'writers':>7} {'appends':>7} {'p50 ms':>8} {'p99 ms':>8} {'appends/s':>10} "
            f"{'recs/commit':>11} {'serial p50':>10} {'serial p99':>10} {'serial/s':>9} {'group/serial':>12}"
        )
        print(header)
        print("-" * len(header))
        for row, w in enumerate(writer_counts):
            per_round = max(1, total // (w * rounds))
            group = SqliteStore(f"sqlite:///{where}/group-{row}.db", where / f"group-{row}.db")
            serial = SerialStore(where / f"serial-{row}.db")
            g_lat: list[float] = []
            s_lat: list[float] = []
            g_wall = s_wall = 0.0
            # Rounds alternate between the two so that both see the same phases of the disk.
            for _ in range(rounds):
                lat, wall = run(group.append, w, per_round)
                g_lat += lat
                g_wall += wall
                lat, wall = run(serial.append, w, per_round)
                s_lat += lat
                s_wall += wall
            g_commits = group.commits
            group.close()
            serial.close()
            n = len(g_lat)
            print(
                f"{w:>7} {n:>7} {quantile(g_lat, 0.5) * 1e3:>8.2f} {quantile(g_lat, 0.99) * 1e3:>8.2f} "
                f"{n / g_wall:>10.0f} {n / g_commits:>11.1f} {quantile(s_lat, 0.5) * 1e3:>10.2f} "
                f"{quantile(s_lat, 0.99) * 1e3:>10.2f} {n / s_wall:>9.0f} {s_wall / g_wall:>11.2f}x",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
