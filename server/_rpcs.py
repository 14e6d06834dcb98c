"""The coordinator's RPCs as plain functions of a parsed request: message in, core called, message out."""

from __future__ import annotations

import bisect
import functools
import logging
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from croupier.core import errors as E
from croupier.core.amend import KINDS
from croupier.core.api import JoinRequest, JoinResult
from croupier.core.ftsteps import CommittedStep
from croupier.core.wire import (
    amendment_from_proto,
    amendment_to_proto,
    checkpoint_from_proto,
    cursor_from_proto,
    cursor_to_proto,
    items_from_proto,
    pack_indices,
    pack_runs,
    record_to_proto,
    schedule_from_proto,
    spec_from_proto,
    spec_to_proto,
)
from croupier.server._auth import Credential, allow
from croupier.server._coordinator import Coordinator
from croupier.server._deadline import UNBOUNDED, Budget
from croupier.server._options import ServerOptions
from croupier.v1 import coordinator_pb2 as pb

log = logging.getLogger("croupier.server")

M = TypeVar("M", bound=Message)

#: The most jobs one ListJobs page names.
MAX_PAGE = 10_000
#: Each RPC's request message, as the service names its methods.
REQUESTS: dict[str, type[Message]] = {
    "Join": pb.JoinRequest, "Lease": pb.LeaseRequest, "Grant": pb.GrantRequest, "GetJob": pb.GetJobRequest,
    "Report": pb.ReportRequest, "GetCheckpoint": pb.GetCheckpointRequest, "ListJobs": pb.ListJobsRequest,
    "Amend": pb.AmendRequest, "GetLedger": pb.GetLedgerRequest, "CommitStep": pb.CommitStepRequest,
}
#: The coordinator's RPCs.
RPCS = tuple(REQUESTS)


def parse(kind: type[M], raw: bytes) -> M:
    """`raw` as a `kind` message; INVALID_ARGUMENT naming the message when it is not one."""
    try:
        return kind.FromString(raw)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise E.InvalidArgument(f"request is not a valid {kind.DESCRIPTOR.full_name} message: {e}") from None


def job_of(m: Message) -> str | None:
    """The job a request names (None for ListJobs, which names none)."""
    job = getattr(m, "job", None)
    return job if isinstance(job, str) else None


def join_response(r: JoinResult) -> pb.JoinResponse:
    m = pb.JoinResponse(generation=r.generation, world=r.world, started=r.start is not None, waiting_for=list(r.waiting_for),
                        waiting=r.waiting_count)
    if r.start is not None:
        m.start.CopyFrom(cursor_to_proto(r.start))
        m.amendments.extend(amendment_to_proto(a) for a in r.amendments)
    return m


def join_reply(r: JoinResult, req: JoinRequest) -> pb.JoinResponse:
    """A join's answer: with the job's spec when the rank sent another form of it (its sources grown)."""
    m = join_response(r)
    if r.spec is not None and r.spec != req.spec:
        m.spec.CopyFrom(spec_to_proto(r.spec))
    return m


