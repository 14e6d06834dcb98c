"""The coordinator's wall clock jumped forward and back by an hour (libfaketime, as an NTP step would): joins wait
as long as they were asked to, credentials reload, grants and checkpoints go on.

`croupier serve` runs under libfaketime with its wall clock read from a file the test rewrites
(``+0``, then ``+1h``, then ``-1h``), the monotonic clock left alone (as a wall-clock step leaves it).
Every duration the coordinator measures is on the monotonic clock; the test fails if one is not (a
join's deadline on the wall clock: tried, the join waiting across the jump forward then ends at once).
"""

from __future__ import annotations

import json
import os
import pathlib
import threading
import time

import grpc
import pytest

from croupier.core.cursor import Cursor
from croupier.core.spec import Spec
from croupier.core.wire import checkpoint_to_proto, spec_to_proto
from croupier.v1 import coordinator_pb2 as pb
from croupier.v1 import coordinator_pb2_grpc as pb_grpc

LIB = pathlib.Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not LIB.exists() and not os.environ.get("CI"),
                                 reason="no libfaketime: apt-get install faketime (.ci/run installs it)")]
SPEC = spec_to_proto(Spec(n=1000, batch_size=10))
OLD, NEW = "o" * 20, "n" * 20


def _creds(path: pathlib.Path, *secrets: str) -> None:
    doc = {"credentials": [{"name": f"c{i}", "secret": s, "role": "admin"} for i, s in enumerate(secrets)]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


def _as(secret: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {secret}"),)


def test_wall_clock_jumps_change_no_duration(tmp_path: pathlib.Path, serve_process: type) -> None:
    clock = tmp_path / "faketime"
    clock.write_text("+0\n")
    creds = tmp_path / "credentials.json"
    _creds(creds, OLD)
    env = {"LD_PRELOAD": str(LIB), "FAKETIME_TIMESTAMP_FILE": str(clock), "FAKETIME_NO_CACHE": "1",
           "DONT_FAKE_MONOTONIC": "1"}
    server = serve_process(f"sqlite:///{tmp_path}/c.db", extra_env=env, args=("--auth-file", str(creds)))

    def jump(spec: str) -> None:
        clock.write_text(spec + "\n")

    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.CoordinatorStub(ch)

        def join(rank: int, wait_ms: int, incarnation: str = "t1") -> pb.JoinResponse:
            return stub.Join(pb.JoinRequest(request_id=f"{incarnation}-{rank}", job="j", spec=SPEC, incarnation=incarnation, world=2,
                                            rank=rank, wait_ms=wait_ms), timeout=30, metadata=_as(OLD))

        def other(job: str) -> None:
            stub.Join(pb.JoinRequest(request_id=job, job=job, spec=SPEC, incarnation="t", world=1, rank=0), timeout=30,
                      metadata=_as(OLD))

        def reported_ms() -> int:
            job = stub.GetJob(pb.GetJobRequest(job="j"), timeout=10, metadata=_as(OLD))
            return max(r.reported_unix_ms for r in job.ranks)

        # 1. A join waiting for the other rank across a jump forward of an hour still waits for it.
        answer: dict[str, pb.JoinResponse] = {}
        waiter = threading.Thread(target=lambda: answer.setdefault("r0", join(0, 8000)))
        t0 = time.monotonic()
        waiter.start()
        while "j" not in stub.ListJobs(pb.ListJobsRequest(), timeout=10, metadata=_as(OLD)).jobs:
            assert time.monotonic() - t0 < 10  # bounded: until rank 0's join is recorded
        jump("+1h")
        other("a")  # another job's commit wakes every waiting join: each looks at its deadline again
        time.sleep(1.0)  # rank 1 comes a second later: the fault's timing, not a wait for something
        assert join(1, 0).started
        waiter.join(timeout=30)
        assert answer["r0"].started, "the waiting join ended when the wall clock jumped forward"
        # The jump did reach the process: its wall clock is an hour ahead in what it records.
        stub.Grant(pb.GrantRequest(job="j", generation=1, rank=0, epoch=0, first_batch=0, count=1,
                                   progress=pb.Progress(epoch=0, batches=1)), timeout=10, metadata=_as(OLD))
        ahead = reported_ms() / 1000 - time.time()
        assert 3500 < ahead < 3700, f"the coordinator's wall clock is {ahead:.0f} s ahead, not an hour"

        # 2. Back by two hours (an hour behind) while a join waits: asked to wait 3 s, it waits 3 s, not 2 h more.
        t1 = time.monotonic()
        waiter = threading.Thread(target=lambda: answer.setdefault("t2", join(0, 3000, incarnation="t2")))
        waiter.start()
        while stub.GetJob(pb.GetJobRequest(job="j"), timeout=10, metadata=_as(OLD)).generation != 2:
            assert time.monotonic() - t1 < 10  # bounded: until the join opened generation 2
        jump("-1h")
        other("b")
        waiter.join(timeout=60)
        took = time.monotonic() - t1
        assert not answer["t2"].started and 2.9 < took < 6.0, f"a join asked to wait 3 s took {took:.1f} s"
        assert join(1, 0, incarnation="t2").started

        # 3. Credentials reload though the clock went back (the file's check is on the monotonic clock).
        _creds(creds, OLD, NEW)
        t2 = time.monotonic()
        while True:  # bounded: the server looks at the file at most once a second
            try:
                stub.ListJobs(pb.ListJobsRequest(), timeout=10, metadata=_as(NEW))
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED and time.monotonic() - t2 < 10, e

        # 4. Grants and checkpoints go on under the jumped clock, and the checkpoint is recorded.
        stub.Grant(pb.GrantRequest(job="j", generation=2, rank=0, epoch=0, first_batch=0, count=2), timeout=10,
                   metadata=_as(NEW))
        stub.Report(pb.ReportRequest(job="j", generation=2, rank=0, progress=pb.Progress(epoch=0, batches=2),
                                     checkpoint=checkpoint_to_proto(7, Cursor(0, ((20, 1000),)), "jumped")),
                    timeout=10, metadata=_as(NEW))
        behind = time.time() - reported_ms() / 1000
        assert 3500 < behind < 3700, f"the coordinator's wall clock is {behind:.0f} s behind, not an hour"
        cp = stub.GetCheckpoint(pb.GetCheckpointRequest(job="j", latest=True), timeout=10, metadata=_as(NEW))
        assert cp.record.checkpoint.step == 7
    assert server.exited() is None
