"""A typed client of the coordinator's API v1: retries while it is unavailable, domain errors otherwise."""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
import msgpack
import numpy as np

from croupier.client import _forks
from croupier.client._call_log import CallLog
from croupier.core import errors as E
from croupier.core import settings
from croupier.core.amend import Amendment
from croupier.core.api import MAX_MESSAGE_BYTES, CheckpointRecord, Grant, JobStatus, JoinRequest, JoinResult, RankCursor
from croupier.core.ftsteps import CommittedStep, StepRun, Steps
from croupier.core.ledger import History, Ledger, history, unpack
from croupier.core.order import Cursor
from croupier.core.spec import Spec
from croupier.core.wire import (
    amendment_from_proto,
    amendment_to_proto,
    checkpoint_to_proto,
    cursor_from_proto,
    cursor_to_proto,
    record_from_proto,
    schedule_to_proto,
    spec_from_proto,
    spec_to_proto,
    unpack_indices,
    unpack_runs,
)
from croupier.v1 import coordinator_pb2 as pb
from croupier.v1 import coordinator_pb2_grpc as pb_grpc

# The client's gRPC settings (the server's are its own). The client pings only while a call is in
# flight, and at most every 5 min: gRPC's default for the least time a server accepts between a
# client's pings. A client that pings more often than its server accepts is sent GOAWAY
# "too_many_pings" (a croupier server behind a proxy, or another server's defaults); the client's
# liveness comes from its calls' deadlines, not from pings.
#: gRPC's default ``grpc.http2.min_recv_ping_interval_without_data_ms`` for servers.
GRPC_DEFAULT_MIN_PING_INTERVAL_MS = 300_000
_KEEPALIVE_TIMEOUT_MS = 10_000
#: The options of every channel a croupier client opens.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", GRPC_DEFAULT_MIN_PING_INTERVAL_MS),
    ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 0),
]


T = TypeVar("T")
log = logging.getLogger("croupier")


def _ranks(ranks: tuple[int, ...] | list[int], count: int | None = None) -> str:
    """A list of ranks, shortened past 16, and how many there are (`count`: more than the list names)."""
    count = len(ranks) if count is None else count
    shown = ", ".join(map(str, list(ranks)[:16]))
    return f"[{shown}{', ...' if count > min(16, len(ranks)) else ''}] ({count} ranks)"


def _waiting(r: pb.JoinResponse | pb.GetJobResponse) -> int:
    """How many ranks an answer says the generation waits for (an earlier coordinator, which sends no
    count, named every one of them)."""
    return r.waiting if r.waiting or r.started else len(r.waiting_for)


#: What a coordinator that is restarting answers: UNAVAILABLE (down), DEADLINE_EXCEEDED, and
#: CANCELLED (a call that reached a server while it shut down). The client never cancels its own
#: calls, and once closed its channel refuses retries, so retrying CANCELLED cannot loop.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


#: The trailing metadata key of the coordinator's retry hint on a refusal (croupier.server._admission.RETRY_AFTER_KEY).
RETRY_AFTER_KEY = "croupier-retry-after-ms"


def _retry_after_s(e: grpc.RpcError) -> float | None:
    """The retry hint a refusal carries, in seconds (at most 10), or None."""
    try:
        md: Any = e.trailing_metadata() or ()  # type: ignore[attr-defined,unused-ignore]
    except Exception:  # an error that is not a call (a channel closed under it) has none
        return None
    for item in md:
        key, value = item[0], item[1]
        if key == RETRY_AFTER_KEY:
            try:
                return min(max(int(value), 0), 10_000) / 1000.0
            except ValueError:
                return None
    return None


class Unreachable(E.Unavailable):
    """The coordinator did not answer a call that is not retried (a grant): it is down or restarting."""


