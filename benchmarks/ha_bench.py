"""Join commit latency and grant rate of 1, 2 and 3 `croupier serve` replicas on one PostgreSQL database, beside SQLite."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench.py: the serve process, the job join, the report helpers
sys.path.insert(0, str(HERE.parent / "tests"))  # _postgres.py: the throwaway PostgreSQL server

from baseline import CURRENT, THREADED, Serving, baseline  # noqa: E402
from bench import (  # noqa: E402
    CAPACITY_N,
    LEASE_INDICES,
    RESULT,
    BareSqlite,
    _join_job,
    _load,
    _machine,
    _pct,
    _serve_process,
)

#: Grant loads: "moved" reports progress that moved on (the replica journals it), as a training
#: rank's grants do; "same" repeats the last progress (nothing to write: the read path).
GRANT_KINDS = ("moved", "same")
JOIN_CONCURRENCY = (1, 16)


# =========================================================================== load driver (child)


async def _rank_grants(stub: Any, cmd: dict[str, Any], rank: int, end: float, lat: list[float],
                       errors: dict[str, int]) -> None:
    """One simulated rank: grants back to back until `end`, each with the rank's progress."""
    import grpc

    from croupier.v1 import coordinator_pb2 as pb

    j, epoch = 0, 0
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        try:
            g = await stub.Grant(pb.GrantRequest(job=cmd["job"], generation=cmd["generation"], rank=rank, epoch=epoch,
                                                 first_batch=j, count=LEASE_INDICES,
                                                 progress=pb.Progress(epoch=epoch, batches=j)))
        except grpc.aio.AioRpcError as e:
            errors[e.code().name] = errors.get(e.code().name, 0) + 1
            continue
        lat.append(time.perf_counter() - t0)
        if cmd["kind"] == "moved":  # the next grant reports the batches this one covered
            j, epoch = (0, epoch + 1) if g.end_of_epoch else (j + g.batches, epoch)


async def _drive_forever() -> None:
    """Reads one command a line from stdin, runs its ranks' grants back to back, prints a RESULT line; ends at EOF.

    Rank r asks replica ``addresses[r % len(addresses)]`` (round robin), on one channel per replica.
    """
    import grpc

    from croupier.client import CHANNEL_OPTIONS
    from croupier.v1 import coordinator_pb2_grpc as pb_grpc

    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        cmd = json.loads(line)
        channels = [grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in cmd["addresses"]]
        for ch in channels:
            await ch.channel_ready()
        stubs = [pb_grpc.CoordinatorStub(ch) for ch in channels]
        lat: list[float] = []
        errors: dict[str, int] = {}
        end = time.perf_counter() + cmd["seconds"]
        await asyncio.gather(*(_rank_grants(stubs[r % len(stubs)], cmd, r, end, lat, errors) for r in cmd["ranks"]))
        for ch in channels:
            await ch.close()
        print(RESULT + json.dumps({"calls": len(lat), "errors": errors, "lat_ms": [round(x * 1e3, 4) for x in lat]}),
              flush=True)


class Drivers:
    """Client processes that put grant load on the replicas, all starting each run together."""

    def __init__(self, count: int) -> None:
        self.procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(count)]
        for p in self.procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a load driver did not start")

    def run(self, addresses: Sequence[str], kind: str, job: str, generation: int, world: int,
            seconds: float) -> dict[str, Any]:
        """Ranks 0 .. world-1 dealt round-robin to the drivers, asking grants for `seconds`; merged results."""
        for i, p in enumerate(self.procs):
            assert p.stdin is not None
            cmd = dict(addresses=list(addresses), kind=kind, job=job, generation=generation, seconds=seconds,
                       ranks=list(range(world))[i :: len(self.procs)])
            p.stdin.write(json.dumps(cmd) + "\n")
            p.stdin.flush()
        calls, lat = 0, []
        errors: dict[str, int] = {}
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line.startswith(RESULT):
                raise RuntimeError(f"a load driver failed: {line!r}")
            r = json.loads(line[len(RESULT):])
            calls += r["calls"]
            lat.extend(r["lat_ms"])
            for k, v in r["errors"].items():
                errors[k] = errors.get(k, 0) + v
        return {"per_s": calls / seconds, "p50": _pct(lat, 50), "p99": _pct(lat, 99), "calls": calls, "errors": errors}

    def close(self) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.close()
        for p in self.procs:
            p.wait(timeout=60)


