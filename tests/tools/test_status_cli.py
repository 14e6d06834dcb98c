"""`croupier status`: the pure tables from a JobStatus, and the command against a real coordinator."""

from __future__ import annotations

import io
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest
from _ranks import Ranks
from prometheus_client.parser import text_string_to_metric_families

from croupier.client import DistributedSampler
from croupier.core.api import CheckpointRecord, JobStatus, JoinResult, RankCursor
from croupier.core.order import Cursor, fresh
from croupier.core.spec import Spec
from croupier.server import Server, ServerOptions
from croupier.tools import status
from croupier.tools.status import ago, job_lines, jobs_lines, summarize

NOW = 1_700_000_000_000
SPEC = Spec(n=1000)


def _started() -> JobStatus:
    """Generation 2 of 4 ranks: ranks 0 and 1 in epoch 1, rank 2 still in epoch 0, rank 3 never reported."""
    ranks = (RankCursor(0, 1, 50, 250, NOW - 3_000), RankCursor(1, 1, 20, 250, NOW - 125_000),
             RankCursor(2, 0, 240, 250, NOW - 1_000))
    checkpoints = (CheckpointRecord(None, Cursor(0, ((400, 1000),)), "o", 1, 0, NOW - 7_200_000),
                   CheckpointRecord(40, Cursor(1, ((160, 1000),)), "o", 2, 1, NOW - 90_000))
    return JobStatus(SPEC, JoinResult(2, 4, fresh(SPEC, 0), ()), ranks, checkpoints)


def _waiting() -> JobStatus:
    return JobStatus(SPEC, JoinResult(3, 4, None, (1, 2)))


def test_summary_counts_the_current_epoch_and_the_slowest_rank_across_epochs() -> None:
    s = summarize(_started())
    assert (s.epoch, s.done, s.total) == (1, 70, 500)  # ranks 0 and 1 in epoch 1; rank 2 is not counted
    assert s.slowest is not None and s.slowest.rank == 2
    assert s.behind == (250 - 240) + 50  # the rest of its epoch 0, then rank 0's 50 batches of epoch 1
    assert s.silent == (3,)
    assert s.last_ms == NOW - 1_000
    same = summarize(JobStatus(SPEC, JoinResult(1, 2, fresh(SPEC, 0), ()),
                               (RankCursor(0, 0, 90, 500, NOW), RankCursor(1, 0, 30, 500, NOW))))
    assert (same.slowest and same.slowest.rank, same.behind, same.done, same.total) == (1, 60, 120, 1000)


def test_summary_of_a_job_no_rank_reported_to() -> None:
    s = summarize(_waiting())
    assert (s.epoch, s.slowest, s.silent, s.last_ms) == (None, None, (0, 1, 2, 3), None)


@pytest.mark.parametrize(("ms", "expected"), [
    (None, "-"), (NOW, "0 s ago"), (NOW + 5_000, "0 s ago"), (NOW - 12_400, "12 s ago"), (NOW - 119_999, "119 s ago"),
    (NOW - 120_000, "2 min ago"), (NOW - 7_199_000, "119 min ago"), (NOW - 7_200_000, "2 h ago"),
    (NOW - 3 * 86_400_000, "3 d ago"),
])
def test_ago(ms: int | None, expected: str) -> None:
    assert ago(ms, NOW) == expected


def test_the_table_of_every_job() -> None:
    assert jobs_lines([("train", _started()), ("wait", _waiting())], NOW) == [
        "JOB    GEN  WORLD  EPOCH  PROGRESS                  SLOWEST                    REPORTED  LAST ACTIVITY",
        "train  2    4      1      14.0%                     rank 2, 60 batches behind  3/4       1 s ago",
        "wait   3    4      -      waiting for ranks [1, 2]  -                          0/4       -",
    ]
    assert jobs_lines([], NOW) == ["no jobs"]


def test_one_job_with_a_rank_that_never_reported() -> None:
    assert job_lines("train", _started(), NOW) == [
        "job train: generation 2, world 4, started at epoch 0",
        "epoch 1: 14.0% (70/500 batches), slowest rank 2, 60 batches behind, last activity 1 s ago",
        "never reported: ranks [3]",
        f"spec: {SPEC.describe()}",
        "",
        "RANK  EPOCH  BATCHES  %      LAST REPORT",
        "0     1      50/250   20.0%  3 s ago",
        "1     1      20/250   8.0%   2 min ago",
        "2     0      240/250  96.0%  1 s ago",
        "3     -      -        -      -",
        "",
        "checkpoints (2):",
        "STEP  GEN  RANK  EPOCH  WHEN",
        "-     1    0     0      2 h ago",
        "40    2    1     1      90 s ago",
    ]


def test_one_job_waiting_for_ranks() -> None:
    assert job_lines("wait", _waiting(), NOW) == [
        "job wait: generation 3, world 4, waiting for ranks [1, 2]",
        "never reported: ranks [0, 1, 2, 3]",
        f"spec: {SPEC.describe()}",
        "",
        "RANK  EPOCH  BATCHES  %  LAST REPORT",
        "0     -      -        -  -",
        "1     -      -        -  -",
        "2     -      -        -  -",
        "3     -      -        -  -",
        "",
        "no checkpoints recorded",
    ]


# ---------------------------------------------------------------- against a coordinator

TAKEN = (90, 60, 30)


