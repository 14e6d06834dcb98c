"""The read-only HTTP endpoint next to the gRPC port: ``/metrics``, the status page and its JSON, ``/healthz``.

Behind the same door as the gRPC side: given the server's credentials (``croupier.server._auth``), every
endpoint that shows a job's data wants ``Authorization: Bearer <secret>`` and the role of the RPC that
shows the same data (:data:`SHOWS`), for the job it names; given the server's certificate, it speaks
TLS only (mutual TLS with a client CA). ``/`` (the page, which holds no data) and ``/healthz`` (probes)
need no credential.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from croupier.core import api
from croupier.core.checks import check_int_text
from croupier.core.errors import CroupierError
from croupier.core.ledger import Ledger
from croupier.server._auth import NEEDS, ROLES, Authorizer, Credential
from croupier.server._ledger_view import STEP_SAMPLES, ledger_json, mix, step_json
from croupier.server._page import PAGE, PAGE_CSP
from croupier.server._standing import JobView, view_json

log = logging.getLogger("croupier.server")

#: Whether the caller may read a job (None: every job, as when no credentials are configured).
Reads = Callable[[str], bool] | None
#: A page of the jobs the caller may read: (after, limit, reads) -> (the page's jobs, how many such jobs there are).
Views = Callable[[str, int, Reads], tuple[list[JobView], int]]
#: The Prometheus exposition, with the series of the jobs the caller may read.
Exposition = Callable[[Reads], bytes]
#: A job's step ledger as it stands now (raises the coordinator's errors: NotFound for an unknown job).
Ledgers = Callable[[str], Ledger]

#: Jobs one ``/api/jobs`` answer names unless asked (``?limit=``), and at most.
PAGE_JOBS, MAX_PAGE_JOBS = 50, 10_000
#: The Prometheus text format.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TEXT = "text/plain; charset=utf-8"
#: The HTTP status of each domain error a ledger question may raise (anything else: 500).
ERROR_STATUS = {"INVALID_ARGUMENT": HTTPStatus.BAD_REQUEST, "OUT_OF_RANGE": HTTPStatus.BAD_REQUEST,
                "NOT_FOUND": HTTPStatus.NOT_FOUND, "FAILED_PRECONDITION": HTTPStatus.CONFLICT,
                "UNAVAILABLE": HTTPStatus.SERVICE_UNAVAILABLE}
#: The RPC whose data each endpoint shows: with credentials configured, the endpoint needs that RPC's role
#: (``croupier.server._auth.NEEDS``) for the job named by ``?job=``, or, with no job, shows only the jobs the
#: credential may read (as ListJobs lists them). Every other path needs no credential: ``/`` holds no data
#: (its script asks for the rest) and ``/healthz`` answers probes.
SHOWS = {"/metrics": "GetJob", "/api/jobs": "GetJob", "/api/ledger": "GetLedger", "/api/mix": "GetLedger",
         "/api/step": "GetLedger"}
#: The endpoints about one job (``?job=``).
ABOUT_A_JOB = ("/api/ledger", "/api/mix", "/api/step")
_BEARER = "bearer"


def tls_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    """A server TLS context of the server's PEM files (the gRPC port's): TLS 1.2 or later; with
    `client_ca`, a client must present a certificate it signed.

    Raises:
        OSError: a file that cannot be read; ssl.SSLError: one that does not hold what it should.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if client_ca is not None:
        ctx.load_verify_locations(client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class Endpoint:
    """An HTTP server in a daemon thread that only reads: every answer is computed from the callables it is given."""

    def __init__(self, host: str, port: int, metrics: Exposition, views: Views,
                 failed: Callable[[], str | None], ledgers: Ledgers, auth: Authorizer | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        """Binds `host`:`port` (0: a free port) and serves until :meth:`stop`.

        Args:
            host: Interface to listen on (an IPv6 address with or without brackets).
            port: Port to listen on; 0 picks a free one.
            metrics: The Prometheus exposition of the server's registry.
            views: A page of jobs, summarised, from the name after which it starts and its length, and
                how many jobs there are (``/api/jobs`` and the status page).
            failed: Why the coordinator stopped acknowledging, or None (``/healthz``).
            ledgers: A job's step ledger (``/api/ledger``, ``/api/mix``, ``/api/step``: the status page's timeline).
            auth: The server's credentials: every endpoint of :data:`SHOWS` then wants one (None: open).
            tls: Serve HTTPS only, with this context (:func:`tls_context`); None: plain HTTP.

        Raises:
            OSError: If the address cannot be bound; the message names it.
        """
        host = host.strip("[]")
        cls = _Server6 if ":" in host else _Server
        try:
            self._httpd = cls((host, port), _handler(metrics, views, failed, ledgers, auth))
        except OSError as e:
            raise OSError(e.errno, f"could not bind the metrics endpoint {host}:{port}: {e.strerror}") from None
        self._httpd.tls = tls
        self.host, self.port = host, int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="croupier-metrics", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """HOST:PORT the endpoint listens on."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def stop(self) -> None:
        """Stops serving and closes the socket (requests in flight finish in their daemon threads)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    tls: ssl.SSLContext | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        # NOTE: the TLS handshake is made here, in the request's own thread: a client that connects and says
        # nothing holds its thread for the timeout, not the loop that accepts the others.
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(10.0)
        try:
            secured = self.tls.wrap_socket(request, server_side=True)  # takes over the socket
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            log.debug("metrics endpoint: TLS handshake with %s failed: %s", client_address, e)
            return
        try:
            super().finish_request(secured, client_address)
        finally:
            self.shutdown_request(secured)


class _Server6(_Server):
    address_family = socket.AF_INET6


@dataclasses.dataclass(frozen=True)
class _Sources:
    """What the endpoint's answers are computed from (see :class:`Endpoint`)."""

    metrics: Exposition
    views: Views
    failed: Callable[[], str | None]
    ledgers: Ledgers
    auth: Authorizer | None
    # NOTE: one ledger question at a time: a realized mix computes up to MIX_WINDOWS x MIX_STEPS steps, and
    # a burst of them (a page open in many tabs) must not take every core from the coordinator's calls.
    asking: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def _handler(metrics: Exposition, views: Views, failed: Callable[[], str | None],
             ledgers: Ledgers, auth: Authorizer | None) -> type[BaseHTTPRequestHandler]:
    """A request handler class bound to one endpoint's sources."""
    return type("Handler", (_Handler,), {"src": _Sources(metrics, views, failed, ledgers, auth)})


class _Handler(BaseHTTPRequestHandler):
    """One request to the endpoint: routed by its path, each answer computed from :attr:`src`."""

    server_version = "croupier"
    src: _Sources  # set by :func:`_handler`'s subclass

    def do_GET(self) -> None:  # the name the http.server protocol calls
        try:
            url = urlsplit(self.path)
            self._get(url.path, parse_qs(url.query))
        except Exception:
            log.exception("metrics endpoint: GET %s failed", self.path)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, TEXT, b"internal error (see the coordinator's log)\n")

    def _get(self, path: str, query: dict[str, list[str]]) -> None:
        src = self.src
        reads: Reads = None
        if src.auth is not None and path in SHOWS:
            who = self._who(src.auth, path, query.get("job", [""])[-1] if path in ABOUT_A_JOB else "")
            if who is None:
                return
            reads = who.reads
        if path == "/metrics":
            self._send(HTTPStatus.OK, METRICS_CONTENT_TYPE, src.metrics(reads))
        elif path == "/":
            self._send(HTTPStatus.OK, "text/html; charset=utf-8", PAGE.encode(), {"Content-Security-Policy": PAGE_CSP})
        elif path == "/api/jobs":
            self._jobs(query, reads)
        elif path == "/api/ledger":
            self._ledger(query, ledger_json)
        elif path == "/api/mix":
            self._ledger(query, mix)
        elif path == "/api/step":
            step, samples = query.get("step", [None])[-1], query.get("samples", [str(STEP_SAMPLES)])[-1]
            self._ledger(query, lambda led: step_json(led, step, samples))
        elif path == "/healthz":
            why = src.failed()
            if why is None:
                self._send(HTTPStatus.OK, TEXT, b"ok\n")
            else:
                self._send(HTTPStatus.SERVICE_UNAVAILABLE, TEXT, f"failed: {why}\n".encode())
        else:
            self._send(HTTPStatus.NOT_FOUND, TEXT, b"not found: try /, /metrics, /api/jobs, /api/ledger?job=, "
                       b"/api/mix?job=, /api/step?job=&step=, /healthz\n")

    def _jobs(self, query: dict[str, list[str]], reads: Reads) -> None:
        """``/api/jobs``: a page of the jobs `reads` may see, and where the next page starts."""
        try:
            after, limit = _page(query)
        except (ValueError, TypeError) as e:
            self._send(HTTPStatus.BAD_REQUEST, TEXT, f"{e}\n".encode())
            return
        now_ms = api.now_ms()
        why = self.src.failed()
        body: dict[str, Any] = {"now_unix_ms": now_ms, "coordinator_failed": why, "jobs": [], "total": 0,
                                "next_after": None}
        if why is None:
            page, total = self.src.views(after, limit, reads)
            body["jobs"] = [view_json(v, now_ms) for v in page]
            body["total"] = total
            # the page's last name: the next page starts after it (None on the last page)
            if page and len(page) == limit:
                body["next_after"] = page[-1].name
        self._send(HTTPStatus.OK, "application/json", json.dumps(body).encode())

    def _who(self, auth: Authorizer, path: str, job: str) -> Credential | None:
        """The caller's credential if it may read `path` (for `job`: "" for none); else None, the refusal sent:
        401 with no credential or one not in force, 403 with one short of the role or the job. Nothing is read."""
        need = NEEDS[SHOWS[path]]
        what = f"{path} needs a credential with role {need!r} or more" + (f" for job {job!r}" if job else "")
        scheme, _, secret = self.headers.get("Authorization", "").strip().partition(" ")
        secret = secret.strip() if scheme.lower() == _BEARER else ""
        cred = auth.known(secret) if secret else None
        if cred is None:
            why = "the credential sent is not one this coordinator knows" if secret else \
                "send the header 'Authorization: Bearer <secret>' (none was sent)"
            self._send(HTTPStatus.UNAUTHORIZED, TEXT, f"{what}: {why}\n".encode(),
                       {"WWW-Authenticate": 'Bearer realm="croupier"'})
            return None
        if not cred.may(need, job or None):
            if ROLES.index(cred.role) < ROLES.index(need):
                why = f"it has role {cred.role!r}"
            else:
                why = f"its jobs are {list(cred.jobs)}"
            self._send(HTTPStatus.FORBIDDEN, TEXT, f"{what}: credential {cred.name!r} may not read it: {why}\n".encode(),
                       {"WWW-Authenticate": 'Bearer realm="croupier", error="insufficient_scope"'})
            return None
        return cred

    def _ledger(self, query: dict[str, list[str]], answer: Callable[[Ledger], dict[str, Any] | None]) -> None:
        """``answer`` of the step ledger of the job named by ``?job=``, as JSON; a domain error as its
        status (:data:`ERROR_STATUS`) with its message."""
        job = query.get("job", [""])[-1]
        if not job:
            self._send(HTTPStatus.BAD_REQUEST, TEXT, f"job= is missing: {self.path.partition('?')[0]}?job=NAME\n".encode())
            return
        try:
            with self.src.asking:
                body = answer(self.src.ledgers(job))
        except CroupierError as e:
            status = ERROR_STATUS.get(e.code, HTTPStatus.INTERNAL_SERVER_ERROR)
            self._send(status, TEXT, f"{e}\n".encode())
            return
        self._send(HTTPStatus.OK, "application/json", json.dumps(body).encode())

    def _send(self, status: HTTPStatus, kind: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics endpoint: %s - %s", self.address_string(), format % args)


def _page(query: dict[str, list[str]]) -> tuple[str, int]:
    """``/api/jobs``'s page from its query: ``after`` (a job name: the page starts after it) and ``limit``."""
    after = query.get("after", [""])[-1]
    limit = check_int_text("limit", query.get("limit", [str(PAGE_JOBS)])[-1], 1, MAX_PAGE_JOBS + 1)
    return after, limit
