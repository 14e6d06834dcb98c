"""The gRPC face of the coordinator: its server's life cycle on grpc.aio (the calls themselves: ``croupier.server._aio``)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from croupier.core.wire import SERVICE
from croupier.server._aio import Serving
from croupier.server._auth import Authorizer
from croupier.server._coordinator import Coordinator
from croupier.server._grpc import SERVER_OPTIONS
from croupier.server._http import tls_context
from croupier.server._metrics import Metrics
from croupier.server._options import ServerOptions
from croupier.server._rpcs import RPCS
from croupier.server._store import Store
from croupier.server._stores import open_store

log = logging.getLogger("croupier.server")

T = TypeVar("T")

#: gRPC's own queue of calls not yet taken by the server: past it gRPC cancels calls (1,000 by default). Raised
#: out of the way: croupier's admission (``--max-calls``) refuses first, by name and with a retry hint.
_PENDING = 1 << 20


def _grpc_receive_limit(max_request_bytes: int) -> int:
    """gRPC's receive limit for a coordinator that accepts `max_request_bytes`: twice it (at least 1 MiB
    more), within what a signed 32-bit length holds."""
    return min(max(2 * max_request_bytes, max_request_bytes + (1 << 20)), (1 << 31) - 1)


class Health:
    """The health service's status, set from any thread (the service itself runs on the server's event loop)."""

    def __init__(self, server: Server, servicer: health.aio.HealthServicer) -> None:
        self._server, self.servicer = server, servicer

    def set(self, service: str, status: Any) -> None:
        self._server.on_loop(self.servicer.set(service, status))

    def enter_graceful_shutdown(self) -> None:
        self._server.on_loop(self.servicer.enter_graceful_shutdown())


class Server:
    """A running coordinator: gRPC server (grpc.aio, on an event loop thread of its own), health service,
    reflection, and its core."""

    def __init__(self, store_url: str | Store, host: str = "127.0.0.1", port: int = 0, max_workers: int = 32,
                 options: ServerOptions | None = None, auth: Authorizer | None = None) -> None:
        """Opens the store, recovers the coordinator from it and binds the port (``start`` serves).

        Args:
            store_url: The store's URL (see ``open_store``), or a store already open; the server
                owns either from now on: ``stop`` closes it.
            host: Interface to listen on.
            port: Port to listen on; 0 picks a free one (see :attr:`port`).
            max_workers: Threads running the core's work (a decision, a durable wait, a shared
                store's round trips); a call waiting for its generation holds none.
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
        http_tls = None if o.metrics_port is None or o.tls_cert is None or o.tls_key is None \
            else tls_context(o.tls_cert, o.tls_key, o.tls_client_ca)
        self.core = Coordinator(open_store(store_url) if isinstance(store_url, str) else store_url, max_jobs=o.max_jobs,
                                snapshot_every=o.snapshot_every, max_staleness_s=o.max_staleness_ms / 1000)
        self.metrics = None if o.metrics_port is None else Metrics(self.core, RPCS, o.metrics_host, o.metrics_port,
                                                                   self.auth, http_tls)
        m = self.metrics
        self.service = Serving(self.core, o, self.auth, max_workers, None if m is None else m.on_refuse)
        if m is not None:
            m.watch_admission(self.service.admission)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="croupier-aio", daemon=True)
        self._thread.start()
        self._stopped = threading.Event()
        try:
            self.host, self.port = host, self.on_loop(self._build(host, port, tls))
        except BaseException:
            self._close_loop()
            self.core.close()
            raise

    async def _build(self, host: str, port: int, tls: grpc.ServerCredentials | None) -> int:
        o, m = self.options, self.metrics
        # NOTE: gRPC's own size check refuses with a message that names no option, before any of
        # croupier's code (the metrics included) sees the call. So gRPC lets through up to twice the
        # limit, and the handler refuses what is over it by name, counted as RESOURCE_EXHAUSTED; a
        # request past twice the limit is still refused by gRPC itself, unread (the metrics count
        # it apart: croupier_rpc_refused_unread_total).
        grpc_options = [kv for kv in SERVER_OPTIONS if kv[0] != "grpc.max_receive_message_length"]
        grpc_options += [("grpc.max_receive_message_length", _grpc_receive_limit(o.max_request_bytes)),
                         ("grpc.server.max_pending_requests", _PENDING),
                         ("grpc.server.max_pending_requests_hard_limit", _PENDING)]
        self._grpc = grpc.aio.server(options=grpc_options)
        handlers = {name: self.service.handler(name, None if m is None else m.observe, None if m is None else m.unread_call)
                    for name in RPCS}
        self._grpc.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, self._grpc)
        self.health = Health(self, servicer)
        reflection.enable_server_reflection(
            (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), self._grpc
        )
        where = f"{host}:{port}"
        bound = self._grpc.add_insecure_port(where) if tls is None else self._grpc.add_secure_port(where, tls)
        if bound == 0:
            raise OSError(f"could not bind {host}:{port}")
        return bound

    def on_loop(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs `coro` on the server's event loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10.0)
        if not self._thread.is_alive():
            self._loop.close()
        self.service.executor.shutdown(wait=False, cancel_futures=True)

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
        self.on_loop(self._grpc.start())
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self, grace: float = 5.0) -> None:
        """Stops accepting calls (health NOT_SERVING), answers the waiting joins, lets calls in flight finish
        within `grace`, closes the store."""
        if self._stopped.is_set():
            return
        self._stopped.set()

        async def stop() -> None:
            await self.health.servicer.enter_graceful_shutdown()
            self.service.release_waits()
            await self._grpc.stop(grace)

        try:
            self.on_loop(stop(), timeout=grace + 5.0)  # bounded: a loop that hangs must not hang the process
        except TimeoutError:
            log.warning("the gRPC server did not stop within %.1f s", grace + 5.0)
        self._close_loop()
        if self.metrics is not None:
            self.metrics.stop()
        self.core.close()

    def wait(self) -> None:
        """Until the server stops."""
        self._stopped.wait()

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
        scheme = "http" if server.options.tls_cert is None else "https"
        print(f"metrics and status page on {scheme}://{server.metrics_address}/", flush=True)
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
