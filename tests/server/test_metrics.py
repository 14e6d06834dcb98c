"""The metrics endpoint of a live server: calls, journal commits, jobs, generations, epochs and lag as they happened,
and the Grafana dashboard's queries against what it exposes."""

from __future__ import annotations

import json
import pathlib
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from _ranks import Ranks
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from croupier.client import DistributedSampler
from croupier.client._rpc import CoordinatorClient
from croupier.core.api import JobStatus, JoinRequest, JoinResult, RankCursor
from croupier.core.order import fresh
from croupier.core.spec import Spec
from croupier.core.wire import SERVICE
from croupier.server import Server, ServerOptions
from croupier.server._standing import PER_RANK_MAX_WORLD, job_view
from croupier.v1 import coordinator_pb2 as pb

ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "croupier.json"
SPEC = Spec(n=1000, seed=3, batch_size=8, permutation="feistel")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def mserver(tmp_path: pathlib.Path) -> Iterator[Server]:
    """An in-process coordinator with its metrics endpoint on a free port."""
    s = Server(f"sqlite:///{tmp_path}/c.db", options=ServerOptions(metrics_port=0)).start()
    try:
        yield s
    finally:
        s.stop(grace=0.5)


def get(server: Server, path: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(f"http://{server.metrics_address}{path}", timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def scrape(server: Server) -> Samples:
    status, headers, body = get(server, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(body.decode()) for s in f.samples}


def value(samples: Samples, name: str, **labels: Any) -> float | None:
    return samples.get((name, frozenset((k, str(v)) for k, v in labels.items())))


def series(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def samplers(server: Server, job: str, incarnation: str, world: int, n: int = 1000) -> list[DistributedSampler]:
    return [DistributedSampler(n, num_replicas=world, rank=r, address=server.address, job=job, incarnation=incarnation, lease_ahead=16,
                               prefetch=1) for r in range(world)]


def take(ranks: Ranks, rank: int, k: int) -> None:
    for _ in range(k):
        assert ranks.next(rank) is not None


# ---------------------------------------------------------------- the pure view


def _status(world: int, cursors: list[RankCursor], generation: int = 2) -> JobStatus:
    return JobStatus(SPEC, JoinResult(generation, world, fresh(SPEC, 0), ()), tuple(cursors))


def test_job_view_defines_epoch_progress_and_lag() -> None:
    # Ranks 0 and 1 are in epoch 1, rank 2 still in epoch 0 (15 of its 20 batches), rank 3 never reported.
    v = job_view("j", _status(4, [RankCursor(0, 1, 10, 20, 1000), RankCursor(1, 1, 4, 20, 3000), RankCursor(2, 0, 15, 20, 2000)]))
    assert (v.generation, v.world, v.started, v.epoch, v.reported) == (2, 4, True, 1, 3)
    assert v.progress == pytest.approx((10 + 4) / (20 + 20))  # the ranks in epoch 1, as `croupier status` shows it
    # Rank 2: the 5 batches left of epoch 0, and the 10 rank 0 took of epoch 1.
    assert [(r.rank, r.lag, r.progress) for r in v.ranks] == [(0, 0, 0.5), (1, 6, 0.2), (2, 15, 0.75)]
    assert v.lag == (0, 6.0, 15) and v.slowest is not None and v.slowest.rank == 2
    assert v.report_ms == (1000, 2000.0, 3000) and v.last_ms == 3000
    three_behind = job_view("j", _status(2, [RankCursor(0, 3, 2, 20, 0), RankCursor(1, 0, 19, 20, 0)]))
    assert [r.lag for r in three_behind.ranks] == [0, 1 + 2 * 20 + 2]
    empty = job_view("j", JobStatus(SPEC, JoinResult(1, 3, None, (1, 2))))
    assert (empty.started, empty.waiting_for, empty.epoch, empty.progress, empty.lag, empty.slowest) == (False, 2, None, 0.0, None, None)


def test_job_view_of_a_large_world_shows_its_slowest_ranks() -> None:
    world = PER_RANK_MAX_WORLD + 44
    v = job_view("big", _status(world, [RankCursor(r, 0, r % 50, 100, 5) for r in range(world)]))
    assert len(v.ranks) == PER_RANK_MAX_WORLD and [r.rank for r in v.ranks] == sorted(r.rank for r in v.ranks)
    assert min(r.lag for r in v.ranks) >= max(49 - (r % 50) for r in range(world) if r not in {x.rank for x in v.ranks})
    assert v.lag == (0, 24.5, 49) and v.reported == world  # over every rank, not only those shown


# ---------------------------------------------------------------- calls and commits


def test_calls_are_counted_by_method_and_status_code(mserver: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    ch = grpc.insecure_channel(mserver.address)
    try:
        def call(method: str, request: bytes) -> grpc.StatusCode:
            try:
                ch.unary_unary(f"/{SERVICE}/{method}")(request, timeout=10)
                return grpc.StatusCode.OK
            except grpc.RpcError as e:
                return e.code()

        before = scrape(mserver)
        assert value(before, "croupier_rpc_calls_total", method="ListJobs", code="OK") == 0  # exists before any call
        assert [call("ListJobs", b"") for _ in range(2)] == [grpc.StatusCode.OK] * 2
        assert call("ListJobs", b"\xff") == grpc.StatusCode.INVALID_ARGUMENT
        unknown = pb.GetJobRequest(job="nope").SerializeToString()
        assert [call("GetJob", unknown) for _ in range(3)] == [grpc.StatusCode.NOT_FOUND] * 3

        def broken(*a: Any) -> Any:
            raise RuntimeError("a bug")

        monkeypatch.setattr(mserver.core, "checkpoint", broken)
        assert call("GetCheckpoint", pb.GetCheckpointRequest(job="j", step=1).SerializeToString()) == grpc.StatusCode.UNKNOWN
        assert call("NoSuchMethod", b"") == grpc.StatusCode.UNIMPLEMENTED
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
        after = scrape(mserver)
    finally:
        ch.close()

    def delta(name: str, **labels: str) -> float:
        return (value(after, name, **labels) or 0.0) - (value(before, name, **labels) or 0.0)

    calls = {dict(k)["method"] + " " + dict(k)["code"]: v for k, v in series(after, "croupier_rpc_calls_total").items() if v}
    assert calls == {"ListJobs OK": 2, "ListJobs INVALID_ARGUMENT": 1, "GetJob NOT_FOUND": 3, "GetCheckpoint UNKNOWN": 1}
    for method, n in (("ListJobs", 3), ("GetJob", 3), ("GetCheckpoint", 1), ("Lease", 0)):
        assert delta("croupier_rpc_latency_seconds_count", method=method) == n
        assert delta("croupier_rpc_latency_seconds_bucket", method=method, le="+Inf") == n
    assert 0 < delta("croupier_rpc_latency_seconds_sum", method="GetJob") < 30
    # Only the service's own methods: health checks and unknown names make no series.
    assert {dict(k)["method"] for k in series(after, "croupier_rpc_latency_seconds_count")} == {
        "Join", "Lease", "Grant", "GetJob", "Report", "GetCheckpoint", "ListJobs", "Amend", "GetLedger", "CommitStep"}


def test_journal_commits_are_timed_and_counted(mserver: Server) -> None:
    before = scrape(mserver)
    assert value(before, "croupier_journal_records_total") == 0
    assert value(before, "croupier_journal_commit_seconds_count") == 0
    c = CoordinatorClient(mserver.address, retry_for=5.0)
    try:
        r = c.join_started(JoinRequest("j", SPEC, "t1", 1, 0), timeout=20)
        c.report("j", r.generation, 0, (0, 3), (None, fresh(SPEC, 0), "o"))  # a checkpoint: durable when it returns
    finally:
        c.close()
    after = scrape(mserver)
    # Every event the coordinator journaled (its sequence number) was committed and counted
    # before the call that made it was answered.
    assert value(after, "croupier_journal_records_total") == mserver.core._commits.seq > 0
    commits = value(after, "croupier_journal_commit_seconds_count")
    assert commits is not None and 1 <= commits <= mserver.core._commits.seq
    assert value(after, "croupier_journal_commit_seconds_bucket", le="+Inf") == commits
    assert 0 < (value(after, "croupier_journal_commit_seconds_sum") or 0) < 10


# ---------------------------------------------------------------- jobs, generations, epochs, lag


def test_jobs_generations_epochs_and_lag_match_the_ranks(mserver: Server) -> None:
    ss = samplers(mserver, "j", "t1", 2)
    ranks = Ranks(ss)
    try:
        take(ranks, 0, 100)
        take(ranks, 1, 40)
        states = [s.state_dict() for s in ss]
        assert [s["origin"].split("/")[1:] for s in states] == [["0", "100"], ["0", "40"]]
        per_rank = len(ss[0])  # 500: one batch of one index each
        m = scrape(mserver)
        assert value(m, "croupier_jobs") == 1 and value(m, "croupier_coordinator_failed") == 0
        assert [value(m, f"croupier_job_{k}", job="j") for k in ("generation", "world", "waiting_ranks", "ranks_reported", "epoch")] \
            == [1, 2, 0, 2, 0]
        assert value(m, "croupier_job_epoch_progress", job="j") == pytest.approx(140 / (2 * per_rank))
        assert [value(m, "croupier_rank_epoch_progress", job="j", rank=r) for r in (0, 1)] \
            == pytest.approx([100 / per_rank, 40 / per_rank])
        assert [value(m, "croupier_rank_lag_batches", job="j", rank=r) for r in (0, 1)] == [0, 60]
        assert [value(m, "croupier_job_lag_batches", job="j", stat=s) for s in ("min", "median", "max")] == [0, 30, 60]
        ages = [value(m, "croupier_rank_report_age_seconds", job="j", rank=r) for r in (0, 1)]
        assert all(a is not None and 0 <= a < 60 for a in ages)
        # The status page's data says the same.
        status, headers, body = get(mserver, "/api/jobs")
        assert status == 200 and headers["Content-Type"] == "application/json"
        (job,) = json.loads(body)["jobs"]
        assert (job["name"], job["generation"], job["world"], job["epoch"], job["slowest"]) == ("j", 1, 2, 0, {"rank": 1, "lag": 60})
        assert [(r["rank"], r["batches"], r["batches_in_epoch"], r["lag"]) for r in job["ranks"]] \
            == [(0, 100, per_rank, 0), (1, 40, per_rank, 60)]

        # Rank 0 finishes epoch 0 and takes 10 of epoch 1; rank 1 stays at 40 of epoch 0.
        while ranks.next(0) is not None:
            pass
        ranks.new_iterators()
        take(ranks, 0, 10)
        assert ss[0].state_dict()["origin"].split("/")[1:] == ["1", "10"]
        m = scrape(mserver)
        assert value(m, "croupier_job_epoch", job="j") == 1
        assert [value(m, "croupier_rank_epoch", job="j", rank=r) for r in (0, 1)] == [1, 0]
        # Rank 1: what it has left of epoch 0, and the 10 rank 0 took of epoch 1.
        assert [value(m, "croupier_rank_lag_batches", job="j", rank=r) for r in (0, 1)] == [0, per_rank - 40 + 10]
        assert value(m, "croupier_job_epoch_progress", job="j") == pytest.approx(10 / per_rank)  # the ranks in epoch 1
    finally:
        ranks.close()

    # A new incarnation opens generation 2 (world 3); the old world's cursors are gone.
    ss = samplers(mserver, "j", "t2", 3)
    ranks = Ranks(ss)
    try:
        m = scrape(mserver)
        assert [value(m, f"croupier_job_{k}", job="j") for k in ("generation", "world", "waiting_ranks")] == [2, 3, 0]
        assert set(series(m, "croupier_rank_epoch").values()) <= {0}
    finally:
        ranks.close()
    # Generation 3 opens with one of its two ranks: it waits for the other.
    c = CoordinatorClient(mserver.address, retry_for=5.0)
    try:
        spec, _ = c.get_job("j")
        c.join(JoinRequest("j", spec, "t3", 2, 0), wait_s=0)
    finally:
        c.close()
    m = scrape(mserver)
    assert [value(m, f"croupier_job_{k}", job="j") for k in ("generation", "world", "waiting_ranks", "ranks_reported")] == [3, 2, 1, 0]
    assert value(m, "croupier_job_epoch", job="j") is None and series(m, "croupier_rank_lag_batches") == {}


def test_a_large_world_has_job_level_series_only(tmp_path: pathlib.Path) -> None:
    world = PER_RANK_MAX_WORLD + 1
    with Server("memory://", options=ServerOptions(metrics_port=0)) as server:
        for r in range(world):
            server.core.join(JoinRequest("big", SPEC, "t1", world, r))
        (gen,) = {server.core.job("big").result.generation}
        for r in range(world):
            server.core.report("big", gen, r, 0, r % 3)
        m = scrape(server)
        assert value(m, "croupier_job_world", job="big") == world
        assert value(m, "croupier_job_ranks_reported", job="big") == world
        assert [value(m, "croupier_job_lag_batches", job="big", stat=s) for s in ("min", "median", "max")] == [0, 1, 2]
        for name in ("croupier_rank_epoch", "croupier_rank_epoch_progress", "croupier_rank_lag_batches",
                     "croupier_rank_report_age_seconds"):
            assert series(m, name) == {}, name
        _, _, body = get(server, "/api/jobs")
        (job,) = json.loads(body)["jobs"]
        assert len(job["ranks"]) == PER_RANK_MAX_WORLD and job["reported"] == world
        # The slowest: 86 ranks of lag 2, 86 of lag 1, and 84 of the 85 of lag 0 (not the last, rank 254).
        lags = [r["lag"] for r in job["ranks"]]
        assert [lags.count(k) for k in (2, 1, 0)] == [86, 86, 84] and 254 not in {r["rank"] for r in job["ranks"]}


# ---------------------------------------------------------------- the endpoint


def test_the_endpoint_serves_reads_only_and_stops_with_the_server(tmp_path: pathlib.Path) -> None:
    plain = Server("memory://").start()
    try:
        assert plain.metrics_address is None and plain.metrics is None
    finally:
        plain.stop(grace=0.5)
    server = Server(f"sqlite:///{tmp_path}/c.db", options=ServerOptions(metrics_port=0)).start()
    address = server.metrics_address
    try:
        assert address is not None and address.startswith("127.0.0.1:")
        assert get(server, "/healthz")[0] == 200
        status, headers, body = get(server, "/")
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert b"api/jobs" in body and "script-src 'sha256-" in headers["Content-Security-Policy"]
        assert get(server, "/nope")[0] == 404
        req = urllib.request.Request(f"http://{address}/metrics", data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 501
        # A failed coordinator: /healthz says so, the metrics too, and the jobs cannot be read.
        server.core._commits.failed = "the store failed: disk gone"
        assert get(server, "/healthz")[0] == 503
        m = scrape(server)
        assert value(m, "croupier_coordinator_failed") == 1 and value(m, "croupier_jobs") is None
        assert json.loads(get(server, "/api/jobs")[2])["coordinator_failed"] == "the store failed: disk gone"
        server.core._commits.failed = None
    finally:
        server.stop(grace=0.5)
    assert server.metrics_address is None
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://{address}/healthz", timeout=5)


def test_the_endpoint_port_is_checked() -> None:
    with pytest.raises(ValueError, match="metrics_port"):
        ServerOptions(metrics_port=70000)


# ---------------------------------------------------------------- the Grafana dashboard


def dashboard_metrics(dashboard: Any) -> set[str]:
    """Every croupier_ name in the dashboard's queries (panels' `expr`, templating queries)."""
    found: set[str] = set()

    def walk(x: Any, key: str = "") -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, k)
        elif isinstance(x, list):
            for v in x:
                walk(v, key)
        elif isinstance(x, str) and key in ("expr", "query", "definition"):
            found.update(re.findall(r"\bcroupier_[a-z_]+", x))

    walk(dashboard)
    return found


def missing_metrics(names: set[str], exposition: str) -> list[str]:
    """Names a live /metrics does not expose; a `_bucket`/`_count`/`_sum` name must be of a histogram."""
    kinds, samples = {}, set()
    for f in text_string_to_metric_families(exposition):
        kinds[f.name] = f.type
        samples.update(s.name for s in f.samples)
    out = []
    for name in sorted(names):
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        if name not in samples or (base != name and kinds.get(base) != "histogram"):
            out.append(name)
    return out


def test_every_metric_the_dashboard_queries_exists(mserver: Server) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "croupier" and dashboard["panels"]
    names = dashboard_metrics(dashboard)
    assert len(names) >= 15, names
    ss = samplers(mserver, "j", "t1", 2)
    ranks = Ranks(ss)
    try:
        take(ranks, 0, 20)
        take(ranks, 1, 10)
        for s in ss:
            s.state_dict()
    finally:
        ranks.close()
    _, _, body = get(mserver, "/metrics")
    exposition = body.decode()
    assert missing_metrics(names, exposition) == []
    # The check can fail: a name the server does not expose, and a histogram suffix on a gauge.
    assert missing_metrics({"croupier_no_such_metric", "croupier_jobs_count", "croupier_rpc_latency_seconds_bucket"},
                           exposition) == ["croupier_jobs_count", "croupier_no_such_metric"]