# =========================================================================== the parent


async def _joins(addresses: Sequence[str], count: int, concurrent: int) -> dict[str, Any]:
    """`count` joins that each commit a new generation, `concurrent` at a time, dealt round robin to the replicas.

    Each of the `concurrent` workers has a job of its own and joins it with a new incarnation every
    time (world 1, rank 0, no wait): every join opens and starts a generation, one commit.
    """
    import grpc

    from croupier.client import CHANNEL_OPTIONS
    from croupier.core.spec import Spec
    from croupier.core.wire import spec_to_proto
    from croupier.v1 import coordinator_pb2 as pb
    from croupier.v1 import coordinator_pb2_grpc as pb_grpc

    spec = spec_to_proto(Spec(n=CAPACITY_N, seed=0, permutation="feistel", batch_size=1))
    channels = [grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in addresses]
    stubs = [pb_grpc.CoordinatorStub(ch) for ch in channels]
    lat: list[float] = []
    errors: dict[str, int] = {}
    todo = iter(range(count))

    async def worker(w: int) -> None:
        for i in todo:  # shared: the workers take the next join as they finish one
            t0 = time.perf_counter()
            try:
                r = await stubs[i % len(stubs)].Join(pb.JoinRequest(
                    request_id=f"c{concurrent}-{i}", job=f"commit-{concurrent}-{w}", spec=spec, incarnation=f"t{i}",
                    world=1, rank=0, wait_ms=0))
            except grpc.aio.AioRpcError as e:
                errors[e.code().name] = errors.get(e.code().name, 0) + 1
                continue
            if not r.started:
                raise RuntimeError(f"join {i} of a world of 1 did not start its generation")
            lat.append((time.perf_counter() - t0) * 1e3)

    try:
        for ch in channels:
            await ch.channel_ready()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrent)))
        wall = time.perf_counter() - t0
    finally:
        for ch in channels:
            await ch.close()
    return {"p50": _pct(lat, 50), "p99": _pct(lat, 99), "per_s": len(lat) / wall, "errors": errors}


def _measure(addresses: Sequence[str], joins: int, ranks: int, seconds: float, drivers: int) -> dict[str, Any]:
    """Join commits (1 and 16 at a time) and grant rates (progress moved, unchanged) of one set of replicas."""
    from croupier.core.spec import Spec

    out: dict[str, Any] = {}
    for conc in JOIN_CONCURRENCY:
        out[f"join{conc}"] = asyncio.run(_joins(addresses, joins, conc))
    spec = Spec(n=CAPACITY_N, seed=0, permutation="feistel", batch_size=1)
    load = Drivers(drivers)
    try:
        for kind in GRANT_KINDS:
            # A job of its own per run: its ranks' progress starts empty.
            gen = asyncio.run(_join_job(addresses[0], f"grant-{kind}", spec, ranks))
            out[kind] = load.run(addresses, kind, f"grant-{kind}", gen, ranks, seconds)
    finally:
        load.close()
    return out


