"""The ceiling under the join storm's latency: what this machine's gRPC stack alone takes to answer a world.

A server that does nothing but hold calls (``grpc.aio``, one event loop, no thread per call) takes one
call from each of `world` ranks and answers them all at once when the last arrives; each rank then
makes one more, empty call (as a rank asks its first grant after its join's answer). The ranks are
asyncio clients in the same driver processes, on the same cores, as the join storm's. The time from
the release to each rank's second answer is the least any coordinator written on this stack could
take to give a world its first batch here: no journal, no state, no Python of ours in the way.

    python benchmarks/scale_ceiling.py --worlds 1024,16384
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import struct
import subprocess
import sys
import time
from typing import Any

import numpy as np

HERE = pathlib.Path(__file__).resolve()
RESULT = "RESULT "
_HOLD, _ECHO = "/ceiling.Hold/Hold", "/ceiling.Hold/Echo"


async def _serve(world: int) -> None:
    import grpc

    from croupier.server._grpc import SERVER_OPTIONS

    arrived = 0
    released = asyncio.Event()
    at = [0.0]

    async def hold(raw: bytes, context: Any) -> bytes:
        nonlocal arrived
        arrived += 1
        if arrived == world:
            at[0] = time.monotonic()
            released.set()
        await released.wait()
        return struct.pack("d", at[0])

    async def echo(raw: bytes, context: Any) -> bytes:
        return raw

    # NOTE: gRPC cancels the calls that arrive past 1,000 (3,000 at most) not yet taken by the server;
    # this server takes them as fast as it can, and the limits are raised so that none is refused.
    server = grpc.aio.server(options=[*SERVER_OPTIONS, ("grpc.server.max_pending_requests", 1 << 20),
                                      ("grpc.server.max_pending_requests_hard_limit", 1 << 20)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("ceiling.Hold", {
        "Hold": grpc.unary_unary_rpc_method_handler(hold), "Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # until the parent is done
    await server.stop(0)


async def _ranks(address: str, ranks: int) -> dict[str, Any]:
    import grpc

    from croupier.client import CHANNEL_OPTIONS

    # A connection for every 64 ranks (ranks on many machines would have one each): one HTTP/2
    # connection holding thousands of calls would measure the connection.
    channels = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(max(1, -(-ranks // 64)))]
    for ch in channels:
        await ch.channel_ready()
    holds = [ch.unary_unary(_HOLD) for ch in channels]
    echoes = [ch.unary_unary(_ECHO) for ch in channels]
    after: list[float] = []
    second: list[float] = []

    async def rank(r: int) -> None:
        released = struct.unpack("d", await holds[r % len(holds)](b"", timeout=300))[0]
        sent = time.monotonic()
        await echoes[r % len(echoes)](b"x", timeout=300)
        after.append(time.monotonic() - released)
        second.append(time.monotonic() - sent)

    await asyncio.gather(*(rank(r) for r in range(ranks)))
    for ch in channels:
        await ch.close()
    return {"after": after, "second": second}


def ceiling(world: int, drivers: int) -> dict[str, Any]:
    """The hold server and `drivers` processes of ranks; the time from the release to each rank's second answer."""
    server = subprocess.Popen([sys.executable, str(HERE), "--serve", str(world)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdin is not None
        line = server.stdout.readline().strip()
        if not line.startswith("listening on "):
            raise RuntimeError(f"the hold server did not start: {line!r}")
        address = line.split()[-1]
        shares = [world // drivers + (i < world % drivers) for i in range(drivers)]
        procs = [subprocess.Popen([sys.executable, str(HERE), "--driver", json.dumps({"address": address, "ranks": n})],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in shares]
        after: list[float] = []
        second: list[float] = []
        for p in procs:
            out, _ = p.communicate(timeout=600)
            lines = [x for x in out.splitlines() if x.startswith(RESULT)]
            if p.returncode != 0 or not lines:
                raise RuntimeError(f"a ceiling driver failed (exit {p.returncode}):\n{out[-3000:]}")
            got = json.loads(lines[-1][len(RESULT):])
            after.extend(got["after"])
            second.extend(got["second"])
        server.stdin.write("\n")
        server.stdin.flush()
        server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    a = np.array(after) * 1e3
    # the second call's own time: how many ranks even a bare server answers later than the client's 1 s for a grant
    late = int(sum(x > 1.0 for x in second))
    return {"world": world, "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max()), "second_over_1s": late}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="1024,16384")
    ap.add_argument("--drivers", type=int, default=4)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--driver", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.serve))
        return 0
    if args.driver:
        print(RESULT + json.dumps(asyncio.run(_ranks(**json.loads(args.driver)))), flush=True)
        return 0
    for w in [int(x) for x in args.worlds.split(",") if x]:
        print(json.dumps(ceiling(w, args.drivers)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
