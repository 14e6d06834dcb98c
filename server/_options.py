"""A coordinator server's settings beyond its address and store: ``croupier serve``'s flags."""

from __future__ import annotations

import dataclasses

from croupier.core.api import MAX_WORLD
from croupier.core.checks import check_choice, check_int

#: The forms of the server's log lines.
LOG_FORMATS = ("text", "json")


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """Transport security, credentials, limits and observability of one server.

    Attributes:
        tls_cert: PEM certificate chain the server presents; with `tls_key`, the port speaks TLS only
            (and the HTTP endpoint of `metrics_port` HTTPS only, with the same certificate).
        tls_key: PEM private key of `tls_cert`.
        tls_client_ca: PEM CA bundle; when given, a client must present a certificate it signed
            (mutual TLS), or the handshake fails.
        auth_file: Credentials file (see ``croupier.server._auth``); when given, every call must
            carry a credential that grants its job and role, and so does every request to the HTTP
            endpoint but ``/`` and ``/healthz``. Reloaded on SIGHUP and on change.
        max_jobs: Jobs the coordinator holds at most; a join that would register one more is
            RESOURCE_EXHAUSTED.
        max_world: Largest world size a join may name.
        max_request_bytes: Largest request message the server accepts; a larger one is
            RESOURCE_EXHAUSTED with a message naming ``--max-request-bytes`` (counted in the
            metrics), or, past twice the limit, refused by gRPC itself before it is read.
        max_concurrent_joins: Joins waiting at once for their generation's other ranks (a
            waiting join holds no thread: a few KiB each); one more is recorded, then refused the
            wait with RESOURCE_EXHAUSTED and a retry hint.
        max_calls: Calls in progress at once, all jobs together (a join counts until it is
            recorded, not while it waits); one more is refused at once with RESOURCE_EXHAUSTED,
            naming the bound, with a retry hint the client honours (trailing metadata
            ``croupier-retry-after-ms``).
        max_job_calls: The same, for the calls of one job: one job's storm leaves room for the others.
        metrics_port: Port of the HTTP endpoint with ``/metrics`` (Prometheus) and the status
            page; None serves neither, 0 picks a free port.
        metrics_host: Interface of that endpoint.
        log_format: ``"text"`` or ``"json"`` (one object per line, with job, generation and rank
            when the record is about one).
        snapshot_every: Journal records between two snapshots of the whole state: recovery reads
            the last snapshot and replays at most this many records, while each snapshot writes
            every job (fewer, larger snapshots for a coordinator of many jobs).
        max_staleness_ms: Replicas on PostgreSQL: how old (ms) the replica's knowledge of the
            journal's end may be when it answers a grant, a lease or a job's status without asking
            the database (it listens for appends and confirms every third of this); 0 asks the
            database on every such call. Writes (joins, checkpoints, reports) are exact either
            way. No effect on a single coordinator, which is the only writer of its store.
    """

    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_file: str | None = None
    max_jobs: int = 10_000
    max_world: int = MAX_WORLD
    max_request_bytes: int = 64 << 20
    max_concurrent_joins: int = 65_536
    max_calls: int = 32_768
    max_job_calls: int = 24_576
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    log_format: str = "text"
    snapshot_every: int = 1000
    max_staleness_ms: int = 100

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(f"tls_cert and tls_key go together (got tls_cert={self.tls_cert!r}, tls_key={self.tls_key!r})")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError(f"tls_client_ca={self.tls_client_ca!r} needs tls_cert and tls_key (mutual TLS is TLS first)")
        for name in ("max_jobs", "max_request_bytes", "max_concurrent_joins", "max_calls", "max_job_calls",
                     "snapshot_every"):
            check_int(name, getattr(self, name), 1)
        check_int("max_world", self.max_world, 1, MAX_WORLD + 1)
        check_int("max_staleness_ms", self.max_staleness_ms, 0, 60_001)
        if self.metrics_port is not None:
            check_int("metrics_port", self.metrics_port, 0, 65536)
        check_choice("log_format", self.log_format, LOG_FORMATS)
