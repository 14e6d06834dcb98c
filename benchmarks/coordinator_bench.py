"""Coordinator capacity: lease throughput and latency with many simulated ranks, and durable-commit latency.

Runs `croupier serve` on a SQLite store in a temporary directory, then:
  * for 8, 64 and 512 simulated ranks of one job, spread over client processes, every rank
    leases batches back to back (several batches per call, as the client does) for a while;
    prints aggregate batches/s, RPCs/s and p50/p99 call latency, beside the floor of an empty
    gRPC call (GetJob of an unknown job) on the same loopback;
  * durable commits: join latency p50/p99 (each join is journaled and fsync'd before the
    answer), one at a time and 32 at once (they share commits).

Usage: python benchmarks/coordinator_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np

from croupier.server._spec import Spec
from croupier.server._wire import CHANNEL_OPTIONS, spec_to_proto
from croupier.v1 import coordinator_pb2 as pb
from croupier.v1 import coordinator_pb2_grpc as pb_grpc

SPEC = Spec(n=10**8, seed=0, batch_size=256)
LEASE_AHEAD = 8


def _start_server(store: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "croupier.server._cli", "serve", "--port", "0", "--store", store],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        raise SystemExit(f"server did not start: {line!r}")
    return proc, line.split()[-1]


async def _join_all(address: str, job: str, world: int) -> int:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        reqs = [pb.JoinRequest(request_id=f"{job}-{r}", job=job, spec=spec_to_proto(SPEC), token="t", world=world,
                               rank=r, wait_ms=20000) for r in range(world)]
        replies = await asyncio.gather(*(stub.Join(m) for m in reqs))
        assert all(r.started for r in replies)
        return int(replies[0].generation)


async def _drive(address: str, job: str, gen: int, ranks: list[int], seconds: float) -> tuple[int, list[float]]:
    lat: list[float] = []
    batches = 0
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        end = time.perf_counter() + seconds

        async def rank_loop(r: int) -> None:
            nonlocal batches
            j = 0
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                resp = await stub.Lease(pb.LeaseRequest(job=job, generation=gen, rank=r, epoch=0, first_batch=j, count=LEASE_AHEAD))
                lat.append(time.perf_counter() - t0)
                got = len(resp.sizes)
                np.frombuffer(resp.indices, dtype="<u4")  # what the client does with it
                batches += got
                j += got

        await asyncio.gather(*(rank_loop(r) for r in ranks))
    return batches, lat


def _client_proc(address: str, job: str, gen: int, ranks: list[int], seconds: float, out: mp.Queue) -> None:
    out.put(asyncio.run(_drive(address, job, gen, ranks, seconds)))


async def _floor(address: str, seconds: float) -> tuple[int, list[float]]:
    lat: list[float] = []
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            try:
                await stub.GetJob(pb.GetJobRequest(job="no-such-job"))
            except grpc.aio.AioRpcError:
                pass
            lat.append(time.perf_counter() - t0)
    return len(lat), lat


async def _commits(address: str, count: int, concurrent: int) -> list[float]:
    lat: list[float] = []
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        sem = asyncio.Semaphore(concurrent)

        async def one(i: int) -> None:
            async with sem:
                t0 = time.perf_counter()
                await stub.Join(pb.JoinRequest(request_id=f"c{i}", job=f"commit-{i}", spec=spec_to_proto(SPEC),
                                               token="t", world=1, rank=0))
                lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(one(i) for i in range(count)))
    return lat


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs) * 1000, q)) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short run that only checks the benchmark works")
    ap.add_argument("--procs", type=int, default=2, help="client processes (default 2)")
    args = ap.parse_args()
    seconds = 0.5 if args.quick else 5.0
    rank_counts = [8, 64] if args.quick else [8, 64, 512]
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_server(f"sqlite:///{tmp}/bench.db")
        try:
            n, lat = asyncio.run(_floor(address, seconds))
            print(f"machine: {os.cpu_count()} cores; server and clients share it; {LEASE_AHEAD} batches of "
                  f"{SPEC.batch_size} per lease")
            print(f"\n{'ranks':>6} {'batches/s':>11} {'leases/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'RPCs/step/rank':>15}")
            print(f"{'floor':>6} {'':>11} {n / seconds:>10.0f} {_pct(lat, 50):>8.2f} {_pct(lat, 99):>8.2f} {'(empty call)':>15}")
            for ranks in rank_counts:
                job = f"bench-{ranks}"
                gen = asyncio.run(_join_all(address, job, ranks))
                q: mp.Queue = mp.get_context("spawn").Queue()
                groups = [list(range(ranks))[i:: args.procs] for i in range(args.procs)]
                ps = [mp.get_context("spawn").Process(target=_client_proc, args=(address, job, gen, g, seconds, q)) for g in groups]
                for p in ps:
                    p.start()
                results = [q.get() for _ in ps]
                for p in ps:
                    p.join()
                total = sum(b for b, _ in results)
                lats = [x for _, ls in results for x in ls]
                print(f"{ranks:>6} {total / seconds:>11.0f} {len(lats) / seconds:>10.0f} {_pct(lats, 50):>8.2f} "
                      f"{_pct(lats, 99):>8.2f} {1 / LEASE_AHEAD:>15.3f}")
            count = 20 if args.quick else 200
            print(f"\n{'durable commit (join)':<28} {'p50 ms':>8} {'p99 ms':>8} {'joins/s':>9}")
            for conc in (1, 32):
                t0 = time.perf_counter()
                lat = asyncio.run(_commits(address, count, conc))
                dt = time.perf_counter() - t0
                print(f"{f'{conc} at a time':<28} {_pct(lat, 50):>8.2f} {_pct(lat, 99):>8.2f} {count / dt:>9.0f}")
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
