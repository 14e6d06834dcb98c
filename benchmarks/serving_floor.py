"""The floor under the coordinator's call rate: gRPC's synchronous server against grpc.aio, both doing nothing.

Each server answers an empty unary call with its request; the same load (`ranks` grpc.aio clients calling back
to back from a process of their own) is run against each in turn, several rounds, and each round reports the
calls per second and the server's CPU time per call. What one serving costs more than the other here is the
stack's, not croupier's: the coordinator's own ratio (benchmarks/ha_bench.py --baseline) is read against it.

    python benchmarks/serving_floor.py --ranks 64 --seconds 4 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from concurrent import futures
from typing import Any

_ECHO = "/floor.Echo/Echo"


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _serve(kind: str) -> None:
    import grpc

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from croupier.server._grpc import SERVER_OPTIONS

    handlers = (grpc.method_handlers_generic_handler("floor.Echo", {
        "Echo": grpc.unary_unary_rpc_method_handler((lambda raw, ctx: raw) if kind == "threads" else _aecho)}),)
    if kind == "threads":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=128), options=SERVER_OPTIONS)
        server.add_generic_rpc_handlers(handlers)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        print(f"listening on 127.0.0.1:{port}", flush=True)
        sys.stdin.readline()
        server.stop(0)
        return

    async def main() -> None:
        aserver = grpc.aio.server(options=SERVER_OPTIONS)
        aserver.add_generic_rpc_handlers(handlers)
        port = aserver.add_insecure_port("127.0.0.1:0")
        await aserver.start()
        print(f"listening on 127.0.0.1:{port}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        await aserver.stop(0)

    asyncio.run(main())


async def _aecho(raw: bytes, context: Any) -> bytes:
    return raw


async def _load(address: str, ranks: int, seconds: float) -> float:
    import grpc

    channels = [grpc.aio.insecure_channel(address) for _ in range(2)]
    calls = [ch.unary_unary(_ECHO) for ch in channels]
    done = 0
    end = time.perf_counter() + seconds

    async def rank(r: int) -> None:
        nonlocal done
        while time.perf_counter() < end:
            await calls[r % 2](b"x" * 64)
            done += 1

    await asyncio.gather(*(rank(r) for r in range(ranks)))
    for ch in channels:
        await ch.close()
    return done / seconds


def measure(kind: str, ranks: int, seconds: float) -> dict[str, float]:
    """One round against a fresh server of `kind` (``threads`` or ``aio``): calls/s and server CPU per call."""
    server = subprocess.Popen([sys.executable, __file__, "--serve", kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert server.stdout is not None and server.stdin is not None
        address = server.stdout.readline().split()[-1]
        load = subprocess.Popen([sys.executable, __file__, "--load", json.dumps([address, ranks, seconds])],
                                stdout=subprocess.PIPE, text=True)
        c0 = _cpu_s(server.pid)
        out, _ = load.communicate(timeout=seconds + 60)
        cpu = _cpu_s(server.pid) - c0
        rate = float(out.strip().splitlines()[-1])
        server.stdin.write("\n")
        server.stdin.flush()
        server.wait(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
    return {"calls_per_s": rate, "cpu_us_per_call": cpu / (rate * seconds) * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--load", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        _serve(args.serve)
        return 0
    if args.load:
        address, ranks, seconds = json.loads(args.load)
        print(asyncio.run(_load(address, ranks, seconds)), flush=True)
        return 0
    rows = []
    for _ in range(args.rounds):
        for kind in ("threads", "aio"):
            rows.append({"serving": kind, **measure(kind, args.ranks, args.seconds)})
            print(json.dumps(rows[-1]), flush=True)
    for kind in ("threads", "aio"):
        mine = [r for r in rows if r["serving"] == kind]
        rate = sorted(r["calls_per_s"] for r in mine)[len(mine) // 2]
        cpu = sorted(r["cpu_us_per_call"] for r in mine)[len(mine) // 2]
        print(f"{kind}: median {rate:,.0f} calls/s, {cpu:.0f} us server CPU per call ({args.ranks} ranks, {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
