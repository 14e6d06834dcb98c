"""Limits: a flood of joins for new jobs is refused (RESOURCE_EXHAUSTED) while a real job's leases stay fast; requests over the size limit are refused and counted."""

from __future__ import annotations

import pathlib
import statistics
import subprocess
import sys
import time

import grpc
import pytest
from _ranks import on_ranks

from croupier.client._rpc import CoordinatorClient
from croupier.core.api import JoinRequest
from croupier.core.spec import Spec
from croupier.core.wire import SERVICE, spec_to_proto
from croupier.v1 import coordinator_pb2 as pb

SPEC = Spec(n=100_000, seed=1)
FLOOD = """
import sys, threading, time, uuid, grpc
sys.path[:0] = []
from croupier.core.spec import Spec
from croupier.core.wire import spec_to_proto
from croupier.v1 import coordinator_pb2 as pb
address, seconds = sys.argv[1], float(sys.argv[2])
spec = spec_to_proto(Spec(n=1000))
counts = {}
lock = threading.Lock()
def flood(k):
    with grpc.insecure_channel(address) as ch:
        join = ch.unary_unary("/croupier.v1.Coordinator/Join")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            m = pb.JoinRequest(request_id=uuid.uuid4().hex, job=f"flood-{uuid.uuid4().hex[:8]}", spec=spec, incarnation="t",
                               world=2, rank=0, wait_ms=500 if k % 2 else 0)
            try:
                join(m.SerializeToString(), timeout=10)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            with lock:
                counts[code] = counts.get(code, 0) + 1
print("ready", flush=True)
threads = [threading.Thread(target=flood, args=(k,)) for k in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print(" ".join(f"{k}={v}" for k, v in sorted(counts.items())), flush=True)
"""


def _latencies(c: CoordinatorClient, gen: int, seconds: float) -> list[float]:
    """Lease round trips of the job's rank 0, back to back, for `seconds`."""
    out, first = [], 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        lease = c.lease("real", gen, 0, 0, first, 64)
        out.append(time.perf_counter() - t)
        first = 0 if lease.end_of_epoch else first + len(lease.sizes)
    return out


def _p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98]


@pytest.mark.e2e
def test_a_join_flood_is_refused_while_a_job_trains(tmp_path: pathlib.Path, serve_process: type) -> None:
    p = serve_process(f"sqlite:///{tmp_path}/c.db", args=("--max-jobs", "8", "--max-concurrent-joins", "4",
                                                           "--max-world", "64"))
    with CoordinatorClient(p.address, retry_for=10.0) as c:
        gen = on_ranks(2, lambda r: c.join_started(JoinRequest("real", SPEC, "t", 2, r), timeout=20))[0].generation
        _latencies(c, gen, 0.5)  # warm
        quiet = _latencies(c, gen, 3.0)
        flood = subprocess.Popen([sys.executable, "-c", FLOOD, p.address, "4"], stdout=subprocess.PIPE, text=True)
        assert flood.stdout is not None and flood.stdout.readline() == "ready\n"
        loaded = _latencies(c, gen, 3.0)
        out, _ = flood.communicate(timeout=60)
        counts = dict(kv.split("=") for kv in out.split())
        print(f"leases: unloaded p99 {_p99(quiet) * 1e3:.2f} ms ({len(quiet)}), under the flood p99 "
              f"{_p99(loaded) * 1e3:.2f} ms ({len(loaded)}); flood: {counts}")
        assert int(counts.get("RESOURCE_EXHAUSTED", 0)) > 0, counts
        assert int(counts.get("OK", 0)) <= 7, counts  # 7 new jobs fit beside "real"
        assert _p99(loaded) <= 2 * _p99(quiet), (_p99(loaded), _p99(quiet))
        assert len(c.jobs()) == 8
        # The limits name themselves, and a refused join changes nothing.
        with grpc.insecure_channel(p.address) as ch:
            join = ch.unary_unary(f"/{SERVICE}/Join")
            m = pb.JoinRequest(request_id="x", job="real", spec=spec_to_proto(SPEC), incarnation="t2", world=65, rank=0)
            with pytest.raises(grpc.RpcError) as e:
                join(m.SerializeToString(), timeout=10)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 64 ranks" in e.value.details()
            m = pb.JoinRequest(request_id="y", job="one-more", spec=spec_to_proto(SPEC), incarnation="t", world=1, rank=0)
            with pytest.raises(grpc.RpcError) as e:
                join(m.SerializeToString(), timeout=10)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-jobs 8" in e.value.details()
        assert c.status("real").result.generation == gen


