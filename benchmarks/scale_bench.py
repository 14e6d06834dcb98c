"""A join storm: every rank of a restarted world joins one coordinator in the same second, then takes its first batch.

Each rank is a real gRPC client making the calls a sampler makes (``Join`` long polls of 5 s until its
generation starts, asking again after the coordinator's hint when its admission refuses a call, then
the ``Grant`` of its first lease, given 1 s), as asyncio tasks spread over a few driver processes. The
coordinator is a ``croupier serve`` process on a SQLite store, so its CPU time and RSS are its own
(read from /proc). With ``--baseline REF`` the same storms run on REF's coordinator too (baseline.py),
whose joins poll 500 ms and back off up to 2 s when its waiting places (--max-concurrent-joins) are
taken, as its client did.

Printed, per world size and serving: the time from the last join acknowledged to each rank's first
batch (p50, p99, max) beside the bare grpc.aio ceiling of the same run (scale_ceiling.py) and their
ratio, the calls the server cancelled, the refusals, the first grants not answered within 1 s, the
coordinator's CPU-seconds and RSS growth per rank and the joins per second; each beside its target
(p99 within 1.2x the ceiling, 0 cancelled, every first grant within 1 s, the CPU per rank flat).

    python benchmarks/scale_bench.py --baseline 42a3d40   # 1,024, 4,096 and 16,384 ranks, both servings
    python benchmarks/scale_bench.py --worlds 256         # a quick run (the suite's)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

import baseline
import numpy as np
import scale_ceiling
import scale_recovery
import scale_report
from scale_recovery import proc_rss as _proc_rss

BENCH = pathlib.Path(__file__).resolve()
RESULT = scale_recovery.RESULT
#: A join's long poll, as this tree's client asks it (CoordinatorClient.join_started's poll_s); the threaded
#: server's client asked 0.5 s (baseline.POLL_MS_THREADED).
JOIN_POLL_MS = baseline.POLL_MS
#: The status codes the client retries (client/_rpc.py RETRYABLE); of them, those of a call the server
#: cancelled or could not take (counted as ``cancelled``).
RETRYABLE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"})
CANCELLED = frozenset({"UNAVAILABLE", "CANCELLED"})


# --------------------------------------------------------------------------- a driver process


async def _ranks(address: str, job: str, incarnation: str, world: int, ranks: list[int], lease: int,
                 steady: dict[str, float] | None = None, poll_ms: int = JOIN_POLL_MS) -> dict[str, Any]:
    """Joins `ranks` of a world as the samplers do, then grants each its first lease; times on CLOCK_MONOTONIC.

    A join long-polls `poll_ms` (the client's poll). With `steady` (``lease`` batches a grant, ``step_s`` a
    step, ``duration_s``), the driver then says READY on stdout, waits for the parent's ``GO T0`` on stdin and,
    from T0 for ``duration_s``, has each rank ask a grant (with its progress report) every ``lease * step_s``
    seconds, the ranks' phases spread evenly over that period: the samplers' calls in steady training.
    """
    import grpc

    from croupier.client import CHANNEL_OPTIONS
    from croupier.client._rpc import RETRY_AFTER_KEY
    from croupier.core.spec import Spec
    from croupier.core.wire import spec_to_proto
    from croupier.v1 import coordinator_pb2 as pb
    from croupier.v1 import coordinator_pb2_grpc as pb_grpc

    # each rank's share: its first lease and, in steady training, every lease it asks after it
    per_rank = lease * (4 if steady is None else math.ceil(steady["duration_s"] / (lease * steady["step_s"])) + 2)
    spec = spec_to_proto(Spec(n=world * per_rank, batch_size=1))
    # Several channels, as ranks on several machines would have: one HTTP/2 connection for thousands of
    # concurrent long polls would measure the connection, not the coordinator.
    channels = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(8)]
    for ch in channels:
        await ch.channel_ready()
    stubs = [pb_grpc.CoordinatorStub(ch) for ch in channels]
    joined: dict[int, float] = {}
    first: dict[int, float] = {}
    started_at: dict[int, float] = {}
    generation: dict[int, int] = {}
    n = dict(refused_waits=0, refused=0, cancelled=0, cancelled_grants=0, retried=0, ungranted=0)

    def hint_s(e: Any) -> float | None:
        """The coordinator's retry hint of a refusal by its admission (seconds), jittered; None without one."""
        hint = dict(e.trailing_metadata() or ()).get(RETRY_AFTER_KEY)
        return None if hint is None else int(hint) / 1000 * (0.5 + np.random.random())

    async def rank(r: int) -> None:
        stub = stubs[r % len(stubs)]
        req = pb.JoinRequest(request_id=f"{incarnation}-{r}", job=job, spec=spec, incarnation=incarnation, world=world, rank=r,
                             wait_ms=poll_ms)
        busy = 0.05
        while True:
            try:
                resp = await stub.Join(req, timeout=60)
            except grpc.aio.AioRpcError as e:
                if e.code().name in RETRYABLE:  # as the client retries them (client/_rpc.py RETRYABLE)
                    n["retried"] += 1
                    n["cancelled"] += e.code().name in CANCELLED
                    await asyncio.sleep(0.05 * (0.5 + np.random.random()))  # backoff, not synchronisation
                    continue
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                wait = hint_s(e)
                if wait is not None:  # refused by the coordinator's admission: asked again after its hint, jittered
                    n["refused"] += 1
                    await asyncio.sleep(wait)  # the hint, not synchronisation
                    continue
                if "--max-concurrent-joins" not in (e.details() or ""):
                    raise
                n["refused_waits"] += 1
                joined.setdefault(r, time.monotonic())  # refused for the wait only: the join is recorded
                # NOTE: the client's backoff between two asks (client/_rpc.py join_started), not synchronisation
                await asyncio.sleep(busy * (0.5 + np.random.random()))
                busy = min(busy * 2, 2.0)
                continue
            joined.setdefault(r, time.monotonic())
            if resp.started:
                started_at[r] = time.monotonic()
                generation[r] = resp.generation
                break
        # As the sampler's prefetcher asks: one second for the grant (a refusal asked again after its hint
        # within it), else the rank computes its lease itself.
        end = time.monotonic() + 1.0
        while True:
            try:
                g = await stub.Grant(pb.GrantRequest(job=job, generation=generation[r], rank=r, epoch=0, first_batch=0,
                                                     count=lease), timeout=max(0.001, end - time.monotonic()))
                assert g.batches > 0
            except grpc.aio.AioRpcError as e:
                wait = hint_s(e) if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None
                if wait is not None and time.monotonic() + wait < end:
                    n["refused"] += 1
                    await asyncio.sleep(wait)  # the hint, not synchronisation
                    continue
                if e.code().name not in RETRYABLE and wait is None:
                    raise
                n["cancelled_grants"] += e.code().name in CANCELLED
                n["ungranted"] += 1
            break
        first[r] = time.monotonic()

    sent = time.monotonic()
    await asyncio.gather(*(rank(r) for r in ranks))
    out: dict[str, Any] = {"sent": sent, "joined": joined, "first": first, "started": started_at, **n}
    if steady is not None:
        out["steady"] = await _steady(stubs, job, generation, int(steady["lease"]), steady["step_s"], steady["duration_s"])
    for ch in channels:
        await ch.close()
    return out


