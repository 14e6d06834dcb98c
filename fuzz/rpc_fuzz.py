"""Coverage-guided fuzzing of every RPC's request bytes, through the handlers the server runs.

Each input is one byte naming the RPC (its index in ``RPCS``, modulo their number) and the request's
bytes, handed to the same handler the gRPC server runs for that method on its event loop (the
size check, the parse, admission, the core's work on its threads, the error table), on a
coordinator with a SQLite store that holds a job or two. What must hold for every input:

- the call returns a response, or fails with croupier's own status: never INTERNAL or UNKNOWN,
  never an exception of any other kind (a crash of the harness is a finding);
- a refused call changes nothing: the coordinator's whole state (its snapshot bytes) and the
  journal's last seq are the same before and after. The one refusal that changes something is
  documented: a join refused only because the coordinator's waiting places are taken has
  joined (``croupier serve --max-concurrent-joins``); this harness holds every waiting place, so
  that no join waits, and allows it.

    python fuzz/rpc_fuzz.py -max_total_time=600           # ten minutes (make fuzz)
    python fuzz/rpc_fuzz.py -runs=3000 -seed=1            # the suite's short run (tests/project/test_fuzz.py)

libFuzzer's options go through (``-max_total_time``, ``-runs``, ``-seed``, a corpus folder). A
finding is printed with its input, and the process exits non-zero.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from typing import Any

import atheris

with atheris.instrument_imports(include=["croupier"]):
    from croupier.core.cursor import Cursor
    from croupier.core.spec import Spec
    from croupier.core.wire import checkpoint_to_proto, cursor_to_proto, spec_to_proto
    from croupier.server._aio import Serving
    from croupier.server._coordinator import Coordinator
    from croupier.server._options import ServerOptions
    from croupier.server._rpcs import RPCS
    from croupier.server._stores import open_store
    from croupier.v1 import coordinator_pb2 as pb

import grpc

#: The statuses a refused call may have; INTERNAL and UNKNOWN never.
ALLOWED = {"INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "RESOURCE_EXHAUSTED",
           "UNAVAILABLE", "PERMISSION_DENIED", "UNAUTHENTICATED"}
MAX_REQUEST = 1 << 16


class Refused(Exception):
    """What the fake context raises on abort, as gRPC's does."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class Context:
    """The few parts of a servicer context croupier's handlers use."""

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: Any = ()) -> None:
        raise Refused(code, details)

    def invocation_metadata(self) -> tuple[Any, ...]:
        return ()

    def time_remaining(self) -> float | None:
        return None


def _setup() -> tuple[Coordinator, dict[str, Any]]:
    tmp = tempfile.mkdtemp(prefix="croupier-fuzz-")
    core = Coordinator(open_store(f"sqlite:///{tmp}/c.db"))
    serving = Serving(core, ServerOptions(max_concurrent_joins=1, max_request_bytes=MAX_REQUEST), None, workers=4)
    serving.admission.waiting = 1  # every waiting place taken: a join that would wait is refused at once
    handlers = {name: serving.handler(name, None, None).unary_unary for name in RPCS}
    if os.environ.get("CROUPIER_FUZZ_PLANT") == "1":
        # A planted fault, for tests/project/test_fuzz.py: GetJob registers a job before it reads its request.
        get_job = serving.servicer.GetJob
        planted_jobs = [0]

        def planted(m: Any, who: Any, budget: Any) -> Any:
            planted_jobs[0] += 1
            core.join(_join_request(f"planted-{planted_jobs[0]}", Spec(n=10), 0, world=1))
            return get_job(m, who, budget)

        serving.servicer.GetJob = planted  # type: ignore[method-assign]
    spec = Spec(n=1000, batch_size=10)
    for rank in range(2):  # a started job of two ranks, which most seeds below name
        core.join(_join_request("fuzz", spec, rank))
    return core, handlers


def _join_request(job: str, spec: Spec, rank: int, world: int = 2) -> Any:
    from croupier.core.api import JoinRequest

    return JoinRequest(job=job, spec=spec, incarnation="t", world=world, rank=rank)


def seeds() -> list[bytes]:
    """A valid request of each RPC, as a first corpus (libFuzzer mutates from them)."""
    spec = spec_to_proto(Spec(n=1000, batch_size=10))
    cur = cursor_to_proto(Cursor(0, ((0, 1000),)))
    reqs = [
        ("Join", pb.JoinRequest(request_id="r", job="fuzz", spec=spec, incarnation="t", world=2, rank=1, resume=cur, wait_ms=0)),
        ("Lease", pb.LeaseRequest(job="fuzz", generation=1, rank=0, epoch=0, first_batch=0, count=2)),
        ("Grant", pb.GrantRequest(job="fuzz", generation=1, rank=1, epoch=0, first_batch=3, count=4,
                                  progress=pb.Progress(epoch=0, batches=3))),
        ("GetJob", pb.GetJobRequest(job="fuzz")),
        ("Report", pb.ReportRequest(job="fuzz", generation=1, rank=0, progress=pb.Progress(epoch=0, batches=5),
                                    checkpoint=checkpoint_to_proto(1, Cursor(0, ((50, 1000),)), "fuzz"))),
        ("GetCheckpoint", pb.GetCheckpointRequest(job="fuzz", latest=True)),
        ("ListJobs", pb.ListJobsRequest(page_size=5)),
        ("Amend", pb.AmendRequest(job="fuzz", kind="weights", values=[1, 2])),
    ]
    return [bytes([RPCS.index(name)]) + m.SerializeToString() for name, m in reqs]


def main() -> None:
    core, handlers = _setup()
    loop = asyncio.new_event_loop()
    counts: dict[str, int] = {}

    def one(data: bytes) -> None:
        if not data:
            return
        n = sum(counts.values())
        if n % 500 == 0 and n:  # libFuzzer ends the process itself: the tally goes out as it runs
            print(f"outcomes: {dict(sorted(counts.items()))}", file=sys.stderr, flush=True)
        name = RPCS[data[0] % len(RPCS)]
        raw = data[1:]
        before = core.snapshot_state()
        try:
            loop.run_until_complete(handlers[name](raw, Context()))
            counts["ok"] = counts.get("ok", 0) + 1
        except Refused as r:
            counts[r.code.name] = counts.get(r.code.name, 0) + 1
            if r.code.name not in ALLOWED:
                raise AssertionError(f"{name} answered {r.code.name}: {r.details}") from None
            if r.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-concurrent-joins" in r.details:
                return  # documented: the join was recorded, only its wait refused
            if core.snapshot_state() != before:
                raise AssertionError(f"{name} was refused ({r.code.name}: {r.details}) and changed the state") from None

    argv = list(sys.argv)
    if not any(not a.startswith("-") for a in argv[1:]):  # no corpus folder given: start from the seeds
        corpus = tempfile.mkdtemp(prefix="croupier-fuzz-corpus-")
        for i, seed in enumerate(seeds()):
            with open(f"{corpus}/seed-{i}", "wb") as f:
                f.write(seed)
        argv.append(corpus)
    atheris.Setup(argv, one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
