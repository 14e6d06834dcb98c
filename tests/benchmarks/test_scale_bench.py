"""benchmarks/baseline.py (an older commit's coordinator in the same run), the join storm's and the waiting joins'
quick runs on both servings, and the storm table's verdicts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import baseline  # noqa: E402
import scale_report  # noqa: E402


def _threaded_ref() -> str:
    try:
        return baseline.resolve(baseline.THREADED)
    except ValueError as e:  # a checkout without the history (an export, a shallow clone)
        pytest.skip(str(e))


@pytest.mark.e2e  # a child process imports the exported tree
def test_the_baseline_runs_the_old_commits_server_and_this_tree_runs_its_own() -> None:
    ref = _threaded_ref()
    with baseline.baseline(ref) as old:
        where = baseline.imported_server(old.environ())
        tree = where.parents[1]
        assert where.name == "_service.py" and tree != BENCHMARKS.parent and tree.name == "tree", where
        # the old commit's files: its serving is gRPC's synchronous server, this tree's is not
        assert "grpc.aio" not in where.read_text() and "grpc.aio" in (BENCHMARKS.parent / "server" / "_aio.py").read_text()
        assert old.join_poll_ms == 500 and old.ref == ref
    assert not tree.exists()  # removed on exit
    assert baseline.imported_server(baseline.CURRENT.environ()) == (BENCHMARKS.parent / "server" / "_service.py").resolve()


def test_a_baseline_that_names_no_commit_is_refused() -> None:
    with pytest.raises(ValueError, match=r"--baseline 'no-such-ref': not a commit of the repository"):
        with baseline.baseline("no-such-ref"):
            pass


def _row(p99: float, ceiling_p99: float, cancelled: int = 0, ungranted: int = 0) -> dict[str, Any]:
    return {"world": 1024, "serving": baseline.CURRENT.label, "poll_ms": 5000, "first_p50_ms": 10.0, "first_p99_ms": p99,
            "first_max_ms": p99, "ceiling": {"p50_ms": 5.0, "p99_ms": ceiling_p99, "second_over_1s": 0},
            "cancelled": cancelled, "cancelled_grants": 1 if cancelled else 0, "retried": cancelled, "refused": 0, "refused_waits": 0, "ungranted": ungranted,
            "cpu_ms_per_rank": 1.0, "rss_bytes_per_rank": 1024.0, "joins_per_s": 100.0}


def test_the_storm_table_says_missed_beside_each_figure_over_its_target() -> None:
    table = scale_report.render([_row(110.0, 100.0)])
    assert "| 1.10x |" in table and "p99 <= 1.2x ceiling: met; 0 cancelled: met; every first grant within 1 s: met" in table
    table = scale_report.render([_row(130.0, 100.0, cancelled=3, ungranted=2)])
    assert "| 1.30x | 3 / 1 |" in table
    assert "p99 <= 1.2x ceiling: MISSED; 0 cancelled: MISSED; every first grant within 1 s: MISSED" in table


@pytest.mark.e2e  # processes: two coordinators (this tree's, the old commit's), the ceiling's server, drivers
@pytest.mark.slow  # make slow; tests/e2e/test_scale.py runs the storm on this tree in the suite
def test_the_storm_runs_quick_on_both_servings(tmp_path: Path) -> None:
    ref = _threaded_ref()
    out = tmp_path / "scale.md"
    run = subprocess.run([sys.executable, str(BENCHMARKS / "scale_bench.py"), "--worlds", "128", "--drivers", "2",
                          "--baseline", ref, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {r["serving"]: r for r in map(json.loads, (ln for ln in run.stdout.splitlines() if ln.startswith("{")))}
    new, old = rows[baseline.CURRENT.label], rows[f"threads ({ref})"]
    assert new["poll_ms"] == 5000 and old["poll_ms"] == 500
    # 128 ranks: the old coordinator holds 96 waits and refuses the others theirs; the new one holds them all
    assert old["refused_waits"] > 0 and new["refused_waits"] == 0, (old, new)
    table = out.read_text()
    assert f"| 128 | {baseline.CURRENT.label}, 5 s poll |" in table and f"| 128 | threads ({ref}), 0.5 s poll |" in table


@pytest.mark.e2e  # processes: two coordinators, drivers of 200 waiting ranks
@pytest.mark.slow  # make slow
def test_the_waiting_joins_run_quick_on_both_servings(tmp_path: Path) -> None:
    ref = _threaded_ref()
    out = tmp_path / "waiting.md"
    run = subprocess.run([sys.executable, str(BENCHMARKS / "waiting_bench.py"), "--ranks", "200", "--drivers", "2",
                          "--window", "1", "--baseline", ref, "--out", str(out)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {r["serving"]: r for r in map(json.loads, (ln for ln in run.stdout.splitlines() if ln.startswith("{")))}
    new, old = rows[baseline.CURRENT.label], rows[f"threads ({ref})"]
    # the new coordinator holds every waiting join at once, refusing none; the old one refuses past its 96 places
    assert new["held_min"] == 200 and new["refused"] == 0, new
    assert old["refused"] > 0 and old["held_min"] < 200, old
    assert new["answered"] == old["answered"] == 200  # every waiting rank learnt that the generation started
    assert "| 200 | 200 / 200 |" in out.read_text()


def test_the_waiting_bench_refuses_a_window_shorter_than_its_sampling() -> None:
    run = subprocess.run([sys.executable, str(BENCHMARKS / "waiting_bench.py"), "--window", "0.1"], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and "--window must be >= 0.5 s, a sample every half second (got 0.1)" in run.stderr