@pytest.fixture
def job_j(server: Server) -> Iterator[str]:
    """Job "j" on the server: 3 ranks that took 90, 60 and 30 indices, each then took its state_dict(); its address."""
    samplers = [DistributedSampler(1000, num_replicas=3, rank=r, address=server.address, job="j", incarnation="t1",
                                   lease_ahead=16, prefetch=1) for r in range(3)]
    ranks = Ranks(samplers)
    try:
        for r, k in enumerate(TAKEN):
            for _ in range(k):
                assert ranks.next(r) is not None
            samplers[r].state_dict()  # reports exactly what its loop took
        yield server.address
    finally:
        ranks.close()


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "croupier.tools.cli", "status", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def _rows(lines: list[str], header: str) -> list[list[str]]:
    """The rows of the table under `header` (up to the next blank line), split into cells."""
    i = next(k for k, line in enumerate(lines) if line.startswith(header))
    out = []
    for line in lines[i + 1:]:
        if not line.strip():
            break
        out.append(line.split())
    return out


def test_status_lists_the_job_with_its_slowest_rank(job_j: str) -> None:
    r = _cli("--address", job_j)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["JOB", "GEN", "WORLD"]
    # 180 of 3 * 334 batches (tail "pad": every rank gets ceil(1000 / 3)); rank 2 is 90 - 30 behind rank 0
    assert _rows(lines, "JOB")[0][:11] == ["j", "1", "3", "0", "18.0%", "rank", "2,", "60", "batches", "behind", "3/3"]


def test_status_of_one_job_shows_each_rank_and_its_checkpoints(job_j: str) -> None:
    env = {**os.environ, "CROUPIER_ADDRESS": job_j}  # the address from the environment
    r = _cli("j", env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "job j: generation 1, world 3, started at epoch 0"
    assert lines[1].startswith("epoch 0: 18.0% (180/1002 batches), slowest rank 2, 60 batches behind, last activity ")
    assert [row[:4] for row in _rows(lines, "RANK")] == [
        ["0", "0", "90/334", "26.9%"], ["1", "0", "60/334", "18.0%"], ["2", "0", "30/334", "9.0%"],
    ]
    # each state_dict() recorded a checkpoint (no step named): generation 1, by each rank, in epoch 0
    assert sorted(row[:4] for row in _rows(lines, "STEP")) == [["-", "1", str(k), "0"] for k in range(3)]


def test_status_watch_redraws_until_ctrl_c(job_j: str) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "croupier.tools.cli", "status", "--address", job_j, "--watch", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        while sum(line.startswith("JOB ") for line in lines) < 2:
            line = proc.stdout.readline()
            assert line, f"status --watch ended early: {lines} {proc.stderr.read() if proc.stderr else ''}"
            lines.append(line.rstrip("\n"))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # not a terminal: no screen clearing, the tables one after another with a blank line between
    assert not any("\x1b" in line for line in lines)
    assert lines[0].startswith("JOB ") and lines[1].startswith("j ") and lines[2] == "" and lines[3].startswith("JOB ")


def test_status_of_an_unknown_job_names_the_known_ones(job_j: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert status.main(job_j, "nope", out=io.StringIO()) == 1
    assert capsys.readouterr().err == f"croupier status: no job 'nope' at {job_j} (jobs: j)\n"


def test_status_of_an_unreachable_coordinator_says_so_in_one_line(capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status, "RETRY_FOR_S", 0.5)  # the command's 3 s, shortened: the message names what it was
    with socket.socket() as s:  # bound, never listening: connections to it are refused
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
        out = io.StringIO()
        assert status.main(address, out=out) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"croupier status: the coordinator at {address} is unavailable (retried for 0.5 s): ")
    assert err.count("\n") == 1 and out.getvalue() == ""


def test_the_status_page_the_metrics_and_croupier_status_count_alike(tmp_path: pathlib.Path) -> None:
    """One arithmetic (croupier.server.job_view) behind the three: the same epoch, progress, slowest rank and lag."""
    with Server(f"sqlite:///{tmp_path}/c.db", options=ServerOptions(metrics_port=0)) as server:
        samplers = [DistributedSampler(1000, num_replicas=3, rank=r, address=server.address, job="j", incarnation="t1",
                                       lease_ahead=16, prefetch=1) for r in range(3)]
        ranks = Ranks(samplers)
        try:
            for r, k in enumerate(TAKEN):
                for _ in range(k):
                    assert ranks.next(r) is not None
                samplers[r].state_dict()
        finally:
            ranks.close()
        out = io.StringIO()
        assert status.main(server.address, out=out) == 0
        with urllib.request.urlopen(f"http://{server.metrics_address}/api/jobs", timeout=10) as r:
            (page,) = json.loads(r.read())["jobs"]
        with urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=10) as r:
            metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for f in text_string_to_metric_families(r.read().decode()) for s in f.samples}
    done, total = sum(TAKEN), 3 * 334  # tail "pad": every rank gets ceil(1000 / 3) batches of one index
    row = _rows(out.getvalue().splitlines(), "JOB")[0]
    assert row[3:10] == ["0", f"{100 * done / total:.1f}%", "rank", "2,", str(TAKEN[0] - TAKEN[2]), "batches", "behind"]
    assert (page["epoch"], page["slowest"]) == (0, {"rank": 2, "lag": TAKEN[0] - TAKEN[2]})
    assert page["progress"] == pytest.approx(done / total)
    assert metrics[("croupier_job_epoch", (("job", "j"),))] == 0
    assert metrics[("croupier_job_epoch_progress", (("job", "j"),))] == pytest.approx(done / total)
    assert [metrics[("croupier_rank_lag_batches", (("job", "j"), ("rank", str(r))))] for r in range(3)] == \
        [r["lag"] for r in page["ranks"]] == [0, TAKEN[0] - TAKEN[1], TAKEN[0] - TAKEN[2]]


def test_a_limit_below_one_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    from croupier.tools.cli import main

    assert main(["status", "--limit", "0", "--address", "127.0.0.1:1"]) == 2
    assert "--limit must be >= 1 (got --limit=0)" in capsys.readouterr().err
