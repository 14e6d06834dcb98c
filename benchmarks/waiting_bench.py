"""Joins waiting at once on one coordinator (10,000 by default): its RSS and CPU while they wait, and the time to answer them all.

A job of ``--ranks`` + 1 ranks: every rank but the last joins and waits for the generation to start,
long-polling as its client does (5 s on this tree's coordinator, 0.5 s on the threaded one of
``--baseline REF``, which holds at most ``--max-concurrent-joins`` (96) waits and refuses the rest, who
back off up to 2 s and ask again). Once the coordinator says (GetJob) that only the last rank is
missing, the coordinator's CPU time and RSS are read over ``--window`` seconds of waiting (from
/proc), and the drivers count the joins in flight (sent, not answered yet) every half second. Then
the last rank joins; the time from its join to each waiting rank's answer that the generation
started is the time to answer them all.

    python benchmarks/waiting_bench.py --baseline 42a3d40      # 10,000 waiting joins, both servings
    python benchmarks/waiting_bench.py --ranks 200 --window 1  # a quick run (the suite's)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

import baseline
import numpy as np
from scale_recovery import RESULT, proc_rss

from croupier.core.api import MAX_JOIN_WAIT_S

BENCH = pathlib.Path(__file__).resolve()
JOB = "waiting"
#: Channels of a driver process (HTTP/2 connections): ranks on many machines would have one each.
CHANNELS = 16


async def _ranks(address: str, world: int, ranks: list[int], poll_ms: int) -> dict[str, Any]:
    """Joins `ranks` and keeps them waiting as the client does; answers the parent's ``COUNT`` lines with the joins in
    flight (and the refusals so far); returns when every rank has learnt that the generation started."""
    import grpc

    from croupier.client import CHANNEL_OPTIONS
    from croupier.client._rpc import RETRY_AFTER_KEY
    from croupier.core.spec import Spec
    from croupier.core.wire import spec_to_proto
    from croupier.v1 import coordinator_pb2 as pb
    from croupier.v1 import coordinator_pb2_grpc as pb_grpc

    spec = spec_to_proto(Spec(n=world * 4, batch_size=1))
    channels = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(CHANNELS)]
    for ch in channels:
        await ch.channel_ready()
    stubs = [pb_grpc.CoordinatorStub(ch) for ch in channels]
    started: dict[int, float] = {}
    n = {"inflight": 0, "refused": 0, "polls": 0, "errors": 0}

    async def rank(r: int) -> None:
        req = pb.JoinRequest(request_id=f"w-{r}", job=JOB, spec=spec, incarnation="w", world=world, rank=r,
                             wait_ms=poll_ms)
        busy = 0.05
        while True:
            n["inflight"] += 1
            n["polls"] += 1
            try:
                resp = await stubs[r % len(stubs)].Join(req, timeout=600)
            except grpc.aio.AioRpcError as e:
                n["inflight"] -= 1
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    n["errors"] += 1
                    await asyncio.sleep(0.05 * (0.5 + np.random.random()))  # the client's backoff, not synchronisation
                    continue
                n["refused"] += 1
                hint = dict(e.trailing_metadata() or ()).get(RETRY_AFTER_KEY)
                # NOTE: the coordinator's hint, or the threaded client's backoff between two asks (up to 2 s)
                wait = int(hint) / 1000 if hint is not None else busy
                busy = min(busy * 2, 2.0)
                await asyncio.sleep(wait * (0.5 + np.random.random()))  # not synchronisation
                continue
            n["inflight"] -= 1
            if resp.started:
                started[r] = time.monotonic()
                return

    async def commands() -> None:
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            if line.strip() == "COUNT":
                print(f"COUNT {n['inflight']} {n['refused']} {n['polls']}", flush=True)

    reader = asyncio.ensure_future(commands())
    print("READY", flush=True)
    await asyncio.gather(*(rank(r) for r in ranks))
    reader.cancel()
    for ch in channels:
        await ch.close()
    return {"started": list(started.values()), "refused": n["refused"], "polls": n["polls"], "errors": n["errors"]}


def _driver(args: dict[str, Any]) -> None:
    out = asyncio.run(_ranks(**args))
    print(RESULT + json.dumps(out), flush=True)
    os._exit(0)  # the stdin reader's thread may still block on its read


def _cpu_s(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _waiting(address: str) -> int | None:
    """How many ranks the job's generation waits for, as GetJob says (None: no job yet, or no answer while the joins
    flood the coordinator: the threaded one cancels calls past gRPC's pending limit)."""
    import grpc

    from croupier.v1 import coordinator_pb2 as pb
    from croupier.v1 import coordinator_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            return int(pb_grpc.CoordinatorStub(ch).GetJob(pb.GetJobRequest(job=JOB), timeout=10).waiting)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
                return None
            raise


