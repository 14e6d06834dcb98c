"""The gRPC face of the coordinator: a thin servicer, one error table, and the server's life cycle."""

from __future__ import annotations

import bisect
import logging
import signal
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from croupier.core import errors as E
from croupier.core.amend import KINDS
from croupier.core.api import JoinRequest, JoinResult
from croupier.core.ftsteps import CommittedStep
from croupier.core.wire import (
    SERVICE,
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
from croupier.server._auth import Authorizer, Credential, allow
from croupier.server._coordinator import Coordinator
from croupier.server._grpc import SERVER_OPTIONS
from croupier.server._metrics import Metrics
from croupier.server._options import ServerOptions
from croupier.server._store import Store
from croupier.server._stores import open_store
from croupier.v1 import coordinator_pb2 as pb

log = logging.getLogger("croupier.server")

M = TypeVar("M", bound=Message)


def _abort(context: grpc.ServicerContext, err: E.CroupierError) -> None:
    """The one place a call fails: the error's status (``croupier.core.errors``), its message as details."""
    context.abort(grpc.StatusCode[err.code], str(err))


def _parse(kind: type[M], raw: bytes) -> M:
    try:
        return kind.FromString(raw)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise E.InvalidArgument(f"request is not a valid {kind.DESCRIPTOR.full_name} message: {e}") from None


def _join_response(r: JoinResult) -> pb.JoinResponse:
    m = pb.JoinResponse(generation=r.generation, world=r.world, started=r.start is not None, waiting_for=list(r.waiting_for),
                        waiting=r.waiting_count)
    if r.start is not None:
        m.start.CopyFrom(cursor_to_proto(r.start))
        m.amendments.extend(amendment_to_proto(a) for a in r.amendments)
    return m


def _join_reply(r: JoinResult, req: JoinRequest) -> pb.JoinResponse:
    """A join's answer: with the job's spec when the rank sent another form of it (its sources grown)."""
    m = _join_response(r)
    if r.spec is not None and r.spec != req.spec:
        m.spec.CopyFrom(spec_to_proto(r.spec))
    return m


#: The most jobs one ListJobs page names.
MAX_PAGE = 10_000
#: A join refused for a limit is answered after this long, up to _HELD_REFUSALS at a time.
_HOLD_REFUSAL_S, _HELD_REFUSALS = 0.25, 16
#: The coordinator's RPCs, as the servicer names its methods.
RPCS = ("Join", "Lease", "Grant", "GetJob", "Report", "GetCheckpoint", "ListJobs", "Amend", "GetLedger", "CommitStep")


class CoordinatorServicer:
    """Each RPC converts the message, calls the core, converts back."""

    def __init__(self, core: Coordinator, auth: Authorizer | None = None, options: ServerOptions | None = None) -> None:
        self.core = core
        self.auth = auth
        self.options = options or ServerOptions()
        self._joins = threading.BoundedSemaphore(self.options.max_concurrent_joins)
        self._held = threading.BoundedSemaphore(_HELD_REFUSALS)
        self.closing = threading.Event()

    def _caller(self, context: grpc.ServicerContext) -> Credential | None:
        """The caller's credential (None when this server takes calls without one); before any parsing."""
        return None if self.auth is None else self.auth.identify(context)

    def Join(self, raw: bytes, context: grpc.ServicerContext) -> pb.JoinResponse:
        try:
            return self._join(raw, context)
        except E.ResourceExhausted:
            # NOTE: a caller past a limit usually asks again at once; holding its answer back a
            # little (a few at a time, so that the held ones never take the serving threads)
            # keeps a flood of them from taking the CPU from the jobs that train.
            if self._held.acquire(blocking=False):
                try:
                    self.closing.wait(_HOLD_REFUSAL_S)
                finally:
                    self._held.release()
            raise

    def _join(self, raw: bytes, context: grpc.ServicerContext) -> pb.JoinResponse:
        who = self._caller(context)
        m = _parse(pb.JoinRequest, raw)
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
        # NOTE: the limit is on joins that wait (each holds a serving thread): the join itself is
        # decided and journaled first, so a rank refused here has joined all the same, and the
        # generation starts once the last rank has, whoever holds the waiting places.
        result = self.core.join(req, 0.0)
        if result.start is not None or m.wait_ms == 0:
            return _join_reply(result, req)
        if not self._joins.acquire(blocking=False):
            raise E.ResourceExhausted(f"rank {m.rank} joined, but {self.options.max_concurrent_joins} joins are waiting, "
                                      "this coordinator's limit (croupier serve --max-concurrent-joins); ask again")
        try:
            return _join_reply(self.core.join(req, m.wait_ms / 1000.0), req)
        finally:
            self._joins.release()

    def Lease(self, raw: bytes, context: grpc.ServicerContext) -> pb.LeaseResponse:
        who = self._caller(context)
        m = _parse(pb.LeaseRequest, raw)
        _allow(who, "Lease", m.job)
        lease = self.core.lease(m.job, m.generation, m.rank, m.epoch, m.first_batch, m.count, _progress(m))
        data, itemsize = pack_indices(lease.indices, lease.n)
        return pb.LeaseResponse(indices=data, sizes=lease.sizes, itemsize=itemsize,
                                end_of_epoch=lease.end_of_epoch, epoch_samples=lease.epoch_samples)

    def Grant(self, raw: bytes, context: grpc.ServicerContext) -> pb.GrantResponse:
        who = self._caller(context)
        m = _parse(pb.GrantRequest, raw)
        _allow(who, "Grant", m.job)
        g = self.core.grant(m.job, m.generation, m.rank, m.epoch, m.first_batch, m.count, _progress(m))
        return pb.GrantResponse(batches=g.batches, last_size=g.last_size, end_of_epoch=g.end_of_epoch,
                                epoch_samples=g.epoch_samples, dealt=pack_runs(g.runs))

    def GetJob(self, raw: bytes, context: grpc.ServicerContext) -> pb.GetJobResponse:
        who = self._caller(context)
        m = _parse(pb.GetJobRequest, raw)
        _allow(who, "GetJob", m.job)
        st = self.core.job(m.job)
        j = _join_response(st.result)
        out = pb.GetJobResponse(spec=spec_to_proto(st.spec), generation=j.generation, world=j.world,
                                started=j.started, waiting_for=j.waiting_for, waiting=j.waiting)
        if j.HasField("start"):
            out.start.CopyFrom(j.start)
        out.ranks.extend(pb.RankCursor(rank=c.rank, epoch=c.epoch, batches=c.batches, batches_in_epoch=c.batches_in_epoch,
                                       reported_unix_ms=c.reported_ms) for c in st.ranks)
        out.checkpoints.extend(record_to_proto(r) for r in st.checkpoints)
        out.amendments.extend(amendment_to_proto(a) for a in st.amendments)
        return out

    def Amend(self, raw: bytes, context: grpc.ServicerContext) -> pb.AmendResponse:
        who = self._caller(context)
        m = _parse(pb.AmendRequest, raw)
        _allow(who, "Amend", m.job)
        if m.kind not in KINDS:
            raise E.InvalidArgument(f"amendment kind must be one of {', '.join(map(repr, KINDS))} (got {m.kind!r})")
        a = self.core.amend(m.job, m.kind, tuple(m.values))
        return pb.AmendResponse(amendment=amendment_to_proto(a))

    def Report(self, raw: bytes, context: grpc.ServicerContext) -> pb.ReportResponse:
        who = self._caller(context)
        m = _parse(pb.ReportRequest, raw)
        _allow(who, "Report", m.job)
        if not m.HasField("progress"):
            raise E.InvalidArgument("a report needs the rank's progress")
        checkpoint = checkpoint_from_proto(m.checkpoint) if m.HasField("checkpoint") else None
        cursor = self.core.report(m.job, m.generation, m.rank, m.progress.epoch, m.progress.batches, checkpoint,
                                  lockstep=not m.own, items=items_from_proto(m.checkpoint) if checkpoint else None)
        out = pb.ReportResponse()
        if cursor is not None:
            out.cursor.CopyFrom(cursor_to_proto(cursor))
        return out

    def GetCheckpoint(self, raw: bytes, context: grpc.ServicerContext) -> pb.GetCheckpointResponse:
        who = self._caller(context)
        m = _parse(pb.GetCheckpointRequest, raw)
        _allow(who, "GetCheckpoint", m.job)
        spec, record = self.core.checkpoint(m.job, None if m.latest else m.step)
        return pb.GetCheckpointResponse(spec=spec_to_proto(spec), record=record_to_proto(record))


    def GetLedger(self, raw: bytes, context: grpc.ServicerContext) -> pb.GetLedgerResponse:
        who = self._caller(context)
        m = _parse(pb.GetLedgerRequest, raw)
        _allow(who, "GetLedger", m.job)
        spec, segments, steps = self.core.ledger(m.job)
        return pb.GetLedgerResponse(spec=spec_to_proto(spec), segments=segments, steps=steps)

    def CommitStep(self, raw: bytes, context: grpc.ServicerContext) -> pb.CommitStepResponse:
        who = self._caller(context)
        m = _parse(pb.CommitStepRequest, raw)
        _allow(who, "CommitStep", m.job)
        if not m.HasField("spec"):
            raise E.InvalidArgument("a step report needs the job's spec")
        if m.stop < m.start:
            raise E.InvalidArgument(f"a step report's span [{m.start}, {m.stop}) is empty or reversed")
        step = CommittedStep(m.step, m.start, m.stop, m.quorum, m.participants)
        new = self.core.commit_step(m.job, spec_from_proto(m.spec), m.run, m.parent, m.resumed, m.mode, m.batch, step)
        return pb.CommitStepResponse(recorded=new)

    def ListJobs(self, raw: bytes, context: grpc.ServicerContext) -> pb.ListJobsResponse:
        who = self._caller(context)
        m = _parse(pb.ListJobsRequest, raw)
        _allow(who, "ListJobs", None)
        if m.page_size > MAX_PAGE:
            raise E.InvalidArgument(f"page_size must be at most {MAX_PAGE} (got page_size={m.page_size})")
        names = [j for j in self.core.jobs() if who is None or who.reads(j)]  # sorted
        first = bisect.bisect_right(names, m.page_token) if m.page_token else 0
        page = names[first:first + m.page_size] if m.page_size else names[first:]
        more = bool(page) and first + len(page) < len(names)
        return pb.ListJobsResponse(jobs=page, next_page_token=page[-1] if more else "", total=len(names))


def _allow(who: Credential | None, method: str, job: str | None) -> None:
    if who is not None:
        allow(who, method, job)


def _progress(m: pb.LeaseRequest | pb.GrantRequest) -> tuple[int, int] | None:
    return (m.progress.epoch, m.progress.batches) if m.HasField("progress") else None


def _handler(fn: Callable[[bytes, grpc.ServicerContext], Message], max_request_bytes: int) -> grpc.RpcMethodHandler[Any, Any]:
    """The gRPC handler of one RPC: the request's size checked, `fn` called on its bytes, croupier's errors
    turned into their status.

    NOTE: a request over `max_request_bytes` is RESOURCE_EXHAUSTED, not INVALID_ARGUMENT: it is
    well formed and would be served by a coordinator with a higher ``--max-request-bytes``, so it
    hits this coordinator's limit the way a join over ``--max-world`` does (and the status is the
    one gRPC's own size check gives, so a client sees one code for both). The client does not
    retry it: only ``--max-concurrent-joins`` passes with time.
    """

    def call(raw: bytes, context: grpc.ServicerContext) -> Message:
        try:
            if len(raw) > max_request_bytes:
                raise E.ResourceExhausted(
                    f"a request of {len(raw)} bytes is over this coordinator's limit of {max_request_bytes} bytes "
                    f"(croupier serve --max-request-bytes {max_request_bytes}; a join carries 8 bytes a sample when "
                    "its spec has lengths)"
                )
            return fn(raw, context)
        except E.CroupierError as err:
            _abort(context, err)
            raise  # unreachable: abort raises
    # Requests arrive as raw bytes so that a malformed one is INVALID_ARGUMENT, not INTERNAL.
    return grpc.unary_unary_rpc_method_handler(call, request_deserializer=None,
                                               response_serializer=lambda m: m.SerializeToString())


def _grpc_receive_limit(max_request_bytes: int) -> int:
    """gRPC's receive limit for a coordinator that accepts `max_request_bytes`: twice it (at least 1 MiB
    more), within what a signed 32-bit length holds."""
    return min(max(2 * max_request_bytes, max_request_bytes + (1 << 20)), (1 << 31) - 1)


class Server:
    """A running coordinator: gRPC server, health service, reflection, and its core."""

    def __init__(self, store_url: str | Store, host: str = "127.0.0.1", port: int = 0, max_workers: int = 128,
                 options: ServerOptions | None = None, auth: Authorizer | None = None) -> None:
        """Opens the store, recovers the coordinator from it and binds the port (``start`` serves).

        Args:
            store_url: The store's URL (see ``open_store``), or a store already open; the server
                owns either from now on: ``stop`` closes it.
            host: Interface to listen on.
            port: Port to listen on; 0 picks a free one (see :attr:`port`).
            max_workers: Threads serving calls.
            options: TLS, credentials, limits, metrics and logs (default: none of them, no limits
                beyond the defaults of :class:`ServerOptions`).
            auth: Credentials in force, for a server that has no credentials file (the embedded
                coordinator of a job on several hosts); ``options.auth_file`` otherwise.

        Raises:
            ValueError: a credentials file that does not parse.
            OSError: a TLS or credentials file that cannot be read; a port that cannot be bound.
        """
        self.options = o = options or ServerOptions()
        self.auth = auth if auth is not None else Authorizer(path=o.auth_file) if o.auth_file else None
        tls = _tls_credentials(o)  # read before anything starts: a bad file fails here
        self.core = Coordinator(open_store(store_url) if isinstance(store_url, str) else store_url, max_jobs=o.max_jobs,
                                snapshot_every=o.snapshot_every, max_staleness_s=o.max_staleness_ms / 1000)
        self._servicer = servicer = CoordinatorServicer(self.core, self.auth, o)
        self._pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="croupier-rpc")
        # Every call passes these in order: the first sees it first (and its outcome last).
        interceptors: list[grpc.ServerInterceptor] = []
        self.metrics = Metrics(self.core, RPCS, o.metrics_host, o.metrics_port) if o.metrics_port is not None else None
        # first: it times and counts every call whose request it reads, and counts those it never could read
        if self.metrics is not None:
            interceptors.append(self.metrics.interceptor)
        # NOTE: gRPC's own size check refuses with a message that names no option, before any of
        # croupier's code (the metrics included) sees the call. So gRPC lets through up to twice the
        # limit, and the handler refuses what is over it by name, counted as RESOURCE_EXHAUSTED; a
        # request past twice the limit is still refused by gRPC itself, unread (the metrics count
        # it apart: croupier_rpc_refused_unread_total).
        grpc_options = [kv for kv in SERVER_OPTIONS if kv[0] != "grpc.max_receive_message_length"]
        grpc_options.append(("grpc.max_receive_message_length", _grpc_receive_limit(o.max_request_bytes)))
        self._grpc = grpc.server(self._pool, options=grpc_options, interceptors=interceptors)
        handlers = {name: _handler(getattr(servicer, name), o.max_request_bytes) for name in RPCS}
        self._grpc.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection(
            (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), self._grpc
        )
        where = f"{host}:{port}"
        bound = self._grpc.add_insecure_port(where) if tls is None else self._grpc.add_secure_port(where, tls)
        if bound == 0:
            self.core.close()
            raise OSError(f"could not bind {host}:{port}")
        self.host, self.port = host, bound
        self._stopped = threading.Event()

    @property
    def address(self) -> str:
        """HOST:PORT the server listens on."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def serving(self) -> bool:
        """Started or not, it has not been stopped."""
        return not self._stopped.is_set()

    @property
    def metrics_address(self) -> str | None:
        """HOST:PORT of the HTTP endpoint (``/metrics``, the status page) while it serves; None without one."""
        return None if self.metrics is None else self.metrics.address

    def start(self) -> Server:
        if self.metrics is not None:
            self.metrics.start()
        self._grpc.start()
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self, grace: float = 5.0) -> None:
        """Stops accepting calls (health NOT_SERVING), lets calls in flight finish within `grace`, closes the store."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._servicer.closing.set()
        self.health.enter_graceful_shutdown()
        self._grpc.stop(grace).wait(grace + 5.0)  # bounded: a server whose serving thread died never signals
        self._pool.shutdown(wait=False)
        if self.metrics is not None:
            self.metrics.stop()
        self.core.close()

    def wait(self) -> None:
        self._grpc.wait_for_termination()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop(grace=1.0)