def _floors(pg_url: str, sqlite_path: Path, count: int) -> dict[str, dict[str, float]]:
    """The stores' floors from one connection, no replica: PostgreSQL's freshness query (`last_seq`) and
    durable append (`last_seq` + `append_at`, as a replica commits), and a bare one-row SQLite commit."""
    from croupier.server._pg_store import PostgresStore

    def stats(ms: list[float]) -> dict[str, float]:
        return {"p50": _pct(ms, 50), "p99": _pct(ms, 99), "per_s": len(ms) * 1e3 / sum(ms)}

    payload = os.urandom(256)
    store = PostgresStore(pg_url)
    try:
        reads, commits = [], []
        for i in range(-count // 10, count * 4):  # the first tenth warms the pool up
            t0 = time.perf_counter()
            store.last_seq()
            if i >= 0:
                reads.append((time.perf_counter() - t0) * 1e3)
        for _ in range(count):
            t0 = time.perf_counter()
            store.append_at(store.last_seq(), [payload])
            commits.append((time.perf_counter() - t0) * 1e3)
    finally:
        store.close()
    bare = BareSqlite(sqlite_path)
    try:
        sqlite = [bare.commit() for _ in range(count)]
    finally:
        bare.close()
    return {"pg_read": stats(reads), "pg_commit": stats(commits), "sqlite_commit": stats(sqlite)}


@contextlib.contextmanager
def _replicas(store: str, count: int, args: Sequence[str] = (), serving: Serving = CURRENT) -> Iterator[list[str]]:
    """`count` `croupier serve` processes of `serving`'s code on `store` (more options in `args`); yields their addresses,
    stops them all on exit."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(_serve_process(store, args, serving.environ())) for _ in range(count)]


# --------------------------------------------------------------------------- report


def _ms(x: float) -> str:
    return f"{x:.2f} ms" if x < 100 else f"{x:,.0f} ms"


def _rate(x: float) -> str:
    return f"{x:,.0f}/s"


def _cell(value: float, base: float, fmt: Any, lower_is_better: bool) -> str:
    """The figure and how many times better than SQLite's it is (below 1: SQLite's is better)."""
    if not value or not base:
        return fmt(value)
    x = base / value if lower_is_better else value / base
    return f"{fmt(value)} ({x:.2f}x)"


@dataclasses.dataclass(frozen=True)
class Measure:
    """One row of the table: what, under which load, and where its figure is in the results."""

    what: str
    load: str
    key: str
    field: str
    lower_is_better: bool


def _measures(ranks: int) -> list[Measure]:
    rows = []
    for conc in JOIN_CONCURRENCY:
        load = f"{conc} at a time"
        rows += [Measure("join commit p50", load, f"join{conc}", "p50", True),
                 Measure("join commit p99", load, f"join{conc}", "p99", True),
                 Measure("joins/s", load, f"join{conc}", "per_s", False)]
    for kind, load in (("moved", f"{ranks} ranks, progress moved (a write per grant)"),
                       ("same", f"{ranks} ranks, progress unchanged (read path)")):
        rows += [Measure("grants/s", load, kind, "per_s", False),
                 Measure("grant p50", load, kind, "p50", True),
                 Measure("grant p99", load, kind, "p99", True)]
    return rows


def _table(res: dict[str, dict[str, Any]], replicas: Sequence[int], ranks: int) -> str:
    cols = ["SQLite, 1 replica"] + [f"PostgreSQL, {n} replica{'s' if n > 1 else ''}" for n in replicas]
    lines = ["| measure | load | " + " | ".join(cols) + " |", "|" + "---|" * (2 + len(cols))]
    for m in _measures(ranks):
        fmt = _rate if m.field == "per_s" else _ms
        base = res["sqlite"][m.key][m.field]
        cells = [fmt(base)] + [_cell(res[f"pg{n}"][m.key][m.field], base, fmt, m.lower_is_better) for n in replicas]
        lines.append(f"| {m.what} | {m.load} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _compare(runs: dict[str, dict[str, dict[str, Any]]], replicas: Sequence[int], ranks: int) -> str:
    """Each figure of the new serving beside the old one's, and how many times better it is."""
    configs = ["sqlite"] + [f"pg{n}" for n in replicas]
    cols = ["SQLite, 1 replica"] + [f"PostgreSQL, {n} replica{'s' if n > 1 else ''}" for n in replicas]
    lines = ["| measure | load | " + " | ".join(f"{c}: old -> new" for c in cols) + " |", "|" + "---|" * (2 + len(cols))]
    for m in _measures(ranks):
        fmt = _rate if m.field == "per_s" else _ms
        cells = []
        for c in configs:
            old, new = runs["old"][c][m.key][m.field], runs["new"][c][m.key][m.field]
            x = (old / new if m.lower_is_better else new / old) if old and new else float("nan")
            cells.append(f"{fmt(old)} -> {fmt(new)} ({x:.2f}x)")
        lines.append(f"| {m.what} | {m.load} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: The grant rates the new serving must keep: no lower than the old serving's in the same run.
TARGETS = (("sqlite", "SQLite, 1 coordinator"), ("pg3", "PostgreSQL, 3 replicas"))


def _targets(runs: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The grant rates of one SQLite coordinator and of 3 PostgreSQL replicas, new beside old, met or MISSED."""
    lines = ["| grants/s | load | old | new | new / old | target |", "|---|---|---|---|---|---|"]
    for config, name in TARGETS:
        for kind, load in (("moved", "progress moved"), ("same", "progress unchanged")):
            old, new = runs["old"][config][kind]["per_s"], runs["new"][config][kind]["per_s"]
            ok = new >= old
            lines.append(f"| {name} | {load} | {_rate(old)} | {_rate(new)} | {new / old if old else float('nan'):.2f}x | "
                         f"no lower than old: {'met' if ok else 'MISSED'} |")
    return "\n".join(lines)


def _errors(res: dict[str, dict[str, Any]]) -> list[str]:
    """A note per run whose calls failed (they are left out of its figures)."""
    notes = []
    for config, runs in res.items():
        for key, r in runs.items():
            if r["errors"]:
                notes.append(f"{config} {key}: failed calls {r['errors']} (not counted)")
    return notes


def _versions(pg_url: str) -> dict[str, str]:
    from importlib.metadata import version

    import psycopg

    with psycopg.connect(pg_url, connect_timeout=10) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return {"croupier": version("croupier"), "PostgreSQL": str(row[0]).split()[0] if row else "?",
            "grpcio": version("grpcio"), "psycopg": version("psycopg")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny runs, seconds in all (what the test suite runs)")
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="where ha.md goes (default out/bench)")
    parser.add_argument("--max-staleness-ms", type=int, default=None,
                        help="the replicas' --max-staleness-ms (default: croupier serve's; 0 asks the database on every grant)")
    parser.add_argument("--baseline", metavar="REF",
                        help=f"also: every configuration on REF's coordinator (e.g. {THREADED}, the threaded serving), "
                             "in the same run; the ratios new / old")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        asyncio.run(_drive_forever())
        return 0

    from _postgres import Postgres, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(f"ha_bench: cannot start PostgreSQL: {reason}", file=sys.stderr)
        return 2
    quick = args.quick
    replicas = (1, 2, 3)
    joins = 24 if quick else 400
    ranks = 8 if quick else 64
    seconds = 0.5 if quick else 8.0
    drivers = 1 if quick else 2
    t_begin = time.perf_counter()
    load_before = _load()

    def step(what: str) -> None:
        print(f"[{time.perf_counter() - t_begin:6.1f} s] {what}", file=sys.stderr, flush=True)

    serve_args = () if args.max_staleness_ms is None else ("--max-staleness-ms", str(args.max_staleness_ms))
    servings = [CURRENT]
    # NOTE: each configuration is measured on both servings one after the other (not all of one, then all of
    # the other), so that the load of the shared cores drifts alike for both.
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    pg = Postgres()
    with contextlib.ExitStack() as stack:
        if args.baseline:
            servings.append(stack.enter_context(baseline(args.baseline)))
        try:
            step("starting PostgreSQL")
            pg.start()
            versions = _versions(pg.url())
            with tempfile.TemporaryDirectory() as tmp:
                step("floors: the stores from one connection")
                floors = _floors(pg.fresh_database("floor"), Path(tmp) / "floor.db", 20 if quick else 300)
                for sv in servings:
                    step(f"SQLite, 1 replica, {sv.label}")
                    with _replicas(f"sqlite:///{tmp}/coordinator-{sv.name}.db", 1, serving=sv) as addresses:
                        runs.setdefault(sv.name, {})["sqlite"] = _measure(addresses, joins, ranks, seconds, drivers)
            for n in replicas:
                for sv in servings:
                    step(f"PostgreSQL, {n} replica(s), {sv.label}")
                    with _replicas(pg.fresh_database(f"ha{n}{sv.name}"), n, serve_args, sv) as addresses:
                        runs[sv.name][f"pg{n}"] = _measure(addresses, joins, ranks, seconds, drivers)
        finally:
            pg.close()
    res = runs["new"]

    took = time.perf_counter() - t_begin
    command = ("python benchmarks/ha_bench.py" + (" --quick" if quick else "") + "".join(f" {a}" for a in serve_args)
               + (f" --baseline {args.baseline}" if args.baseline else ""))
    machine = _machine(versions)
    load = f"load average {load_before} before, {_load()} after"
    table = _table(res, replicas, ranks)
    notes = [
        f"Joins: {joins} per load, each a new generation (a new incarnation, world 1, no wait) of one of the workers' jobs, "
        "dealt round robin to the replicas; latency of the `Join` call from a `grpc.aio` client.",
        f"Grants: {ranks} ranks back to back from {drivers} `grpc.aio` client process(es) for {seconds:g} s, rank r "
        f"asking replica r mod n, {LEASE_INDICES:,} positions per grant, each with a progress report.",
        "Ratios: how many times better than SQLite (below 1: SQLite is better), latency and rate alike.",
        "Floors, from one connection and no replica, in the same run: PostgreSQL's freshness query (`last_seq`) "
        f"{_ms(floors['pg_read']['p50'])} p50 ({_rate(floors['pg_read']['per_s'])}); a replica's durable append "
        f"(`last_seq` + `append_at`, one commit) {_ms(floors['pg_commit']['p50'])} p50 / "
        f"{_ms(floors['pg_commit']['p99'])} p99 ({_rate(floors['pg_commit']['per_s'])}); a bare one-row SQLite "
        f"commit (WAL, synchronous=FULL) {_ms(floors['sqlite_commit']['p50'])} p50 "
        f"({_rate(floors['sqlite_commit']['per_s'])}).",
        "PostgreSQL runs on this machine (fsync on, synchronous_commit on), and shares its cores with the replicas "
        "and the load.",
        *_errors(res),
    ]
    if len(servings) > 1:
        old = servings[1]
        table += (f"\n\nThe same on {old.label}'s coordinator, in the same run (each configuration measured on both, one "
                  f"after the other):\n\n{_table(runs['old'], replicas, ranks)}\n\nNew / old, each figure of the new "
                  f"serving beside the old one's (the ratio: how many times better the new is):\n\n"
                  f"{_compare(runs, replicas, ranks)}\n\n{_targets(runs)}")
        notes += [f"{old.label}: {e}" for e in _errors(runs["old"])]
    print(table)
    print()
    for note in notes:
        print(f"- {note}")
    print(f"\n{command}: {took:.0f} s on {machine} ({load})")

    args.out.mkdir(parents=True, exist_ok=True)
    md = [f"# croupier replicas on PostgreSQL beside SQLite ({'quick' if quick else 'full'} run)", "",
          f"`{command}` took {took:.0f} s on {machine}, {time.strftime('%Y-%m-%d')} ({load}).", "",
          table, "", *[f"- {n}" for n in notes], ""]
    (args.out / "ha.md").write_text("\n".join(md))
    step(f"wrote {args.out / 'ha.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
