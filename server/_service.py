"""The gRPC face of the coordinator: a thin servicer, one error table, and the server's life cycle."""

from __future__ import annotations

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
from croupier.core.api import JoinRequest, JoinResult
from croupier.core.wire import (
    SERVER_OPTIONS,
    SERVICE,
    checkpoint_from_proto,
    cursor_from_proto,
    cursor_to_proto,
    pack_indices,
    record_to_proto,
    spec_from_proto,
    spec_to_proto,
)
from croupier.server._coordinator import Coordinator
from croupier.server._options import ServerOptions
from croupier.server._store import Store, open_store
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
    m = pb.JoinResponse(generation=r.generation, world=r.world, started=r.start is not None, waiting_for=list(r.waiting_for))
    if r.start is not None:
        m.start.CopyFrom(cursor_to_proto(r.start))
    return m


#: The coordinator's RPCs, as the servicer names its methods.
RPCS = ("Join", "Lease", "Grant", "GetJob", "Report", "GetCheckpoint", "ListJobs")


class CoordinatorServicer:
    """Each RPC converts the message, calls the core, converts back."""

    def __init__(self, core: Coordinator) -> None:
        self.core = core

    def Join(self, raw: bytes, context: grpc.ServicerContext) -> pb.JoinResponse:
        m = _parse(pb.JoinRequest, raw)
        if not m.request_id or len(m.request_id) > 128:
            raise E.InvalidArgument(f"request_id must be a non-empty string of at most 128 characters (got {m.request_id!r})")
        if not m.HasField("spec"):
            raise E.InvalidArgument("join needs the job's spec")
        req = JoinRequest(
            job=m.job, spec=spec_from_proto(m.spec), token=m.token, world=m.world, rank=m.rank,
            resume=cursor_from_proto(m.resume) if m.HasField("resume") else None,
            epoch=m.epoch if m.HasField("epoch") else None,
        )
        log.debug("join %s: job=%s token=%s rank=%d/%d", m.request_id, m.job, m.token, m.rank, m.world)
        return _join_response(self.core.join(req, m.wait_ms / 1000.0))

    def Lease(self, raw: bytes, context: grpc.ServicerContext) -> pb.LeaseResponse:
        m = _parse(pb.LeaseRequest, raw)
        lease = self.core.lease(m.job, m.generation, m.rank, m.epoch, m.first_batch, m.count, _progress(m))
        data, itemsize = pack_indices(lease.indices, lease.n)
        return pb.LeaseResponse(indices=data, sizes=lease.sizes, itemsize=itemsize,
                                end_of_epoch=lease.end_of_epoch, epoch_samples=lease.epoch_samples)

    def Grant(self, raw: bytes, context: grpc.ServicerContext) -> pb.GrantResponse:
        m = _parse(pb.GrantRequest, raw)
        g = self.core.grant(m.job, m.generation, m.rank, m.epoch, m.first_batch, m.count, _progress(m))
        return pb.GrantResponse(batches=g.batches, last_size=g.last_size, end_of_epoch=g.end_of_epoch,
                                epoch_samples=g.epoch_samples)

    def GetJob(self, raw: bytes, context: grpc.ServicerContext) -> pb.GetJobResponse:
        m = _parse(pb.GetJobRequest, raw)
        st = self.core.job(m.job)
        j = _join_response(st.result)
        out = pb.GetJobResponse(spec=spec_to_proto(st.spec), generation=j.generation, world=j.world,
                                started=j.started, waiting_for=j.waiting_for)
        if j.HasField("start"):
            out.start.CopyFrom(j.start)
        out.ranks.extend(pb.RankCursor(rank=c.rank, epoch=c.epoch, batches=c.batches, batches_in_epoch=c.batches_in_epoch,
                                       reported_unix_ms=c.reported_ms) for c in st.ranks)
        out.checkpoints.extend(record_to_proto(r) for r in st.checkpoints)
        return out

    def Report(self, raw: bytes, context: grpc.ServicerContext) -> pb.ReportResponse:
        m = _parse(pb.ReportRequest, raw)
        if not m.HasField("progress"):
            raise E.InvalidArgument("a report needs the rank's progress")
        checkpoint = None
        if m.HasField("checkpoint"):
            if not m.checkpoint.HasField("cursor"):
                raise E.InvalidArgument("a reported checkpoint needs its cursor")
            checkpoint = checkpoint_from_proto(m.checkpoint)
        self.core.report(m.job, m.generation, m.rank, m.progress.epoch, m.progress.batches, checkpoint)
        return pb.ReportResponse()

    def GetCheckpoint(self, raw: bytes, context: grpc.ServicerContext) -> pb.GetCheckpointResponse:
        m = _parse(pb.GetCheckpointRequest, raw)
        spec, record = self.core.checkpoint(m.job, m.step)
        return pb.GetCheckpointResponse(spec=spec_to_proto(spec), record=record_to_proto(record))


    def ListJobs(self, raw: bytes, context: grpc.ServicerContext) -> pb.ListJobsResponse:
        _parse(pb.ListJobsRequest, raw)
        return pb.ListJobsResponse(jobs=self.core.jobs())