class LeaseReply:
    """Batches of one lease, decoded: their indices end to end, and each batch's size."""

    __slots__ = ("indices", "sizes", "end_of_epoch", "epoch_samples", "tags")

    def __init__(self, indices: np.ndarray, sizes: list[int], end_of_epoch: bool, epoch_samples: int,
                 checked: bool = False, tags: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        # `checked`: the sizes come from the plan that computed the indices (the prefetcher's leases) or were
        # checked in O(1) (a Lease answer's fixed batches): summing 65,536 sizes of 1 again would only cost time.
        if not checked and indices.size != sum(sizes):
            raise ValueError(f"lease holds {indices.size} indices but its batch sizes add up to {sum(sizes)}")
        self.indices = indices
        self.sizes = sizes
        self.end_of_epoch = end_of_epoch
        self.epoch_samples = epoch_samples
        #: a tagging sampler's (source, source epoch, seed) of each index
        self.tags = tags

    @property
    def batches(self) -> list[np.ndarray]:
        """The batches, one array each."""
        return np.split(self.indices, np.cumsum(self.sizes)[:-1]) if self.sizes else []


@dataclasses.dataclass(frozen=True)
class Security:
    """How a client reaches a coordinator that speaks TLS or wants a credential.

    :meth:`from_env` reads the environment, which is what every croupier client uses unless given
    one: ``CROUPIER_TLS_CA`` (PEM roots that sign the server's certificate; its presence turns TLS
    on), ``CROUPIER_TLS=1`` (TLS with the system's roots), ``CROUPIER_TLS_CERT`` and
    ``CROUPIER_TLS_KEY`` (this client's certificate, for mutual TLS), ``CROUPIER_TLS_SERVER_NAME``
    (the name the server's certificate carries, when the address names it otherwise) and
    ``CROUPIER_CREDENTIAL`` (the secret sent with every call; ``CROUPIER_INCARNATION``
    names the incarnation, something else).

    Attributes:
        tls: Speak TLS.
        ca: Path of the PEM roots that verify the server (None: the system's).
        cert: Path of this client's PEM certificate chain (mutual TLS); with `key`.
        key: Path of its private key.
        server_name: The name to verify the server's certificate against.
        credential: The secret sent as ``authorization: Bearer <secret>`` with every call.
    """

    tls: bool = False
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None
    credential: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError(f"a client certificate needs its key and the other way round (got cert={self.cert!r}, "
                             f"key={self.key!r})")
        if (self.ca or self.cert or self.server_name) and not self.tls:
            raise ValueError("ca, cert and server_name are TLS settings: set tls=True")

    @classmethod
    def from_env(cls) -> Security:
        get = settings.get
        ca, cert, key = get("CROUPIER_TLS_CA"), get("CROUPIER_TLS_CERT"), get("CROUPIER_TLS_KEY")
        name = get("CROUPIER_TLS_SERVER_NAME")
        tls = bool(ca or cert or name) or settings.flag("CROUPIER_TLS")
        return cls(tls, ca, cert, key, name, get("CROUPIER_CREDENTIAL"))

    def __repr__(self) -> str:  # never show the secret
        shown = "set" if self.credential else None
        return (f"Security(tls={self.tls}, ca={self.ca!r}, cert={self.cert!r}, key={self.key!r}, "
                f"server_name={self.server_name!r}, credential={shown})")

    def channel(self, address: str, options: list[tuple[str, Any]]) -> grpc.Channel:
        """A channel to `address` with these settings."""
        if self.tls:
            def read(path: str | None) -> bytes | None:
                if path is None:
                    return None
                with open(path, "rb") as f:
                    return f.read()

            creds = grpc.ssl_channel_credentials(root_certificates=read(self.ca), private_key=read(self.key),
                                                 certificate_chain=read(self.cert))
            if self.server_name:
                options = [*options, ("grpc.ssl_target_name_override", self.server_name)]
            channel = grpc.secure_channel(address, creds, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        if self.credential:
            channel = grpc.intercept_channel(channel, _Credential(self.credential))
        calls = settings.get("CROUPIER_CALL_LOG")
        if calls:
            channel = grpc.intercept_channel(channel, CallLog(calls))
        return channel


class _Credential(grpc.UnaryUnaryClientInterceptor):
    """Adds the credential to every call's metadata."""

    def __init__(self, secret: str) -> None:
        self._md = ("authorization", f"Bearer {secret}")

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        md = [*(details.metadata or ()), self._md]
        return continuation(_Details(details.method, details.timeout, md, details.credentials,
                                     details.wait_for_ready, details.compression), request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method: str, timeout: float | None, metadata: Any, credentials: Any, wait_for_ready: Any,
                 compression: Any) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


class CoordinatorClient:
    """Calls one coordinator. Retries UNAVAILABLE (e.g. while it restarts) with jittered backoff.

    Args:
        address: HOST:PORT of the coordinator.
        retry_for: Seconds to keep retrying an unavailable coordinator before giving up.
        call_timeout: Deadline of one attempt, in seconds.
        security: TLS and credential settings (default: :meth:`Security.from_env`).
    """

    def __init__(self, address: str, retry_for: float = 120.0, call_timeout: float = 30.0,
                 security: Security | None = None) -> None:
        self.address = address
        self.retry_for = retry_for
        self.call_timeout = call_timeout
        self.security = security if security is not None else Security.from_env()
        # NOTE: "host1:port,host2:port" names replicas of one coordinator (on one shared store):
        # a call that finds one unavailable is retried on the next. A DNS name with several
        # addresses is one endpoint: gRPC itself moves to another address when one fails.
        self.endpoints = [a.strip() for a in address.split(",") if a.strip()]
        if not self.endpoints:
            raise ValueError(f"address names no coordinator (got {address!r})")
        self._at = 0
        self.channel = self.security.channel(self.endpoints[0], CHANNEL_OPTIONS)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self._old: list[grpc.Channel] = []
        self._switch = threading.Lock()
        self.retries = 0
        #: Calls the coordinator refused at once for its admission bounds and that were asked again after its hint.
        self.refusals = 0
        self.closed = False

    def _next_endpoint(self) -> None:
        """Moves to the next replica (no-op with one endpoint); the old channel closes with the client."""
        if len(self.endpoints) < 2 or self.closed:
            return
        with self._switch:
            self._at = (self._at + 1) % len(self.endpoints)
            self._old.append(self.channel)
            self.channel = self.security.channel(self.endpoints[self._at], CHANNEL_OPTIONS)
            self.stub = pb_grpc.CoordinatorStub(self.channel)

    def _call(self, what: str, fn: Callable[[], T], retry_for: float | None = None) -> T:
        deadline = time.monotonic() + (self.retry_for if retry_for is None else retry_for)
        delay = 0.02
        others = len(self.endpoints) - 1  # a call asked once still tries every replica once
        while True:
            try:
                with _forks.calling():  # no call in flight across a fork (a DataLoader starting its workers)
                    return fn()
            except grpc.RpcError as e:
                code = e.code()
                if code in RETRYABLE:
                    self._next_endpoint()
                if code in RETRYABLE and retry_for == 0.0 and others > 0 and not self.closed:
                    others -= 1
                    continue
                if code in RETRYABLE and retry_for == 0.0:
                    raise Unreachable(f"coordinator at {self.address}: {what} failed with {code.name}") from None
                if code in RETRYABLE and time.monotonic() < deadline and not self.closed:
                    self.retries += 1
                    time.sleep(delay * (0.5 + random.random()))  # backoff between retries, not synchronisation
                    delay = min(delay * 2, 1.0)
                    continue
                hint = _retry_after_s(e) if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
                if hint is not None:
                    # Refused at once by the coordinator's admission (nothing done): asked again after
                    # its hint, jittered so that the refused ranks do not come back together.
                    if retry_for == 0.0:
                        raise Unreachable(f"coordinator at {self.address}: {what} refused: {e.details()}") from None
                    wait = hint * (0.5 + random.random())
                    if time.monotonic() + wait < deadline and not self.closed:
                        self.retries += 1
                        self.refusals += 1
                        time.sleep(wait)  # the coordinator's retry hint, not synchronisation
                        continue
                kind = E.BY_CODE.get(code.name)
                details = e.details() or ""
                if kind is None:
                    raise RuntimeError(f"coordinator at {self.address}: {what} failed with {code.name}: {details}") from None
                raise kind(f"coordinator at {self.address}: {details}") from None

    def join(self, req: JoinRequest, wait_s: float = 10.0, request_id: str | None = None) -> JoinResult:
        """Joins `req.rank` to its generation; waits up to `wait_s` for the generation to start."""
        m = pb.JoinRequest(request_id=request_id or uuid.uuid4().hex, job=req.job, spec=spec_to_proto(req.spec),
                           incarnation=req.incarnation, world=req.world, rank=req.rank, wait_ms=int(wait_s * 1000))
        if req.resume is not None:
            m.resume.CopyFrom(cursor_to_proto(req.resume))
        if req.epoch is not None:
            m.epoch = req.epoch
        m.amendments.extend(amendment_to_proto(a) for a in req.amendments)
        if req.resume_step is not None:
            m.resume_step = req.resume_step
        if req.resume_generation is not None:
            m.resume_generation = req.resume_generation
        m.schedule.extend(schedule_to_proto(req.schedule))
        r = self._call("join", lambda: self.stub.Join(m, timeout=self.call_timeout + wait_s))
        return JoinResult(r.generation, r.world, cursor_from_proto(r.start) if r.started else None, tuple(r.waiting_for),
                          tuple(amendment_from_proto(a) for a in r.amendments),
                          spec_from_proto(r.spec) if r.HasField("spec") else None, _waiting(r))

    def amend(self, job: str, kind: str, values: Sequence[int]) -> Amendment:
        """Records a change of `job`'s mixture (``croupier.core.amend``): it holds from the job's next
        generation on. Asked once (recording it twice would be two changes)."""
        m = pb.AmendRequest(job=job, kind=kind, values=[int(v) for v in values])
        r = self._call("amend", lambda: self.stub.Amend(m, timeout=self.call_timeout), retry_for=0.0)
        return amendment_from_proto(r.amendment)

    def join_started(self, req: JoinRequest, timeout: float = 600.0, poll_s: float = 5.0) -> JoinResult:
        """Joins and keeps waiting (short long-polls, no busy loop) until every rank has joined.

        NOTE: a waiting join holds no thread of the server (it waits as a coroutine); polls of
        `poll_s` let a rank notice a coordinator that restarted, or moved to another replica, soon.
        A join refused the wait (``--max-concurrent-joins``) is asked again after the server's
        retry hint by each call, then here with a backoff of its own.
        """
        request_id = uuid.uuid4().hex
        began = time.monotonic()
        end, say = began + timeout, began + min(10.0, timeout / 2)
        busy = 0.05
        while True:
            try:
                # each poll ends by the time a warning is due or the rank gives up, whichever comes first
                r = self.join(req, wait_s=min(poll_s, max(0.0, min(end, say) - time.monotonic())), request_id=request_id)
            except E.ResourceExhausted as e:
                # Only the limit of joins in progress passes: the others (jobs, world) stay.
                if "--max-concurrent-joins" not in str(e) or time.monotonic() >= end:
                    raise
                time.sleep(busy * (0.5 + random.random()))  # backoff, not synchronisation
                busy = min(busy * 2, 2.0)
                continue
            if r.start is not None:
                return r
            now = time.monotonic()
            if now >= end:
                raise TimeoutError(
                    f"rank {req.rank} of job {req.job!r} gave up after {timeout:.0f} s: generation {r.generation} "
                    f"(world {req.world}) still waits for ranks {_ranks(r.waiting_for, r.waiting_count)}. Every rank "
                    "joins at its first batch; ranks that never reach it (a crashed process, a wrong world size, or all "
                    "ranks in one process one after another: use croupier.client.shards for that) keep the others waiting"
                )
            if now >= say:
                log.warning("croupier: rank %d of job %r has waited %.0f s for ranks %s of generation %d (world %d)",
                            req.rank, req.job, now - began, _ranks(r.waiting_for, r.waiting_count), r.generation, req.world)
                say = now + 30.0

    def lease(self, job: str, generation: int, rank: int, epoch: int, first: int, count: int,
              timeout: float | None = None, progress: tuple[int, int] | None = None) -> LeaseReply:
        """Batches first .. first + count - 1 of `rank` in `epoch`, as indices.

        With `timeout`, asks once: no answer within it raises :class:`Unreachable` (not retried).
        `progress` (epoch, batches) reports how far the rank's loop got (see :meth:`report`).
        """
        m = pb.LeaseRequest(job=job, generation=generation, rank=rank, epoch=epoch, first_batch=first, count=count,
                            fixed_sizes=True)
        if progress is not None:
            m.progress.epoch, m.progress.batches = progress
        r = self._call("lease", lambda: self.stub.Lease(m, timeout=self.call_timeout if timeout is None else timeout),
                       retry_for=None if timeout is None else 0.0)
        indices = unpack_indices(r.indices, r.itemsize)
        if r.sizes or not r.batches:  # each size on the wire: batches that vary, or a coordinator older than fixed_sizes
            return LeaseReply(indices, list(r.sizes), r.end_of_epoch, r.epoch_samples)
        size, last = r.batch_size, r.last_size  # fixed batches, named by three numbers: checked in O(1)
        if indices.size != (r.batches - 1) * size + last:
            raise ValueError(f"lease holds {indices.size} indices but its {r.batches} batches of {size} "
                             f"(the last {last}) hold {(r.batches - 1) * size + last}")
        return LeaseReply(indices, [size] * (r.batches - 1) + [last], r.end_of_epoch, r.epoch_samples, checked=True)

    def grant(self, job: str, generation: int, rank: int, epoch: int, first: int, count: int,
              timeout: float = 1.0, progress: tuple[int, int] | None = None) -> Grant:
        """Asks once for batches first .. first + count - 1 of `rank` in `epoch`, as positions of the plan.

        `progress` (epoch, batches) reports how far the rank's loop got (see :meth:`report`).

        Raises:
            Unreachable: no answer within `timeout` (the coordinator is down or restarting); not retried.
            Aborted, NotFound: the generation was replaced (fenced).
        """
        m = pb.GrantRequest(job=job, generation=generation, rank=rank, epoch=epoch, first_batch=first, count=count)
        if progress is not None:
            m.progress.epoch, m.progress.batches = progress
        r = self._call("grant", lambda: self.stub.Grant(m, timeout=timeout), retry_for=0.0)
        return Grant(r.batches, r.last_size, r.end_of_epoch, r.epoch_samples, unpack_runs(r.dealt))

    def get_job(self, job: str) -> tuple[Spec, JoinResult]:
        r = self._call("get_job", lambda: self.stub.GetJob(pb.GetJobRequest(job=job), timeout=self.call_timeout))
        start: Cursor | None = cursor_from_proto(r.start) if r.started else None
        return spec_from_proto(r.spec), JoinResult(r.generation, r.world, start, tuple(r.waiting_for), waiting=_waiting(r))

    def status(self, job: str) -> JobStatus:
        """What the coordinator holds for `job`: generation, the ranks' cursors, the checkpoints recorded."""
        r = self._call("get_job", lambda: self.stub.GetJob(pb.GetJobRequest(job=job), timeout=self.call_timeout))
        start: Cursor | None = cursor_from_proto(r.start) if r.started else None
        ranks = tuple(RankCursor(c.rank, c.epoch, c.batches, c.batches_in_epoch, c.reported_unix_ms) for c in r.ranks)
        return JobStatus(spec_from_proto(r.spec), JoinResult(r.generation, r.world, start, tuple(r.waiting_for),
                                                             waiting=_waiting(r)), ranks,
                         tuple(record_from_proto(c) for c in r.checkpoints),
                         tuple(amendment_from_proto(a) for a in r.amendments))

    def jobs(self) -> list[str]:
        """The names of the jobs the coordinator holds (those this caller may read)."""
        r = self._call("list_jobs", lambda: self.stub.ListJobs(pb.ListJobsRequest(), timeout=self.call_timeout))
        return list(r.jobs)

    def jobs_page(self, size: int, after: str = "") -> tuple[list[str], str, int]:
        """At most `size` job names after `after`, by name: (names, the `after` of the next page or "", how many jobs)."""
        m = pb.ListJobsRequest(page_size=size, page_token=after)
        r = self._call("list_jobs", lambda: self.stub.ListJobs(m, timeout=self.call_timeout))
        return list(r.jobs), r.next_page_token, r.total

    def report(self, job: str, generation: int, rank: int, progress: tuple[int, int],
               checkpoint: tuple[int | None, Cursor | None, str] | None = None, timeout: float | None = None,
               own: bool = False, items: int | None = None) -> Cursor | None:
        """Reports how far the rank's loop got (epoch, batches of its share of the generation's plan)
        and, with `checkpoint` (step, cursor, origin), a checkpoint state it took; returns once the
        coordinator made the checkpoint durable, with the checkpoint's cursor as recorded (for
        dynamic dealing the cursor sent is None and the coordinator computes it, crediting only
        this rank's progress and the others' commits when `own`). `items` names the checkpoint's
        items of its epoch (what the rank's ``len()`` counted). With `timeout`, asks once
        (Unreachable if no answer)."""
        m = pb.ReportRequest(job=job, generation=generation, rank=rank, own=own)
        m.progress.epoch, m.progress.batches = progress
        if checkpoint is not None:
            m.checkpoint.CopyFrom(checkpoint_to_proto(*checkpoint, items))
        r = self._call("report", lambda: self.stub.Report(m, timeout=self.call_timeout if timeout is None else timeout),
                       retry_for=None if timeout is None else 0.0)
        return cursor_from_proto(r.cursor) if r.HasField("cursor") else None

    def ledger(self, job: str) -> Ledger:
        """The job's step ledger over its generations (``croupier.core.ledger``): what each step trained, where
        each sample was trained. Fetched once (a few bytes per generation); the questions are answered here.
        :meth:`history` answers the same questions for every kind of job."""
        r = self._call("get_ledger", lambda: self.stub.GetLedger(pb.GetLedgerRequest(job=job), timeout=self.call_timeout))
        return Ledger(job, spec_from_proto(r.spec), unpack(r.segments))

    def steps(self, job: str) -> tuple[Spec, Steps]:
        """A fault-tolerant job's spec and record of committed steps (``croupier.core.ftsteps``)."""
        led, steps = self.history(job)
        return led.spec, steps

    def history(self, job: str) -> tuple[History, Steps]:
        """The job's history (``croupier.core.history``: a generation job's step ledger, or a torchft job's, from
        its record of committed steps) and that record (empty for a generation job): one ``GetLedger``."""
        r = self._call("get_ledger", lambda: self.stub.GetLedger(pb.GetLedgerRequest(job=job), timeout=self.call_timeout))
        runs = [StepRun.from_dict(v) for v in (msgpack.unpackb(r.steps) if r.steps else [])]
        return history(job, spec_from_proto(r.spec), unpack(r.segments), runs), Steps(runs)

    def commit_step(self, job: str, spec: Spec, run: str, parent: str, resumed: int, mode: str, batch: int,
                    step: CommittedStep, timeout: float | None = None) -> bool:
        """Records a fault-tolerant job's committed step; False when another group's report recorded it first."""
        before, start, stop, quorum, participants = step.to_list()  # the wire's form: the steps committed before it
        m = pb.CommitStepRequest(job=job, spec=spec_to_proto(spec), run=run, parent=parent, resumed=resumed, mode=mode,
                                 batch=batch, step=before, start=start, stop=stop, quorum=quorum,
                                 participants=participants)
        r = self._call("commit_step", lambda: self.stub.CommitStep(m, timeout=self.call_timeout if timeout is None
                                                                    else timeout))
        return bool(r.recorded)

    def checkpoint(self, job: str, step: int | None) -> tuple[Spec, CheckpointRecord]:
        """The job's spec and the checkpoint it recorded at training step `step`, or its latest
        record for None (NotFound if none)."""
        req = pb.GetCheckpointRequest(job=job, step=step or 0, latest=step is None)
        r = self._call("get_checkpoint", lambda: self.stub.GetCheckpoint(req, timeout=self.call_timeout))
        return spec_from_proto(r.spec), record_from_proto(r.record)

    def close(self) -> None:
        """Closes the channel: calls in flight end, and no call retries any more."""
        self.closed = True
        self.channel.close()
        for old in self._old:
            old.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
