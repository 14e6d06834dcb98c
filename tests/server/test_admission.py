"""The asyncio serving core: admission refuses at once with a retry hint the client honours, a waiting join holds
no thread, and a call whose caller has gone never reaches the store."""

from __future__ import annotations

import asyncio
import pathlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from croupier.client import CoordinatorClient
from croupier.core.api import JoinRequest
from croupier.core.spec import Spec
from croupier.core.wire import SERVICE, spec_to_proto
from croupier.server import Server, ServerOptions
from croupier.server._admission import RETRY_AFTER_KEY
from croupier.v1 import coordinator_pb2 as pb

SPEC = Spec(n=100, batch_size=4)


def _until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    """Waits for a condition another thread makes true (bounded: fails after `timeout`)."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "the condition did not hold in time"
        time.sleep(0.005)


class _Blocked:
    """Makes GetJob block in the server's worker threads until released; counts the calls inside."""

    def __init__(self, server: Server) -> None:
        self.inside = threading.Semaphore(0)
        self.go = threading.Event()
        servicer = server.service.servicer
        real = servicer.GetJob

        def blocked(m: Any, who: Any, budget: Any) -> Any:
            self.inside.release()
            assert self.go.wait(30)
            return real(m, who, budget)

        servicer.GetJob = blocked  # type: ignore[method-assign]

    def enter(self, n: int) -> None:
        for _ in range(n):
            assert self.inside.acquire(timeout=20), "a blocked call never reached its worker thread"


@pytest.fixture
def server(tmp_path: pathlib.Path) -> Iterator[Server]:
    with Server(f"sqlite:///{tmp_path}/c.db", max_workers=2,
                options=ServerOptions(max_job_calls=2, max_calls=3, metrics_port=0)) as s:
        with CoordinatorClient(s.address) as c:
            for job in ("a", "b"):
                c.join_started(JoinRequest(job, SPEC, "t", 1, 0), timeout=20)
        yield s


def _get_job(ch: grpc.Channel, job: str, timeout: float = 20) -> Any:
    return ch.unary_unary(f"/{SERVICE}/GetJob")(pb.GetJobRequest(job=job).SerializeToString(), timeout=timeout)


def test_a_call_over_a_bound_is_refused_at_once_naming_it_with_a_retry_hint(server: Server) -> None:
    blocked = _Blocked(server)
    with grpc.insecure_channel(server.address) as ch:
        held = [ch.unary_unary(f"/{SERVICE}/GetJob").future(pb.GetJobRequest(job="a").SerializeToString(), timeout=30)
                for _ in range(2)]
        blocked.enter(2)  # both worker threads hold a call of job a
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            _get_job(ch, "a")
        took = time.monotonic() - t0
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-job-calls 2" in e.value.details() and "job 'a'" in e.value.details()
        hint = dict(e.value.trailing_metadata())[RETRY_AFTER_KEY]
        assert 50 <= int(hint) <= 2000 and f"retry after {hint} ms" in e.value.details()
        assert took < 1.0, f"the refusal took {took:.3f} s: it must come at once, not after the held calls"
        # Another job has room of its own until the bound of all calls (3): a third call in progress is its own.
        other = ch.unary_unary(f"/{SERVICE}/GetJob").future(pb.GetJobRequest(job="b").SerializeToString(), timeout=30)
        _until(lambda: server.service.admission.calls == 3)
        with pytest.raises(grpc.RpcError) as e:
            _get_job(ch, "b")
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-calls 3" in e.value.details()
        blocked.go.set()
        for f in (*held, other):
            assert pb.GetJobResponse.FromString(f.result()).generation == 1
    assert server.metrics is not None
    sample = server.metrics.registry.get_sample_value
    assert sample("croupier_rpc_admission_refused_total", {"bound": "job_calls"}) == 1
    assert sample("croupier_rpc_admission_refused_total", {"bound": "calls"}) == 1
    assert sample("croupier_rpc_calls_total", {"method": "GetJob", "code": "RESOURCE_EXHAUSTED"}) == 2


def test_the_client_asks_again_after_the_hint(server: Server) -> None:
    blocked = _Blocked(server)
    refused = threading.Event()
    server.service.admission.on_refuse = lambda bound: refused.set()
    with grpc.insecure_channel(server.address) as ch, CoordinatorClient(server.address, retry_for=30) as c:
        held = [ch.unary_unary(f"/{SERVICE}/GetJob").future(pb.GetJobRequest(job="a").SerializeToString(), timeout=30)
                for _ in range(2)]
        blocked.enter(2)
        out: list[Any] = []
        asker = threading.Thread(target=lambda: out.append(c.status("a")))
        asker.start()
        assert refused.wait(20), "the client's call was not refused"
        blocked.go.set()  # room again: the client's next ask, after the hint, is answered
        asker.join(30)
        assert out and out[0].result.generation == 1
        assert c.refusals >= 1
        for f in held:
            f.result()