class CoordinatorServicer:
    """Each RPC converts the parsed request, calls the core, converts back (a join's wait is the serving
    layer's: see ``croupier.server._aio``)."""

    def __init__(self, core: Coordinator, options: ServerOptions | None = None) -> None:
        self.core = core
        self.options = options or ServerOptions()

    def join_request(self, m: pb.JoinRequest, who: Credential | None) -> JoinRequest:
        """The join a request asks for, checked."""
        _allow(who, "Join", m.job)
        if not m.request_id or len(m.request_id) > 128:
            raise E.InvalidArgument(f"request_id must be a non-empty string of at most 128 characters (got {m.request_id!r})")
        if not m.HasField("spec"):
            raise E.InvalidArgument("join needs the job's spec")
        req = JoinRequest(
            job=m.job, spec=spec_from_proto(m.spec), incarnation=m.incarnation, world=m.world, rank=m.rank,
            resume=cursor_from_proto(m.resume) if m.HasField("resume") else None,
            epoch=m.epoch if m.HasField("epoch") else None,
            amendments=tuple(amendment_from_proto(a) for a in m.amendments),
            resume_step=m.resume_step if m.HasField("resume_step") else None,
            resume_generation=m.resume_generation if m.HasField("resume_generation") else None,
            schedule=schedule_from_proto(m.schedule),
        )
        if m.world > self.options.max_world:
            raise E.ResourceExhausted(f"world {m.world} is more than this coordinator's limit of {self.options.max_world} "
                                      "ranks (croupier serve --max-world)")
        log.debug("join %s: job=%s incarnation=%s rank=%d/%d", m.request_id, m.job, m.incarnation, m.rank, m.world,
                  extra={"job": m.job, "rank": m.rank})
        return req

    def Join(self, m: pb.JoinRequest, who: Credential | None, budget: Budget = UNBOUNDED) -> tuple[JoinRequest, JoinResult]:
        """Decides and journals the join (durable on return), without waiting for the other ranks."""
        req = self.join_request(m, who)
        return req, self.core.join(req, budget)

    def Lease(self, m: pb.LeaseRequest, who: Credential | None, budget: Budget = UNBOUNDED) -> pb.LeaseResponse:
        _allow(who, "Lease", m.job)
        lease = self.core.lease(m.job, m.generation, m.rank, m.epoch, m.first_batch, m.count, _progress(m), budget)
        data, itemsize = pack_indices(lease.indices, lease.n)
        out = pb.LeaseResponse(indices=data, itemsize=itemsize, end_of_epoch=lease.end_of_epoch,
                               epoch_samples=lease.epoch_samples)
        fixed = fixed_sizes(lease.sizes)
        if fixed is not None:
            out.batches, out.batch_size, out.last_size = fixed
            if m.fixed_sizes:
                return out  # the caller reads them from these three
        return _with_sizes(out, lease.sizes)

    def Grant(self, m: pb.GrantRequest, who: Credential | None, budget: Budget = UNBOUNDED) -> pb.GrantResponse:
        """A grant; with a budget ``at_once``, WouldWait where it would wait for the store (see ``Coordinator.grant``)."""
        _allow(who, "Grant", m.job)
        g = self.core.grant(m.job, m.generation, m.rank, m.epoch, m.first_batch, m.count, _progress(m), budget)
        return pb.GrantResponse(batches=g.batches, last_size=g.last_size, end_of_epoch=g.end_of_epoch,
                                epoch_samples=g.epoch_samples, dealt=pack_runs(g.runs))

    def GetJob(self, m: pb.GetJobRequest, who: Credential | None, budget: Budget = UNBOUNDED) -> pb.GetJobResponse:
        _allow(who, "GetJob", m.job)
        st = self.core.job(m.job, budget)
        j = join_response(st.result)
        out = pb.GetJobResponse(spec=spec_to_proto(st.spec), generation=j.generation, world=j.world,
                                started=j.started, waiting_for=j.waiting_for, waiting=j.waiting)
        if j.HasField("start"):
            out.start.CopyFrom(j.start)
        out.ranks.extend(pb.RankCursor(rank=c.rank, epoch=c.epoch, batches=c.batches, batches_in_epoch=c.batches_in_epoch,
                                       reported_unix_ms=c.reported_ms) for c in st.ranks)
        out.checkpoints.extend(record_to_proto(r) for r in st.checkpoints)
        out.amendments.extend(amendment_to_proto(a) for a in st.amendments)
        return out

    def Amend(self, m: pb.AmendRequest, who: Credential | None, budget: Budget = UNBOUNDED) -> pb.AmendResponse:
        _allow(who, "Amend", m.job)
        if m.kind not in KINDS:
            raise E.InvalidArgument(f"amendment kind must be one of {', '.join(map(repr, KINDS))} (got {m.kind!r})")
        a = self.core.amend(m.job, m.kind, tuple(m.values), budget)
        return pb.AmendResponse(amendment=amendment_to_proto(a))

    def Report(self, m: pb.ReportRequest, who: Credential | None, budget: Budget = UNBOUNDED) -> pb.ReportResponse:
        _allow(who, "Report", m.job)
        if not m.HasField("progress"):
            raise E.InvalidArgument("a report needs the rank's progress")
        checkpoint = checkpoint_from_proto(m.checkpoint) if m.HasField("checkpoint") else None
        cursor = self.core.report(m.job, m.generation, m.rank, m.progress.epoch, m.progress.batches, checkpoint,
                                  lockstep=not m.own, items=items_from_proto(m.checkpoint) if checkpoint else None, budget=budget)
        out = pb.ReportResponse()
        if cursor is not None:
            out.cursor.CopyFrom(cursor_to_proto(cursor))
        return out

    def GetCheckpoint(self, m: pb.GetCheckpointRequest, who: Credential | None,
                      budget: Budget = UNBOUNDED) -> pb.GetCheckpointResponse:
        _allow(who, "GetCheckpoint", m.job)
        spec, record = self.core.checkpoint(m.job, None if m.latest else m.step, budget)
        return pb.GetCheckpointResponse(spec=spec_to_proto(spec), record=record_to_proto(record))

    def GetLedger(self, m: pb.GetLedgerRequest, who: Credential | None, budget: Budget = UNBOUNDED) -> pb.GetLedgerResponse:
        _allow(who, "GetLedger", m.job)
        spec, segments, steps = self.core.ledger(m.job, budget)
        return pb.GetLedgerResponse(spec=spec_to_proto(spec), segments=segments, steps=steps)

    def CommitStep(self, m: pb.CommitStepRequest, who: Credential | None, budget: Budget = UNBOUNDED) -> pb.CommitStepResponse:
        _allow(who, "CommitStep", m.job)
        if not m.HasField("spec"):
            raise E.InvalidArgument("a step report needs the job's spec")
        if m.stop < m.start:
            raise E.InvalidArgument(f"a step report's span [{m.start}, {m.stop}) is empty or reversed")
        step = CommittedStep.from_list([m.step, m.start, m.stop, m.quorum, m.participants])  # the wire's form
        new = self.core.commit_step(m.job, spec_from_proto(m.spec), m.run, m.parent, m.resumed, m.mode, m.batch, step, budget)
        return pb.CommitStepResponse(recorded=new)

    def ListJobs(self, m: pb.ListJobsRequest, who: Credential | None, budget: Budget = UNBOUNDED) -> pb.ListJobsResponse:
        _allow(who, "ListJobs", None)
        if m.page_size > MAX_PAGE:
            raise E.InvalidArgument(f"page_size must be at most {MAX_PAGE} (got page_size={m.page_size})")
        names = [j for j in self.core.jobs(budget) if who is None or who.reads(j)]  # sorted
        first = bisect.bisect_right(names, m.page_token) if m.page_token else 0
        page = names[first:first + m.page_size] if m.page_size else names[first:]
        more = bool(page) and first + len(page) < len(names)
        return pb.ListJobsResponse(jobs=page, next_page_token=page[-1] if more else "", total=len(names))