def _join_last(address: str, world: int) -> tuple[float, float]:
    """The last rank's join (no wait); when it was sent and answered (CLOCK_MONOTONIC)."""
    import grpc

    from croupier.core.spec import Spec
    from croupier.core.wire import spec_to_proto
    from croupier.v1 import coordinator_pb2 as pb
    from croupier.v1 import coordinator_pb2_grpc as pb_grpc

    req = pb.JoinRequest(request_id="w-last", job=JOB, spec=spec_to_proto(Spec(n=world * 4, batch_size=1)),
                         incarnation="w", world=world, rank=world - 1, wait_ms=0)
    with grpc.insecure_channel(address) as ch:
        grpc.channel_ready_future(ch).result(timeout=60)  # connected before the clock starts
        stub = pb_grpc.CoordinatorStub(ch)
        sent = time.monotonic()
        while True:
            try:
                resp = stub.Join(req, timeout=60)
                break
            except grpc.RpcError as e:  # as the client asks again (the threaded coordinator cancels calls in a flood)
                if e.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.DEADLINE_EXCEEDED) or time.monotonic() - sent > 300:
                    raise
                time.sleep(0.05)  # NOTE: the client's backoff, not synchronisation
        if not resp.started:
            raise RuntimeError(f"the last rank's join did not start the generation ({resp})")
        return sent, time.monotonic()


def waiting(ranks: int, drivers: int, window_s: float, serving: baseline.Serving) -> dict[str, Any]:
    """`ranks` joins waiting on a fresh ``croupier serve`` of `serving`'s code; its figures."""
    from croupier.tools.serve import start_serve

    world = ranks + 1
    with tempfile.TemporaryDirectory() as tmp, open(pathlib.Path(tmp, "serve.log"), "w+") as log:
        serve, address = start_serve(0, f"sqlite:///{tmp}/c.db", log, env=serving.environ())
        procs: list[subprocess.Popen[str]] = []
        try:
            cpu0, rss0 = _cpu_s(serve.pid), proc_rss(serve.pid)
            shares = [list(range(ranks))[i::drivers] for i in range(drivers)]
            procs = [subprocess.Popen([sys.executable, str(BENCH), "--driver", json.dumps(dict(
                address=address, world=world, ranks=p, poll_ms=serving.join_poll_ms))], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True) for p in shares]
            for p in procs:
                assert p.stdout is not None
                if p.stdout.readline().strip() != "READY":
                    raise RuntimeError(f"a driver did not start (exit {p.wait()})")
            began = time.monotonic()
            # NOTE: a poll of the coordinator's own account (GetJob), with a deadline: the state waited for is
            # the coordinator's, which only it can tell.
            while _waiting(address) != 1:
                if time.monotonic() - began > 600:
                    raise RuntimeError(f"{ranks} joins not all recorded within 600 s")
                time.sleep(0.1)
            joined_s = time.monotonic() - began
            t0, cpu_a = time.monotonic(), _cpu_s(serve.pid)
            counts, rss, refused = [], [], []
            while time.monotonic() - t0 < window_s:
                rss.append(proc_rss(serve.pid))
                got = [_count(p) for p in procs]
                counts.append(sum(g[0] for g in got))
                refused.append(sum(g[1] for g in got))
                time.sleep(0.5)  # NOTE: the sampling period of the window, not synchronisation
            cores = (_cpu_s(serve.pid) - cpu_a) / (time.monotonic() - t0)
            sent, answered = _join_last(address, world)
            results = []
            for p in procs:
                out, _ = p.communicate(timeout=300)  # closes its stdin: its reader of COUNT lines ends
                lines = [x for x in out.splitlines() if x.startswith(RESULT)]
                if p.returncode != 0 or not lines:
                    raise RuntimeError(f"a driver failed (exit {p.returncode}):\n{out[-3000:]}")
                results.append(json.loads(lines[-1][len(RESULT):]))
            cpu_all = _cpu_s(serve.pid) - cpu0
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            serve.terminate()
            serve.wait(timeout=60)
    after = (np.array([t for r in results for t in r["started"]]) - sent) * 1e3
    return {"serving": serving.label, "poll_ms": serving.join_poll_ms, "ranks": ranks, "window_s": window_s,
            "joined_s": joined_s, "held_min": min(counts), "held_mean": float(np.mean(counts)), "cores": cores,
            "rss_before": rss0, "rss_waiting": float(np.mean(rss)), "rss_per_join": (float(np.mean(rss)) - rss0) / ranks,
            "refused_per_s": (refused[-1] - refused[0]) / max(window_s - 0.5, 0.5) if len(refused) > 1 else 0.0,
            "last_join_ms": (answered - sent) * 1e3, "answered": len(after),
            "answer_p50_ms": float(np.percentile(after, 50)), "answer_max_ms": float(after.max()),
            "refused": sum(r["refused"] for r in results), "errors": sum(r["errors"] for r in results),
            "cpu_s": cpu_all}