def test_a_waiting_join_holds_no_thread(tmp_path: pathlib.Path) -> None:
    """300 ranks wait at once on a server of 2 worker threads; the last one's join starts them all."""
    world = 300
    with Server(f"sqlite:///{tmp_path}/c.db", max_workers=2) as server:
        spec = spec_to_proto(SPEC)

        async def ranks() -> list[Any]:
            async with grpc.aio.insecure_channel(server.address) as ch:
                join = ch.unary_unary(f"/{SERVICE}/Join", response_deserializer=pb.JoinResponse.FromString)

                def req(r: int) -> bytes:
                    return pb.JoinRequest(request_id=f"r{r}", job="wide", spec=spec, incarnation="t", world=world, rank=r,
                                          wait_ms=30_000).SerializeToString()

                waiting = [asyncio.ensure_future(join(req(r), timeout=60)) for r in range(world - 1)]
                while server.service.admission.waiting < world - 1:  # every one of them waits (no thread each)
                    await asyncio.sleep(0.005)
                    assert not any(w.done() for w in waiting), "a join answered before the last rank joined"
                last = await join(req(world - 1), timeout=60)
                return [last, *await asyncio.gather(*waiting)]

        answers = asyncio.run(asyncio.wait_for(ranks(), 120))
        assert all(a.started and a.generation == 1 for a in answers)
        assert server.service.admission.waiting == 0


def test_a_departed_callers_call_never_reaches_the_store(tmp_path: pathlib.Path) -> None:
    """A join queued behind busy worker threads whose client gives up is never decided nor journaled."""
    with Server(f"sqlite:///{tmp_path}/c.db", max_workers=1) as server:
        with CoordinatorClient(server.address) as c:
            c.join_started(JoinRequest("a", SPEC, "t", 1, 0), timeout=20)
        blocked = _Blocked(server)
        seq = server.core.store.last_seq()
        before = server.core.snapshot_state()
        with grpc.insecure_channel(server.address) as ch:
            held = ch.unary_unary(f"/{SERVICE}/GetJob").future(pb.GetJobRequest(job="a").SerializeToString(), timeout=30)
            blocked.enter(1)  # the only worker thread is busy
            m = pb.JoinRequest(request_id="gone", job="late", spec=spec_to_proto(SPEC), incarnation="t", world=1, rank=0)
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary(f"/{SERVICE}/Join")(m.SerializeToString(), timeout=0.3)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # NOTE: the server learns that the caller left when its own deadline passes (counted from the
            # call's arrival: a little after the client's) or when the client's cancellation reaches it; the
            # call leaves the admission's count then. Before that the call may still run (on loaded cores the
            # thread freed at once took it): the test waits for it, bounded, then frees the thread.
            admission = server.service.admission
            _until(lambda: admission.calls <= 1, timeout=10)  # the held GetJob's is the one left
            assert admission.calls == 1, f"the server still counts {admission.calls} calls in progress"
            blocked.go.set()
            held.result()
            # Whatever the server still had of the departed call has run by now: a call after it on the one thread.
            assert ch.unary_unary(f"/{SERVICE}/ListJobs", response_deserializer=pb.ListJobsResponse.FromString)(
                pb.ListJobsRequest().SerializeToString(), timeout=20).jobs == ["a"]
        assert server.core.snapshot_state() == before
        assert server.core.store.last_seq() == seq


def test_a_static_grant_needs_no_worker_thread_and_a_dealt_one_waits_for_one(tmp_path: pathlib.Path) -> None:
    """The one worker thread busy: a grant of a plan the ranks compute is answered all the same (on the event
    loop); a grant the coordinator deals (durable first) waits for the thread, then deals what it would have."""
    with Server(f"sqlite:///{tmp_path}/c.db", max_workers=1) as server:
        with CoordinatorClient(server.address) as c:
            static = c.join_started(JoinRequest("static", SPEC, "t", 1, 0), timeout=20).generation
            dealt = c.join_started(JoinRequest("dealt", Spec(n=100, batch_size=4, dealing="dynamic", tail="uneven"), "t", 1, 0),
                                   timeout=20).generation
        blocked = _Blocked(server)
        with grpc.insecure_channel(server.address) as ch:
            held = ch.unary_unary(f"/{SERVICE}/GetJob").future(pb.GetJobRequest(job="static").SerializeToString(), timeout=30)
            blocked.enter(1)
            grant = ch.unary_unary(f"/{SERVICE}/Grant", response_deserializer=pb.GrantResponse.FromString)
            g = grant(pb.GrantRequest(job="static", generation=static, rank=0, epoch=0, first_batch=0, count=3,
                                      progress=pb.Progress(epoch=0, batches=0)).SerializeToString(), timeout=5)
            assert g.batches == 3 and not g.dealt
            waiting = grant.future(pb.GrantRequest(job="dealt", generation=dealt, rank=0, epoch=0, first_batch=0,
                                                   count=3).SerializeToString(), timeout=30)
            with pytest.raises(grpc.FutureTimeoutError):
                waiting.result(timeout=0.5)  # its deal waits for the busy thread
            blocked.go.set()
            held.result()
            d = waiting.result(timeout=20)
            assert d.batches == 3 and d.dealt
        assert server.core.job("static").ranks[0].batches == 0  # the loop's grant journaled its progress report
