"""Prometheus metrics of one server: its calls, its journal commits, and its jobs' progress, read at scrape time."""

from __future__ import annotations

import bisect
import ssl
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from croupier.core.errors import CroupierError
from croupier.server._auth import Authorizer
from croupier.server._coordinator import Coordinator
from croupier.server._http import Endpoint
from croupier.server._standing import PER_RANK_MAX_WORLD, JobView, job_view

#: Call latencies: a lease takes about a millisecond, a join waits up to 30 s for its generation.
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Journal commits: one append (an fsync for SQLite) of every event queued meanwhile.
COMMIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """One server's metrics in a registry of its own (several servers may share a process).

    Calls and journal commits are counted as they happen (:attr:`interceptor`,
    :meth:`on_commit`); jobs, generations and progress are read from the coordinator at scrape time.
    """

    def __init__(self, core: Coordinator, rpcs: Iterable[str], host: str, port: int, auth: Authorizer | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        """Registers the metrics and installs :meth:`on_commit` as the coordinator's commit callback.

        Args:
            core: The coordinator whose jobs are reported.
            rpcs: The service's method names; their series exist (at zero) before the first call.
            host: Interface of the HTTP endpoint (:meth:`start`).
            port: Its port; 0 picks a free one.
            auth: The server's credentials, which the endpoint then asks for (see ``croupier.server._http``).
            tls: The endpoint's TLS context (the server's certificate); None serves plain HTTP.
        """
        self.core, self.host, self.port, self.auth, self.tls = core, host, port, auth, tls
        self._endpoint: Endpoint | None = None
        self.registry = CollectorRegistry()
        self.calls = Counter("croupier_rpc_calls_total", "Calls of the croupier.v1.Coordinator service, by method and "
                             "the status code they ended with.", ["method", "code"], registry=self.registry)
        self.latency = Histogram("croupier_rpc_latency_seconds", "Time the server took to answer a call, by method "
                                 "(a join includes its wait for the generation's other ranks).", ["method"],
                                 buckets=RPC_BUCKETS, registry=self.registry)
        self.commit = Histogram("croupier_journal_commit_seconds", "Time of one journal append: the events queued "
                                "since the last one, made durable together.", buckets=COMMIT_BUCKETS, registry=self.registry)
        self.records = Counter("croupier_journal_records_total", "Events the journal made durable.", registry=self.registry)
        self.unread = Counter("croupier_rpc_refused_unread_total", "Calls that ended before their request was read: a "
                              "request over gRPC's receive limit (twice --max-request-bytes, at least 1 MiB more), "
                              "which gRPC refuses with "
                              "RESOURCE_EXHAUSTED unread, or a client that gave up before sending it (or sent none); by method.",
                              ["method"], registry=self.registry)
        for m in rpcs:
            self.latency.labels(m)
            self.calls.labels(m, grpc.StatusCode.OK.name)
            self.unread.labels(m)
        self.refused = Counter("croupier_rpc_admission_refused_total", "Calls refused at once with RESOURCE_EXHAUSTED "
                               "and a retry hint, by the bound they were over: calls (--max-calls), job_calls "
                               "(--max-job-calls), waiting_joins (--max-concurrent-joins).", ["bound"],
                               registry=self.registry)
        for bound in ("calls", "job_calls", "waiting_joins"):
            self.refused.labels(bound)
        self.registry.register(_JobsCollector(core))
        core.on_commit = self.on_commit

    def observe(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        """Records one call of `method` that ended with `code` after `seconds` (from its request's arrival)."""
        self.latency.labels(method).observe(seconds)
        self.calls.labels(method, code.name).inc()

    def unread_call(self, method: str) -> None:
        """Records a call of `method` that ended before its request was read."""
        self.unread.labels(method).inc()

    def on_refuse(self, bound: str) -> None:
        """Records a call refused for admission `bound`."""
        self.refused.labels(bound).inc()

    def watch_admission(self, admission: Any) -> None:
        """Reports `admission`'s calls in progress and waiting joins at each scrape (``croupier.server._admission.Admission``)."""
        self.registry.register(_AdmissionCollector(admission))

    def start(self) -> None:
        """Serves ``/metrics``, the status page and its JSON (``/api/jobs``, ``/api/ledger``, ``/api/mix``, ``/api/step``) and
        ``/healthz`` (see ``croupier.server._http``).

        Raises:
            OSError: If the endpoint's address cannot be bound.
        """
        if self._endpoint is None:
            self._endpoint = Endpoint(self.host, self.port, self.exposition,
                                      lambda after, limit, reads: job_page(self.core, after, limit, reads),
                                      lambda: self.core.failed, self.core.step_ledger, self.auth, self.tls)

    def stop(self) -> None:
        """Stops the HTTP endpoint (the metrics themselves stay readable)."""
        if self._endpoint is not None:
            self._endpoint.stop()
            self._endpoint = None

    def exposition(self, reads: Callable[[str], bool] | None = None) -> bytes:
        """The Prometheus text of the registry; with `reads`, without the series of a job it does not grant."""
        return generate_latest(self.registry if reads is None else _Readable(self.registry, reads))

    @property
    def address(self) -> str | None:
        """HOST:PORT of the HTTP endpoint while it serves, else None."""
        return None if self._endpoint is None else self._endpoint.address

    def on_commit(self, seconds: float, records: int) -> None:
        """Records one journal append of `records` events that took `seconds`."""
        self.commit.observe(seconds)
        self.records.inc(records)


def job_views(core: Coordinator) -> list[JobView]:
    """Every job the coordinator holds, summarised (a job that fails to read is left out)."""
    return job_page(core, "", None)[0]


def job_page(core: Coordinator, after: str, limit: int | None,
             reads: Callable[[str], bool] | None = None) -> tuple[list[JobView], int]:
    """Up to `limit` jobs (None: all) named after `after` in name order, summarised; and how many jobs there are.
    With `reads`, only the jobs it grants count (a credential's, as ListJobs lists them).

    Only the jobs of the page are read: a page costs the same with 10 jobs or 10,000 (the names are
    listed, in order, once).
    """
    names = core.jobs()  # sorted
    if reads is not None:
        names = [n for n in names if reads(n)]
    first = bisect.bisect_right(names, after) if after else 0
    out = []
    for name in names[first:] if limit is None else names[first:first + limit]:
        try:
            out.append(job_view(name, core.job(name)))
        except CroupierError:
            continue
    return out, len(names)


class _Readable:
    """A registry's metrics without the series labelled with a job that `reads` does not grant."""

    def __init__(self, registry: CollectorRegistry, reads: Callable[[str], bool]) -> None:
        self.registry, self.reads = registry, reads

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s for s in family.samples if "job" not in s.labels or self.reads(s.labels["job"])]
            yield out


class _AdmissionCollector(Collector):
    """Calls in progress and joins waiting, read at each scrape."""

    def __init__(self, admission: Any) -> None:
        self.admission = admission

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        calls = GaugeMetricFamily("croupier_rpc_in_progress", "Calls being served (a join until it is recorded).")
        calls.add_metric([], self.admission.calls)
        waiting = GaugeMetricFamily("croupier_joins_waiting", "Joins waiting for their generation's other ranks.")
        waiting.add_metric([], self.admission.waiting)
        yield calls
        yield waiting


class _JobsCollector(Collector):
    """Jobs, generations and progress, read from the coordinator at each scrape."""

    def __init__(self, core: Coordinator) -> None:
        self.core = core

    def describe(self) -> Iterable[Any]:
        return []  # the series depend on the jobs; nothing to check at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        failed = GaugeMetricFamily("croupier_coordinator_failed", "1 once the store failed and the coordinator stopped "
                                   "acknowledging (restart it to recover), else 0.")
        failed.add_metric([], 1.0 if self.core.failed else 0.0)
        yield failed
        try:
            views = job_views(self.core)
        except CroupierError:  # the coordinator failed: no jobs to read
            return
        now = time.time()

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ("job",)) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=list(labels))

        jobs = GaugeMetricFamily("croupier_jobs", "Jobs the coordinator holds.")
        jobs.add_metric([], len(views))
        yield jobs
        generation = gauge("croupier_job_generation", "The job's current generation (a new incarnation opens the next one).")
        world = gauge("croupier_job_world", "World size of the job's current generation.")
        waiting = gauge("croupier_job_waiting_ranks", "Ranks the current generation still waits for (0 once it started).")
        epoch = gauge("croupier_job_epoch", "The job's epoch: the highest epoch any rank of the current generation reported.")
        progress = gauge("croupier_job_epoch_progress", "Fraction (0..1) of the job's epoch done by the ranks in it: "
                         "their batches taken over their batches in that epoch (as croupier status shows it).")
        reported = gauge("croupier_job_ranks_reported", "Ranks of the current generation that reported their progress.")
        lag_stat = gauge("croupier_job_lag_batches", "min, median and max over the job's reported ranks of "
                         "croupier_rank_lag_batches.", ("job", "stat"))
        age_stat = gauge("croupier_job_report_age_seconds", "min, median and max over the job's reported ranks of "
                         "croupier_rank_report_age_seconds.", ("job", "stat"))
        r_epoch = gauge("croupier_rank_epoch", "The epoch the rank last reported (jobs of world <= "
                        f"{PER_RANK_MAX_WORLD} only).", ("job", "rank"))
        r_progress = gauge("croupier_rank_epoch_progress", "Fraction (0..1) of its batches of croupier_rank_epoch the "
                           f"rank has taken (jobs of world <= {PER_RANK_MAX_WORLD} only).", ("job", "rank"))
        r_lag = gauge("croupier_rank_lag_batches", "Batches the rank is behind the job's furthest rank (highest epoch, "
                      "then batches): in the same epoch the difference of their batches; from an earlier epoch what the "
                      "rank has left of its epoch, its share of each epoch in between, and the furthest rank's batches "
                      f"(jobs of world <= {PER_RANK_MAX_WORLD} only).", ("job", "rank"))
        r_age = gauge("croupier_rank_report_age_seconds", "Seconds since the rank last reported its progress (with a "
                      f"lease, grant or checkpoint; jobs of world <= {PER_RANK_MAX_WORLD} only).", ("job", "rank"))
        for v in views:
            j = [v.name]
            generation.add_metric(j, v.generation)
            world.add_metric(j, v.world)
            waiting.add_metric(j, v.waiting_for)
            reported.add_metric(j, v.reported)
            if v.epoch is None:
                continue
            epoch.add_metric(j, v.epoch)
            progress.add_metric(j, v.progress)
            if v.lag is not None:
                for stat, x in zip(("min", "median", "max"), v.lag):
                    lag_stat.add_metric([v.name, stat], x)
            if v.report_ms is not None:
                oldest, median, latest = v.report_ms
                for stat, ms in (("min", latest), ("median", median), ("max", oldest)):
                    age_stat.add_metric([v.name, stat], max(0.0, now - ms / 1000.0))
            if v.world > PER_RANK_MAX_WORLD:
                continue
            for r in v.ranks:
                jr = [v.name, str(r.rank)]
                r_epoch.add_metric(jr, r.epoch)
                r_progress.add_metric(jr, r.progress)
                r_lag.add_metric(jr, r.lag)
                r_age.add_metric(jr, max(0.0, now - r.reported_ms / 1000.0))
        yield from (generation, world, waiting, reported, epoch, progress, lag_stat, age_stat, r_epoch, r_progress, r_lag, r_age)
