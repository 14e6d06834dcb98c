"""The coordinator on a real port: API v1 end to end, the status-code table, health, reflection, shutdown."""

from __future__ import annotations

import filecmp
import pathlib
import signal
import subprocess
import sys
import threading
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import ServeProcess
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from croupier.client._rpc import CoordinatorClient
from croupier.core import errors as E
from croupier.core.api import JoinRequest
from croupier.core.order import Cursor, fixed_plan, fresh
from croupier.core.spec import Spec
from croupier.core.wire import SERVICE
from croupier.server._service import Server
from croupier.server._store import StoreUnavailable
from croupier.tools import serve
from croupier.v1 import coordinator_pb2 as pb

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPEC = Spec(n=1000, seed=3, batch_size=8, permutation="feistel")


def start_job(c: CoordinatorClient, world: int = 2, job: str = "j", incarnation: str = "t1", resume: Cursor | None = None) -> int:
    results = [None] * world

    def one(r: int) -> None:
        results[r] = c.join_started(JoinRequest(job, SPEC, incarnation, world, r, resume), timeout=20)  # type: ignore[call-overload]

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gens = {r.generation for r in results}  # type: ignore[union-attr]
    assert len(gens) == 1
    return gens.pop()


def test_generated_code_is_up_to_date(tmp_path: pathlib.Path) -> None:
    """The committed generated code is what scripts/gen_proto.py makes from proto/."""
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), str(tmp_path)], check=True, capture_output=True)
    committed = ROOT / "proto" / "croupier" / "v1"
    made = sorted(p.name for p in (tmp_path / "croupier" / "v1").iterdir())
    assert made == ["coordinator_pb2.py", "coordinator_pb2.pyi", "coordinator_pb2_grpc.py", "coordinator_pb2_grpc.pyi"]
    for name in made:
        assert filecmp.cmp(committed / name, tmp_path / "croupier" / "v1" / name, shallow=False), f"{name} is stale: run scripts/gen_proto.py"


def test_join_and_lease_end_to_end(client: CoordinatorClient) -> None:
    gen = start_job(client, world=3)
    p = fixed_plan(SPEC, fresh(SPEC, 0), 3)
    seen = []
    for r in range(3):
        first = 0
        while True:
            lease = client.lease("j", gen, r, 0, first, 5)
            for k, b in enumerate(lease.batches):
                assert b.tolist() == p.batch_indices(r, first + k).tolist()  # type: ignore[union-attr]
                seen.extend(b.tolist())
            first += len(lease.batches)
            assert lease.epoch_samples == p.samples(r)
            if lease.end_of_epoch:
                break
    assert len(seen) == 1002 and set(seen) == set(range(1000))  # pad: 3 * 334, two repeats
    # A lease is idempotent: asking again gives the same batches.
    a, b = client.lease("j", gen, 1, 0, 7, 3), client.lease("j", gen, 1, 0, 7, 3)
    assert [x.tolist() for x in a.batches] == [x.tolist() for x in b.batches]
    # Epoch 1 with no set_epoch: a different order.
    assert client.lease("j", gen, 0, 1, 0, 1).batches[0].tolist() != client.lease("j", gen, 0, 0, 0, 1).batches[0].tolist()


def test_more_ranks_than_server_threads_start_together(client: CoordinatorClient) -> None:
    """Waiting joins hold server threads only briefly: 300 ranks (the server has 128 threads) all start."""
    gen = start_job(client, world=300, job="wide")
    lease = client.lease("wide", gen, 299, 0, 0, 1)
    assert len(lease.batches) == 1


def test_large_n_travels_as_int64(client: CoordinatorClient) -> None:
    big = Spec(n=2**40 + 3, seed=1, batch_size=4)
    r = client.join_started(JoinRequest("big", big, "t", 1, 0))
    lease = client.lease("big", r.generation, 0, 0, 0, 2)
    assert all(int(i) < big.n for b in lease.batches for i in b)
    assert max(int(i) for b in lease.batches for i in b) > 2**32