async def _steady(stubs: list[Any], job: str, generation: dict[int, int], lease: int, step_s: float,
                  duration_s: float) -> dict[str, Any]:
    """Steady training, after READY / GO with the parent: each rank's grants at its pace; their latencies (ms)."""
    import grpc

    from croupier.v1 import coordinator_pb2 as pb

    print("READY", flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    t0 = float(line.split()[1])
    period = lease * step_s
    latencies: list[float] = []
    late: list[float] = []
    failed = 0

    async def rank(r: int) -> None:
        nonlocal failed
        stub = stubs[r % len(stubs)]
        k = 1  # the first lease was granted at the join
        # NOTE: the ranks' phases spread evenly over one lease's period, as ranks that started together
        # drift apart; the sleeps pace the load (a schedule of sends), they synchronise nothing.
        at = t0 + ((r * 0.6180339887) % 1.0) * period
        while at < t0 + duration_s:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            sent = time.monotonic()
            late.append(sent - at)
            try:
                g = await stub.Grant(pb.GrantRequest(job=job, generation=generation[r], rank=r, epoch=0,
                                                     first_batch=k * lease, count=lease,
                                                     progress=pb.Progress(epoch=0, batches=k * lease)), timeout=5.0)
                assert g.batches > 0
                latencies.append((time.monotonic() - sent) * 1e3)
            except grpc.aio.AioRpcError:
                failed += 1
            k += 1
            at += period

    await asyncio.gather(*(rank(r) for r in generation))
    return {"latencies_ms": latencies, "failed": failed, "late_p99_ms": float(np.percentile(late, 99) * 1e3) if late else 0.0}


def _driver(args: dict[str, Any]) -> None:
    out = asyncio.run(_ranks(**args))
    print(RESULT + json.dumps(out), flush=True)


# --------------------------------------------------------------------------- the coordinator


def _proc_cpu_s(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


#: Steady training is measured once the coordinator is quiet after the storm: its CPU under this share of a
#: core over SETTLE_EVERY_S (at most SETTLE_MAX_S after the storm).
SETTLE_CORES, SETTLE_EVERY_S, SETTLE_MAX_S = 0.05, 0.5, 30.0


def _settle(pid: int) -> float:
    """Seconds until the coordinator `pid` finished the storm's work (its CPU under SETTLE_CORES).

    NOTE: grpc.aio finishes the storm's calls (their completions and tasks) for a second or two after the
    ranks have their answers, holding the event loop; steady training is what comes after. The sleeps are
    the intervals the CPU is sampled over, not synchronisation: the loop ends on the figure, or SETTLE_MAX_S.
    """
    t0 = time.monotonic()
    cpu = _proc_cpu_s(pid)
    while time.monotonic() - t0 < SETTLE_MAX_S:
        time.sleep(SETTLE_EVERY_S)
        now = _proc_cpu_s(pid)
        if now - cpu < SETTLE_CORES * SETTLE_EVERY_S:
            break
        cpu = now
    return time.monotonic() - t0


def storm(world: int, drivers: int, lease: int = 64, profile: str | None = None,
          steady: dict[str, float] | None = None, serving: baseline.Serving = baseline.CURRENT) -> dict[str, Any]:
    """One join storm of `world` ranks on a fresh `croupier serve` of `serving`'s code; its figures (and, with
    `steady`, the figures of the steady training that follows it: see `_ranks`)."""
    with tempfile.TemporaryDirectory() as tmp:
        serve = subprocess.Popen([sys.executable, "-m", "croupier.tools.cli", "serve", "--port", "0", "--store",
                                  f"sqlite:///{tmp}/c.db"], stdout=subprocess.PIPE, text=True, env=serving.environ())
        try:
            assert serve.stdout is not None
            line = serve.stdout.readline().strip()
            if not line.startswith("listening on "):
                raise RuntimeError(f"croupier serve did not start: {line!r}")
            address = line.split()[-1]
            cpu0, rss0 = _proc_cpu_s(serve.pid), _proc_rss(serve.pid)
            def record() -> subprocess.Popen[bytes] | None:
                return (subprocess.Popen(["py-spy", "record", "-o", profile, "-r", "200", "--gil", "--pid", str(serve.pid),
                                          "-f", "raw"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                        if profile else None)

            spy = None if steady is not None else record()  # steady training: its window alone
            parts = [list(range(world))[i::drivers] for i in range(drivers)]
            procs = [subprocess.Popen([sys.executable, str(BENCH), "--driver", json.dumps(dict(
                address=address, job="storm", incarnation=f"w{world}", world=world, ranks=p,
                lease=lease if steady is None else int(steady["lease"]), steady=steady, poll_ms=serving.join_poll_ms))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for p in parts]
            window: dict[str, Any] = {}
            if steady is not None:
                for p in procs:  # every rank has its first batch: the storm is over
                    assert p.stdout is not None
                    for line in p.stdout:
                        if line.strip() == "READY":
                            break
                    else:
                        raise RuntimeError(f"a driver ended before its storm did (exit {p.wait()})")
                spy = record()
                window["settle_s"] = _settle(serve.pid)
                window["cpu"] = _proc_cpu_s(serve.pid)
                window["t0"] = time.monotonic() + 0.2
                for p in procs:
                    assert p.stdin is not None
                    p.stdin.write(f"GO {window['t0']}\n")
                    p.stdin.flush()
            results = []
            for p in procs:
                out, _ = p.communicate(timeout=900)
                lines = [x for x in out.splitlines() if x.startswith(RESULT)]
                if p.returncode != 0 or not lines:
                    raise RuntimeError(f"a driver failed (exit {p.returncode}):\n{out[-3000:]}")
                results.append(json.loads(lines[-1][len(RESULT):]))
            cpu, rss = window.get("cpu", _proc_cpu_s(serve.pid)) - cpu0, _proc_rss(serve.pid) - rss0
            if steady is not None:
                window["cores"] = (_proc_cpu_s(serve.pid) - window["cpu"]) / (time.monotonic() - window["t0"])
            if spy is not None:
                spy.send_signal(2)
                spy.wait(timeout=60)
        finally:
            serve.terminate()
            serve.wait(timeout=60)
    joined = [t for r in results for t in r["joined"].values()]
    first = np.array([t for r in results for t in r["first"].values()])
    sent = min(r["sent"] for r in results)
    # NOTE: the generation starts with the last rank's join; the first answer that says it started
    # comes back to that rank (or to a rank waiting in a long poll) right after it. That answer is
    # the last join, as the ranks can see it.
    last_join = min(t for r in results for t in r["started"].values())
    after = (first - last_join) * 1e3  # ms from the last join to each rank's first batch
    if steady is not None:
        lat = np.array([x for r in results for x in r["steady"]["latencies_ms"]])
        window.update(serving=serving.label, world=world, lease=int(steady["lease"]), step_s=steady["step_s"],
                      duration_s=steady["duration_s"],
                      grants=len(lat), grants_per_s=len(lat) / steady["duration_s"],
                      failed=sum(r["steady"]["failed"] for r in results),
                      grant_p50_ms=float(np.percentile(lat, 50)) if len(lat) else math.nan,
                      grant_p99_ms=float(np.percentile(lat, 99)) if len(lat) else math.nan,
                      grant_max_ms=float(lat.max()) if len(lat) else math.nan,
                      late_p99_ms=max(r["steady"]["late_p99_ms"] for r in results))
    return {
        "steady": window or None, "serving": serving.label, "poll_ms": serving.join_poll_ms,
        "world": world, "joins_per_s": world / max(max(joined) - sent, 1e-9),
        "first_p50_ms": float(np.percentile(after, 50)), "first_p99_ms": float(np.percentile(after, 99)),
        "first_max_ms": float(after.max()), "storm_s": float(first.max() - sent),
        "cpu_s": cpu, "cpu_ms_per_rank": cpu / world * 1e3, "rss_bytes_per_rank": rss / world,
        **{k: sum(r[k] for r in results) for k in ("refused_waits", "refused", "cancelled", "cancelled_grants", "retried",
                                                        "ungranted")},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="1024,4096,16384", help="world sizes, comma-separated")
    ap.add_argument("--drivers", type=int, default=4, help="driver processes the ranks are spread over")
    ap.add_argument("--out", help="write the table (markdown) here too")
    ap.add_argument("--profile", help="record the coordinator with py-spy into this file (raw, collapsed stacks; "
                    "of steady training, its window alone)")
    ap.add_argument("--jobs", type=int, default=0,
                    help="also: a coordinator of this many jobs (1 to 512 ranks each) recovered after kill -9")
    ap.add_argument("--events", type=int, default=1_000_000, help="events journaled for --jobs (default 1e6)")
    ap.add_argument("--snapshot-every", type=int, default=1000, help="the coordinator's --snapshot-every for --jobs")
    ap.add_argument("--steady", type=int, default=0, help="also: steady training of this many ranks after their storm")
    ap.add_argument("--steady-lease", default="256",
                    help="batches per grant in steady training, comma-separated for several runs (default: the batch "
                         "sampler's default lease)")
    ap.add_argument("--steady-step", type=float, default=1.0, help="seconds per training step (default 1)")
    ap.add_argument("--steady-duration", type=float, default=0.0,
                    help="seconds of steady training measured (default: one lease's period, so every rank asks once)")
    ap.add_argument("--baseline", metavar="REF",
                    help=f"also: the same storms and steady training on REF's coordinator (e.g. {baseline.THREADED}, the "
                         "threaded serving), its joins polling 500 ms as its client did")
    ap.add_argument("--driver", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.driver:
        _driver(json.loads(args.driver))
        return 0
    with contextlib.ExitStack() as stack:
        servings = [baseline.CURRENT]
        if args.baseline:
            servings.append(stack.enter_context(baseline.baseline(args.baseline)))
        table, rows = measure(args, servings)
    print(table)
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table + "\n")
        if len({r["world"] for r in rows}) > 1:
            scale_report.plot(rows, out.with_suffix(".png"))
    return 0


def measure(args: argparse.Namespace, servings: list[baseline.Serving]) -> tuple[str, list[dict[str, Any]]]:
    """The runs `args` ask for, on each of `servings`' coordinators; the tables and the storm's rows."""
    rows = []
    for w in [int(x) for x in args.worlds.split(",") if x]:
        mine = [storm(w, args.drivers, profile=args.profile, serving=s) for s in servings]
        ceiling = scale_ceiling.ceiling(w, args.drivers)
        for r in mine:
            r["ceiling"] = ceiling
            print(json.dumps(r), flush=True)
        rows.extend(mine)
    table = scale_report.render(rows) if rows else ""
    if args.steady:
        steady = []
        for lease in [int(x) for x in args.steady_lease.split(",")]:
            # by default, one lease's period: every rank asks its grant once
            duration = args.steady_duration or lease * args.steady_step
            for s in servings:
                steady.append(storm(args.steady, args.drivers, profile=args.profile, serving=s, steady=dict(
                    lease=lease, step_s=args.steady_step, duration_s=duration))["steady"])
                print(json.dumps(steady[-1]), flush=True)
        table += ("\n\n" if table else "") + scale_report.render_steady(steady)
    if args.jobs:
        rec = scale_recovery.recovery(args.jobs, args.events, args.snapshot_every)
        print(json.dumps(rec), flush=True)
        table += ("\n\n" if table else "") + scale_recovery.render(rec)
    return table, rows


if __name__ == "__main__":
    sys.exit(main())