def _count(p: subprocess.Popen[str]) -> tuple[int, int]:
    """A driver's joins in flight and refusals so far."""
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("COUNT\n")
    p.stdin.flush()
    line = p.stdout.readline().split()
    if not line or line[0] != "COUNT":
        raise RuntimeError(f"a driver did not answer COUNT: {line!r}")
    return int(line[1]), int(line[2])


def render(rows: list[dict[str, Any]]) -> str:
    """The table: a row per serving."""
    lines = ["| serving, join poll | ranks waiting | joins held in flight, least / mean | coordinator RSS before / while "
             "waiting (per waiting rank) | coordinator cores while waiting | refusals/s while waiting | the last join's "
             "answer | every waiting rank answered after the last join, p50 / max |", "|" + "---|" * 8]
    for r in rows:
        mib = 1 << 20
        lines.append(
            f"| {r['serving']}, {r['poll_ms'] / 1000:g} s poll | {r['ranks']:,} | {r['held_min']:,} / {r['held_mean']:,.0f} | "
            f"{r['rss_before'] / mib:.0f} / {r['rss_waiting'] / mib:.0f} MiB ({r['rss_per_join'] / 1024:.1f} KiB) | "
            f"{r['cores']:.3f} | {r['refused_per_s']:,.0f} | {r['last_join_ms']:.0f} ms | "
            f"{r['answer_p50_ms']:,.0f} / {r['answer_max_ms']:,.0f} ms ({r['answered']:,} of {r['ranks']:,}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=10_000, help="joins that wait (the job has one rank more)")
    ap.add_argument("--drivers", type=int, default=4, help="driver processes the ranks are spread over")
    ap.add_argument("--window", type=float, default=10.0, help="seconds of waiting measured")
    ap.add_argument("--poll-ms", default=str(baseline.POLL_MS),
                    help="this tree's joins' long poll (ms), comma-separated for a run of each (default: the client's, "
                         f"{baseline.POLL_MS}; {int(MAX_JOIN_WAIT_S * 1000)}, the longest the coordinator holds a join, "
                         "measures the waits without their asking again)")
    ap.add_argument("--baseline", metavar="REF", help=f"also on REF's coordinator (e.g. {baseline.THREADED})")
    ap.add_argument("--out", help="write the table (markdown) here too")
    ap.add_argument("--driver", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.driver:
        _driver(json.loads(args.driver))
        return 0
    for name, value in (("--ranks", args.ranks), ("--drivers", args.drivers)):
        if value < 1:
            ap.error(f"{name} must be >= 1 (got {value})")
    if args.window < 0.5:
        ap.error(f"--window must be >= 0.5 s, a sample every half second (got {args.window})")
    try:
        polls = [int(x) for x in args.poll_ms.split(",")]
    except ValueError:
        ap.error(f"--poll-ms must be milliseconds, comma-separated (got {args.poll_ms!r})")
    if not polls or not all(0 < x <= MAX_JOIN_WAIT_S * 1000 for x in polls):
        ap.error(f"--poll-ms must each be in 1 .. {int(MAX_JOIN_WAIT_S * 1000)} (got {args.poll_ms!r})")
    rows = []
    with contextlib.ExitStack() as stack:
        servings = [dataclasses.replace(baseline.CURRENT, join_poll_ms=x) for x in polls]
        if args.baseline:
            servings.append(stack.enter_context(baseline.baseline(args.baseline)))
        for s in servings:
            rows.append(waiting(args.ranks, args.drivers, args.window, s))
            print(json.dumps(rows[-1]), flush=True)
    table = render(rows)
    print(table)
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