def _tls_credentials(o: ServerOptions) -> grpc.ServerCredentials | None:
    """The server's TLS settings from its PEM files, or None for plaintext."""
    if o.tls_cert is None or o.tls_key is None:
        return None

    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    ca = read(o.tls_client_ca) if o.tls_client_ca else None
    return grpc.ssl_server_credentials([(read(o.tls_key), read(o.tls_cert))], root_certificates=ca,
                                       require_client_auth=ca is not None)


def serve(host: str, port: int, store: str, grace: float = 5.0, options: ServerOptions | None = None) -> int:
    """`croupier serve`: runs a coordinator until SIGTERM or SIGINT; returns the exit code."""
    server = Server(store, host, port, options=options).start()
    print(f"listening on {server.address}", flush=True)
    if server.metrics_address is not None:
        print(f"metrics and status page on http://{server.metrics_address}/", flush=True)
    done = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        log.info("signal %d: shutting down (grace %.1f s)", signum, grace)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    if server.auth is not None:
        signal.signal(signal.SIGHUP, lambda signum, frame: server.auth.reload() if server.auth else None)
    signal.signal(signal.SIGINT, on_signal)
    while not done.wait(timeout=1.0):
        if server.core.failed:
            print(f"croupier: error: {server.core.failed}", file=sys.stderr, flush=True)
            server.stop(grace)
            return 1
    server.stop(grace)
    return 0