def _raw(server: Server, method: str, payload: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(server.address) as ch:
        call = ch.unary_unary(f"/{SERVICE}/{method}")
        with pytest.raises(grpc.RpcError) as e:
            call(payload, timeout=10)
    return e.value  # type: ignore[return-value]


def _join_msg(**kw: object) -> bytes:
    from croupier.core.wire import spec_to_proto

    m = pb.JoinRequest(request_id="r1", job="j", spec=spec_to_proto(SPEC), incarnation="t9", world=2, rank=0)
    for k, v in kw.items():
        if k in ("spec", "resume"):
            getattr(m, k).CopyFrom(v)
        else:
            setattr(m, k, v)
    return m.SerializeToString()


def _lease_msg(**kw: object) -> bytes:
    m = pb.LeaseRequest(job="j", generation=2, rank=0, epoch=3, first_batch=0, count=4)
    for k, v in kw.items():
        setattr(m, k, v)
    return m.SerializeToString()


def _grant_msg(**kw: object) -> bytes:
    m = pb.GrantRequest(job="j", generation=2, rank=0, epoch=3, first_batch=0, count=4)
    for k, v in kw.items():
        setattr(m, k, v)
    return m.SerializeToString()


def _report_msg(**kw: object) -> bytes:
    m = pb.ReportRequest(job="j", generation=2, rank=0, progress=pb.Progress(epoch=3, batches=1))
    for k, v in kw.items():
        if v is None:
            m.ClearField(k)
        elif k in ("progress", "checkpoint"):
            getattr(m, k).CopyFrom(v)
        else:
            setattr(m, k, v)
    return m.SerializeToString()


BAD = [
    # (method, payload, status, words in the details)
    ("Join", b"\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT, "not a valid croupier.v1.JoinRequest"),
    ("Lease", b"\x08\x96", grpc.StatusCode.INVALID_ARGUMENT, "not a valid croupier.v1.LeaseRequest"),
    ("Join", _join_msg(job=""), grpc.StatusCode.INVALID_ARGUMENT, "job name"),
    ("Join", _join_msg(request_id=""), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    ("Join", _join_msg(rank=5), grpc.StatusCode.INVALID_ARGUMENT, "rank must be in [0, 2)"),
    ("Join", _join_msg(world=0), grpc.StatusCode.INVALID_ARGUMENT, "world must be"),
    ("Join", _join_msg(spec=pb.Spec(n=0, permutation="none", partition="strided", tail="pad", batch_size=1)), grpc.StatusCode.INVALID_ARGUMENT, "n must be"),
    ("Join", _join_msg(spec=pb.Spec(n=2**63, permutation="none", partition="strided", tail="pad", batch_size=1)), grpc.StatusCode.INVALID_ARGUMENT, "n must be"),
    ("Join", _join_msg(spec=pb.Spec(n=10, permutation="shuffle!", partition="strided", tail="pad", batch_size=1)), grpc.StatusCode.INVALID_ARGUMENT, "permutation must be one of"),
    ("Join", _join_msg(spec=pb.Spec(n=10, permutation="none", partition="strided", tail="pad", batch_size=0)), grpc.StatusCode.INVALID_ARGUMENT, "batch_size"),
    ("Join", _join_msg(resume=pb.Cursor(epoch=0, remaining=b"\x01\x02\x03")), grpc.StatusCode.INVALID_ARGUMENT, "multiple of 16"),
    ("Join", _join_msg(resume=pb.Cursor(epoch=0, remaining=np.array([5, 5000], "<i8").tobytes())), grpc.StatusCode.INVALID_ARGUMENT, "inside [0, 1000)"),
    ("Join", _join_msg(spec=pb.Spec(n=1000, seed=4, permutation="feistel", partition="strided", tail="pad", batch_size=8), incarnation="t1"), grpc.StatusCode.FAILED_PRECONDITION, "different spec"),
    ("Join", _join_msg(incarnation="t0"), grpc.StatusCode.ABORTED, "older generation"),
    ("Lease", _lease_msg(job="nope"), grpc.StatusCode.NOT_FOUND, "not known"),
    ("Lease", _lease_msg(job=""), grpc.StatusCode.INVALID_ARGUMENT, "job name"),
    ("Lease", _lease_msg(rank=7), grpc.StatusCode.INVALID_ARGUMENT, "rank must be in [0, 2)"),
    ("Lease", _lease_msg(count=0), grpc.StatusCode.INVALID_ARGUMENT, "count"),
    ("Lease", _lease_msg(count=10**6), grpc.StatusCode.RESOURCE_EXHAUSTED, "more than"),
    ("Lease", _lease_msg(first_batch=2**63), grpc.StatusCode.INVALID_ARGUMENT, "first batch"),
    ("Lease", _lease_msg(generation=0), grpc.StatusCode.INVALID_ARGUMENT, "generation"),
    ("Lease", _lease_msg(generation=99), grpc.StatusCode.NOT_FOUND, "no generation 99"),
    ("Lease", _lease_msg(generation=1), grpc.StatusCode.ABORTED, "fenced"),  # a zombie of generation 1
    ("Lease", _lease_msg(generation=2, epoch=0), grpc.StatusCode.OUT_OF_RANGE, "before this generation's resume point"),
    ("Grant", b"\x08\x96", grpc.StatusCode.INVALID_ARGUMENT, "not a valid croupier.v1.GrantRequest"),
    ("Grant", _grant_msg(job="nope"), grpc.StatusCode.NOT_FOUND, "not known"),
    ("Grant", _grant_msg(rank=7), grpc.StatusCode.INVALID_ARGUMENT, "rank must be in [0, 2)"),
    ("Grant", _grant_msg(count=0), grpc.StatusCode.INVALID_ARGUMENT, "grant count"),
    ("Grant", _grant_msg(count=10**6), grpc.StatusCode.RESOURCE_EXHAUSTED, "more than"),
    ("Grant", _grant_msg(generation=99), grpc.StatusCode.NOT_FOUND, "no generation 99"),
    ("Grant", _grant_msg(generation=1), grpc.StatusCode.ABORTED, "fenced"),  # a zombie of generation 1
    ("Grant", _grant_msg(generation=2, epoch=0), grpc.StatusCode.OUT_OF_RANGE, "before this generation's resume point"),
    ("GetJob", pb.GetJobRequest(job="missing").SerializeToString(), grpc.StatusCode.NOT_FOUND, "not known"),
    ("Report", b"\x08\x96", grpc.StatusCode.INVALID_ARGUMENT, "not a valid croupier.v1.ReportRequest"),
    ("Report", _report_msg(progress=None), grpc.StatusCode.INVALID_ARGUMENT, "needs the rank's progress"),
    ("Report", _report_msg(job="nope"), grpc.StatusCode.NOT_FOUND, "not known"),
    ("Report", _report_msg(generation=1), grpc.StatusCode.ABORTED, "fenced"),
    ("Report", _report_msg(generation=99), grpc.StatusCode.NOT_FOUND, "no generation 99"),
    ("Report", _report_msg(rank=7), grpc.StatusCode.INVALID_ARGUMENT, "rank must be in [0, 2)"),
    ("Report", _report_msg(progress=pb.Progress(epoch=0, batches=1)), grpc.StatusCode.INVALID_ARGUMENT, "epoch must be in [3"),
    ("Report", _report_msg(checkpoint=pb.Checkpoint(step=1)), grpc.StatusCode.INVALID_ARGUMENT, "needs its cursor"),
    ("Report", _report_msg(checkpoint=pb.Checkpoint(cursor=pb.Cursor(epoch=3, remaining=np.array([5, 5000], "<i8").tobytes()))),
     grpc.StatusCode.INVALID_ARGUMENT, "inside [0, 1000)"),
    ("Report", _report_msg(checkpoint=pb.Checkpoint(step=1, cursor=pb.Cursor(epoch=3), origin="x" * 2000)),
     grpc.StatusCode.INVALID_ARGUMENT, "origin must be"),
    ("GetCheckpoint", pb.GetCheckpointRequest(job="nope", step=1).SerializeToString(), grpc.StatusCode.NOT_FOUND, "not known"),
    ("GetCheckpoint", pb.GetCheckpointRequest(job="j", step=4).SerializeToString(), grpc.StatusCode.NOT_FOUND,
     "no checkpoint recorded at step 4"),
]


def test_a_grant_names_the_batches_a_lease_serves(client: CoordinatorClient) -> None:
    """Grant and Lease answer the same batches: one as positions of the plan, one as indices."""
    gen = start_job(client, world=3, incarnation="g")
    spec = client.get_job("j")[0]
    for rank in range(3):
        first = 0
        while True:
            g = client.grant("j", gen, rank, 0, first, 4)
            lease = client.lease("j", gen, rank, 0, first, 4)
            assert g.sizes(spec.batch_size) == lease.sizes and g.end_of_epoch == lease.end_of_epoch
            assert g.epoch_samples == lease.epoch_samples
            assert lease.indices.tolist() == _plan_of(client, spec).lease(rank, first, 4)[0].tolist()
            first += g.batches
            if g.end_of_epoch:
                break


def _plan_of(client: CoordinatorClient, spec: Any) -> Any:
    from croupier.core.registry import plan_epoch
    _, r = client.get_job("j")
    return plan_epoch(spec, r.start, r.world, r.start.epoch)


def test_bad_input_gets_its_status_and_changes_nothing(server: Server, client: CoordinatorClient) -> None:
    start_job(client, world=2, incarnation="t0")
    # Generation 2 resumes in epoch 3, so epoch 0 is before its resume point.
    start_job(client, world=2, incarnation="t1", resume=Cursor(3, ((100, 1000),)))
    before = server.core.snapshot_state()
    codes = set()
    for method, payload, code, words in BAD:
        err = _raw(server, method, payload)
        assert err.code() == code, (method, words, err.code(), err.details())
        assert words in (err.details() or ""), (words, err.details())
        assert server.core.snapshot_state() == before, f"{method} {words} changed the state"
        codes.add(code)
    assert {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.ABORTED, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED} <= codes
    # The Python client turns statuses back into the domain errors.
    with pytest.raises(E.Aborted):
        client.lease("j", 1, 0, 3, 0, 1)
    with pytest.raises(ValueError):
        client.lease("j", 2, 0, 0, 0, 1)


class FailingStore:
    """Wraps a real store; appends fail once `broken` is set (a full or vanished disk)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.url = "failing://"
        self.broken = False

    def append(self, records: list[bytes]) -> int:
        if self.broken:
            raise StoreUnavailable("disk I/O error (simulated)")
        return self.inner.append(records)  # type: ignore[attr-defined,no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_unavailable_when_the_store_fails(tmp_path: pathlib.Path) -> None:
    from croupier.server._coordinator import Coordinator
    from croupier.server._stores import open_store

    store = FailingStore(open_store(f"sqlite:///{tmp_path}/s.db"))
    core = Coordinator(store)  # type: ignore[arg-type]
    core.join(JoinRequest("j", SPEC, "a", 1, 0))
    store.broken = True
    with pytest.raises(E.Unavailable, match="store failing:// failed"):
        core.join(JoinRequest("j", SPEC, "b", 1, 0))
    # It stops acknowledging anything, reads included, until restarted.
    with pytest.raises(E.Unavailable):
        core.lease("j", 1, 0, 0, 0, 1)
    core.close()
    # Restarted on the same store: only what was durable is there.
    core2 = Coordinator(open_store(f"sqlite:///{tmp_path}/s.db"))
    assert core2.job("j").result.generation == 1
    core2.close()


def test_health_and_reflection(server: Server) -> None:
    with grpc.insecure_channel(server.address) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        assert h.Check(health_pb2.HealthCheckRequest(service=SERVICE)).status == health_pb2.HealthCheckResponse.SERVING
        r = reflection_pb2_grpc.ServerReflectionStub(ch)
        replies = list(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in replies[0].list_services_response.service}
        assert SERVICE in names and "grpc.health.v1.Health" in names
        server.health.enter_graceful_shutdown()
        assert h.Check(health_pb2.HealthCheckRequest(service=SERVICE)).status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_serve_sigterm_exits_zero_and_keeps_state(tmp_path: pathlib.Path, serve_process: type[ServeProcess]) -> None:
    store = f"sqlite:///{tmp_path}/c.db"
    p = serve_process(store)
    with CoordinatorClient(p.address, retry_for=5) as c:
        gen = start_job(c, world=2)
    assert p.terminate() == 0
    p2 = serve_process(store)
    with CoordinatorClient(p2.address, retry_for=5) as c:
        _, r = c.get_job("j")
        assert r.generation == gen and r.start == fresh(SPEC, 0)


def test_serve_refuses_a_corrupt_store(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not a database" * 100)
    with open(tmp_path / "serve.log", "w+") as log:
        p = serve.ServeProcess(f"sqlite:///{bad}", log)
        with pytest.raises(RuntimeError, match=r"did not start \(exit [1-9]\d*, first line ''\)"):
            p.start()  # nothing on stdout: no "listening on"
    assert str(bad) in (tmp_path / "serve.log").read_text()


@pytest.mark.e2e
def test_a_serve_process_restarts_on_its_port_and_its_group_sees_an_exit(tmp_path: pathlib.Path) -> None:
    """tools/serve.py, the one way the tools and the tests run `croupier serve`: a restart keeps the port
    the clients know, and a group names the member that exited when nobody stopped it."""
    with open(tmp_path / "serve.log", "w+") as log:
        first = serve.ServeProcess(f"sqlite:///{tmp_path}/c.db", log, "replica 0")
        second = serve.ServeProcess("memory://", log, "replica 1")
        group = serve.ServeGroup([first, second])
        try:
            group.start()
            assert group.address == f"{first.address},{second.address}"
            group.check()
            port = first.port
            first.kill()
            assert first.exited() == -signal.SIGKILL
            first.start()
            assert first.port == port and first.exited() is None
            with CoordinatorClient(first.address, retry_for=5) as c:
                start_job(c, world=1)
            assert second.proc is not None
            second.proc.send_signal(signal.SIGTERM)  # not through second: an exit nobody asked for
            second.proc.wait(timeout=30)
            with pytest.raises(RuntimeError, match=r"replica 1 exited by itself \(exit 0\)"):
                group.check()
            assert first.terminate(30) == 0 and first.terminate() == 0
        finally:
            group.kill()