def test_a_job_larger_than_the_join_limit_still_starts(tmp_path: pathlib.Path) -> None:
    """Ranks refused for the joins in progress wait and join again; every other limit is final."""
    from croupier.server import Server, ServerOptions

    with Server(f"sqlite:///{tmp_path}/c.db", options=ServerOptions(max_concurrent_joins=1, max_jobs=1)) as server:
        with CoordinatorClient(server.address, retry_for=5.0) as c:
            out = on_ranks(4, lambda r: c.join_started(JoinRequest("big", SPEC, "t", 4, r), timeout=60))
            assert {r.generation for r in out} == {1} and all(r.start is not None for r in out)
            with pytest.raises(ValueError, match="--max-jobs 1"):
                c.join_started(JoinRequest("second", SPEC, "t", 1, 0), timeout=60)


@pytest.mark.parametrize("over", [1, 40_000])
def test_a_request_over_the_size_limit_names_the_option_and_is_counted(tmp_path: pathlib.Path, over: int) -> None:
    """Refused as RESOURCE_EXHAUSTED by croupier, not by gRPC's own check: the message names the option,
    the metrics count it, and nothing changes."""
    from croupier.server import Server, ServerOptions

    limit = 65_536
    opts = ServerOptions(max_request_bytes=limit, metrics_port=0)
    spec = Spec.with_lengths([5] * 20_000, seed=1, buffer_size=100, pack_size=10)  # its lengths: a join of ~160 kB
    with Server(f"sqlite:///{tmp_path}/c.db", options=opts) as server:
        assert server.metrics is not None
        before = server.core.snapshot_state()
        m = pb.JoinRequest(request_id="x", job="big", spec=spec_to_proto(spec), incarnation="t", world=1, rank=0)
        raw = m.SerializeToString()
        raw = raw[: limit + over] if over < len(raw) - limit else raw  # just over the limit, or well over it
        assert len(raw) > limit
        with grpc.insecure_channel(server.address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary(f"/{SERVICE}/Join")(raw, timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"--max-request-bytes {limit}" in e.value.details() and f"{len(raw)} bytes" in e.value.details()
        counted = server.metrics.registry.get_sample_value(
            "croupier_rpc_calls_total", {"method": "Join", "code": "RESOURCE_EXHAUSTED"})
        assert counted == 1
        assert server.core.snapshot_state() == before


def test_a_request_over_twice_the_size_limit_is_refused_unread_and_counted(tmp_path: pathlib.Path) -> None:
    """Past gRPC's receive limit (twice --max-request-bytes, at least 1 MiB more), gRPC refuses the
    request before croupier's handler could read it: RESOURCE_EXHAUSTED all the same, counted in
    croupier_rpc_refused_unread_total, and nothing changes."""
    from croupier.server import Server, ServerOptions

    limit = 65_536
    opts = ServerOptions(max_request_bytes=limit, metrics_port=0)
    with Server(f"sqlite:///{tmp_path}/c.db", options=opts) as server:
        assert server.metrics is not None
        registry = server.metrics.registry
        with CoordinatorClient(server.address, retry_for=5.0) as c:  # a call that is read is not counted there
            c.join_started(JoinRequest("small", Spec(n=10), "t", 1, 0), timeout=10)
        before = server.core.snapshot_state()
        raw = b"\x0a" + b"\xff" * 10 + b"x" * (2 * limit + (1 << 20))  # past the receive limit: never parsed
        with grpc.insecure_channel(server.address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary(f"/{SERVICE}/Join")(raw, timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in (e.value.details() or "")  # gRPC's own refusal, not croupier's handler

        def unread(method: str) -> float | None:
            return registry.get_sample_value("croupier_rpc_refused_unread_total", {"method": method})

        t0 = time.monotonic()  # the handler counts it on its own thread, once gRPC has cancelled the call
        while unread("Join") != 1:
            assert time.monotonic() - t0 < 10, f"croupier_rpc_refused_unread_total{{method='Join'}} is {unread('Join')}"
        assert unread("Lease") == 0
        assert registry.get_sample_value("croupier_rpc_calls_total", {"method": "Join", "code": "OK"}) == 1
        assert registry.get_sample_value("croupier_rpc_calls_total", {"method": "Join", "code": "RESOURCE_EXHAUSTED"}) is None
        assert server.core.snapshot_state() == before