def _allow(who: Credential | None, method: str, job: str | None) -> None:
    if who is not None:
        allow(who, method, job)


def _progress(m: pb.LeaseRequest | pb.GrantRequest) -> tuple[int, int] | None:
    return (m.progress.epoch, m.progress.batches) if m.HasField("progress") else None


def fixed_sizes(sizes: list[int]) -> tuple[int, int, int] | None:
    """Batch sizes as fixed batches: (how many, each one's size, the last one's), or None when they are not
    (an empty lease, or batches of sizes that vary, as token budgets make)."""
    if not sizes:
        return None
    same = sizes.count(sizes[0])
    if same == len(sizes) or (same == len(sizes) - 1 and sizes[-1] != sizes[0]):
        return len(sizes), sizes[0], sizes[-1]
    return None


def _with_sizes(m: pb.LeaseResponse, sizes: list[int]) -> pb.LeaseResponse:
    """`m` with a lease's batch sizes.

    NOTE: set one by one, the 65,536 sizes of a default lease of indices cost about a millisecond,
    more than the rest of the answer. Fixed batches (every size the same but perhaps the last) are
    merged in from their encoding instead, made once for each (size, count, last).
    """
    fixed = fixed_sizes(sizes)
    if fixed is not None:
        count, size, last = fixed
        m.MergeFromString(_sizes_encoded(size, count, last))
        return m
    m.sizes.extend(sizes)
    return m


@functools.lru_cache(maxsize=64)
def _sizes_encoded(size: int, count: int, last: int) -> bytes:
    """The encoding of a LeaseResponse holding only `count` batch sizes, each `size` but the last (`last`)."""
    return pb.LeaseResponse(sizes=[size] * (count - 1) + [last]).SerializeToString()
