"""Pauses: a replica and a rank stopped (SIGSTOP) for longer than every timeout, then woken (SIGCONT) with a call
in flight, act on nothing they knew before the pause; every call of the run is recorded and the history of the
job's generations is checked linearizable (harness/linearize.py).

Two `croupier serve` replicas on one PostgreSQL database, A and B. A rank process joins through A and trains
(grants, checkpoints). Both the rank and A are stopped; meanwhile a new generation of the job is opened
through B. Past the server's keepalive (30 s, then 10 s to answer: the longest timeout a call meets; 5 s in
the suite, past every other timeout), a grant
of the old generation is sent to A while it is still stopped, A is woken, then the rank. A must refuse that
grant (its knowledge of the journal is older than its staleness bound: it reads the database first), and the
rank's next call is refused (ABORTED). Fails if A answers from what it knew before the pause without
reading what the other replica wrote (tried: it answers OK, and the history is not linearizable). With only
the age check of the watch's confirmation removed it still passes: A's watch reads the notification of the
new generation as it wakes, before the grant is served; tests/server/test_pg_watch.py cuts the watch to check that.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from croupier.core.spec import Spec
from croupier.core.wire import spec_to_proto
from croupier.harness.linearize import Recorder, check, load
from croupier.server._grpc import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS
from croupier.v1 import coordinator_pb2 as pb
from croupier.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e
pytest_plugins = ["_postgres"]

HERE = pathlib.Path(__file__).resolve().parents[1]
#: Longer than every timeout a call meets: the server's keepalive ping and the time it gives the answer
#: (make slow); the suite's pause is past the staleness bound, the watch's heartbeat and the clients'
#: grant timeout (1 s), not past the keepalive.
LONG_PAUSE_S = (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + 2
SHORT_PAUSE_S = 5.0
#: The replicas' staleness bound (croupier serve's default): the checker's slack for grants.
STALE_S = 0.1


def _ok_grants(path: pathlib.Path) -> int:
    return sum(1 for c in load([str(path)]) if c.kind == "grant" and c.outcome == "ok") if path.exists() else 0


@pytest.mark.parametrize("pause_s", [pytest.param(SHORT_PAUSE_S, id="5s"),
                                     pytest.param(LONG_PAUSE_S, id="past-keepalive", marks=pytest.mark.slow)])
def test_a_paused_replica_and_a_paused_rank_act_on_nothing_they_knew(postgres_url: str, serve_process: type,
                                                                      tmp_path: pathlib.Path, pause_s: float) -> None:
    a, b = serve_process(postgres_url), serve_process(postgres_url)
    rec = Recorder(str(tmp_path / "test.jsonl"), "test")
    rank = subprocess.Popen([sys.executable, str(HERE / "_pause_rank.py"), a.address, "job", str(tmp_path / "rank.jsonl"),
                             "rank"], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout is not None
        joined = rank.stdout.readline()
        assert joined.startswith("JOINED "), joined
        old = int(joined.split()[1])
        t0 = time.monotonic()
        while _ok_grants(tmp_path / "rank.jsonl") < 5:  # bounded: the rank asks one every 20 ms
            assert time.monotonic() - t0 < 60 and rank.poll() is None, "the rank does not train"
        os.kill(rank.pid, signal.SIGSTOP)
        os.kill(a.proc.pid, signal.SIGSTOP)
        paused = time.monotonic()
        with grpc.insecure_channel(b.address) as ch, rec.call("job", "join") as out:
            r = pb_grpc.CoordinatorStub(ch).Join(pb.JoinRequest(
                request_id="new", job="job", spec=spec_to_proto(Spec(n=100_000, batch_size=10)), incarnation="new", world=1,
                rank=0), timeout=30)
            out["generation"] = r.generation
        assert r.generation == old + 1 and r.started
        time.sleep(max(0.0, pause_s - (time.monotonic() - paused)))  # the pause itself: the fault, not a wait for something

        answer: dict[str, object] = {}

        def stale_grant() -> None:  # sent while A is stopped: A reads it when it wakes
            with grpc.insecure_channel(a.address) as ch, rec.call("job", "grant", old) as out:
                try:
                    pb_grpc.CoordinatorStub(ch).Grant(pb.GrantRequest(job="job", generation=old, rank=0, epoch=0,
                                                                      first_batch=0, count=1), timeout=60)
                    answer["code"] = "OK"
                except grpc.RpcError as e:
                    answer["code"] = e.code().name
                    if e.code() == grpc.StatusCode.ABORTED:
                        out["outcome"] = "fenced"
                    else:
                        raise

        before = _connections_to(a.port)
        caller = threading.Thread(target=stale_grant)
        caller.start()
        # NOTE: the call is in flight once its channel has sent it; gRPC does not say when, so the
        # replica is woken once the new connection to it exists (the kernel completes it while the
        # replica is stopped, and holds what the caller sends).
        t1 = time.monotonic()
        while _connections_to(a.port) <= before:
            assert time.monotonic() - t1 < 10, "the grant never reached the paused replica's port"
        os.kill(a.proc.pid, signal.SIGCONT)
        caller.join(timeout=90)
        assert answer.get("code") == "ABORTED", f"the woken replica answered {answer.get('code')} for a replaced generation"
        os.kill(rank.pid, signal.SIGCONT)
        out_rank, _ = rank.communicate(timeout=120)
        assert rank.returncode == 0 and "FENCED" in out_rank, out_rank
    finally:
        for p in (rank,):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
        if a.proc is not None and a.proc.poll() is None:
            os.kill(a.proc.pid, signal.SIGCONT)
    calls = load([str(tmp_path / "test.jsonl"), str(tmp_path / "rank.jsonl")])
    verdict = check(calls, stale_s=STALE_S)
    assert verdict.ok, verdict.why
    assert verdict.calls >= 8


def _connections_to(port: int) -> int:
    """Established TCP connections whose far end is `port` on this machine (read from /proc/net/tcp)."""
    hexport = f"{port:04X}"
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = pathlib.Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        n += sum(1 for f in (line.split() for line in lines) if f[2].endswith(":" + hexport) and f[3] == "01")
    return n