def _progress(m: pb.LeaseRequest | pb.GrantRequest) -> tuple[int, int] | None:
    return (m.progress.epoch, m.progress.batches) if m.HasField("progress") else None


def _handler(fn: Callable[[bytes, grpc.ServicerContext], Message]) -> grpc.RpcMethodHandler[Any, Any]:
    def call(raw: bytes, context: grpc.ServicerContext) -> Message:
        try:
            return fn(raw, context)
        except E.CroupierError as err:
            _abort(context, err)
            raise  # unreachable: abort raises
    # Requests arrive as raw bytes so that a malformed one is INVALID_ARGUMENT, not INTERNAL.
    return grpc.unary_unary_rpc_method_handler(call, request_deserializer=None,
                                               response_serializer=lambda m: m.SerializeToString())


class Server:
    """A running coordinator: gRPC server, health service, reflection, and its core."""

    def __init__(self, store_url: str | Store, host: str = "127.0.0.1", port: int = 0, max_workers: int = 128,
                 options: ServerOptions | None = None) -> None:
        """Opens the store, recovers the coordinator from it and binds the port (``start`` serves).

        Args:
            store_url: The store's URL (see ``open_store``), or a store already open; the server
                owns either from now on: ``stop`` closes it.
            host: Interface to listen on.
            port: Port to listen on; 0 picks a free one (see :attr:`port`).
            max_workers: Threads serving calls.
            options: TLS, credentials, limits, metrics and logs (default: none of them, no limits
                beyond the defaults of :class:`ServerOptions`).
        """
        self.options = options or ServerOptions()
        self.core = Coordinator(open_store(store_url) if isinstance(store_url, str) else store_url)
        servicer = CoordinatorServicer(self.core)
        self._pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="croupier-rpc")
        # Every call passes these in order: the first sees it first (and its outcome last).
        interceptors: list[grpc.ServerInterceptor] = []
        self._grpc = grpc.server(self._pool, options=SERVER_OPTIONS, interceptors=interceptors)
        handlers = {name: _handler(getattr(servicer, name)) for name in RPCS}
        self._grpc.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection(
            (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), self._grpc
        )
        bound = self._grpc.add_insecure_port(f"{host}:{port}")
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

    def start(self) -> Server:
        self._grpc.start()
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self, grace: float = 5.0) -> None:
        """Stops accepting calls (health NOT_SERVING), lets calls in flight finish within `grace`, closes the store."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        self._grpc.stop(grace).wait(grace + 5.0)  # bounded: a server whose serving thread died never signals
        self._pool.shutdown(wait=False)
        self.core.close()

    def wait(self) -> None:
        self._grpc.wait_for_termination()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop(grace=1.0)


def serve(host: str, port: int, store: str, grace: float = 5.0, options: ServerOptions | None = None) -> int:
    """`croupier serve`: runs a coordinator until SIGTERM or SIGINT; returns the exit code."""
    server = Server(store, host, port, options=options).start()
    print(f"listening on {server.address}", flush=True)
    done = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        log.info("signal %d: shutting down (grace %.1f s)", signum, grace)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not done.wait(timeout=1.0):
        if server.core.failed:
            print(f"croupier: error: {server.core.failed}", file=sys.stderr, flush=True)
            server.stop(grace)
            return 1
    server.stop(grace)
    return 0
