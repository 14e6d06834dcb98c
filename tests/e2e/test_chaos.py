"""`croupier chaos`: real torchrun jobs and a real coordinator under SIGKILLs, rollbacks and resizes, audited."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
from _procs import processes_naming

from croupier.harness import _faults

pytestmark = pytest.mark.e2e  # several processes

SUMMARY = re.compile(
    r"chaos: (?P<faults>\d+) faults injected \((?P<rank>\d+) rank kills, (?P<coord>\d+) coordinator kills"
    r"(?:, (?P<pauses>\d+) coordinator pauses, (?P<rank_pauses>\d+) rank pauses, (?P<jumps>\d+) clock jumps, "
    r"(?P<disks>\d+) full disks, (?P<partitions>\d+) partitions, (?P<slow>\d+) slow links)?, (?P<preempt>\d+) preemptions\), (?P<resizes>\d+) resizes, (?P<older>\d+) restarts from an older checkpoint .*; "
    r"(?P<samples>\d+) samples audited over (?P<epochs>\d+) epochs: (?P<dups>\d+) duplicates, (?P<missing>\d+) missing; "
    r"G1 holds"
)


def chaos(workdir: pathlib.Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess[str], re.Match[str]]:
    out = subprocess.run([sys.executable, "-m", "croupier.tools.cli", "chaos", "--workdir", str(workdir), *args],
                         capture_output=True, text=True, timeout=timeout)
    tail = out.stdout[-6000:] + out.stderr[-3000:]
    assert out.returncode == 0, tail
    m = SUMMARY.search(out.stdout)
    assert m, tail
    left = processes_naming(str(workdir))
    assert not left, f"processes left behind: {left}"
    return out, m


# NOTE: the short chaos runs of one coordinator are in make slow. make test keeps the replicated data-center run
# (tests/e2e/test_chaos_dc_replicas.py: rank and replica kills, preemptions, pauses, partitions and slow links,
# audited and checked linearizable), coordinator kill -9 under load (test_crash.py), and a test of its own for
# each data-center fault of one coordinator: pauses, clock jumps, a full disk, partitions, an outage.
@pytest.mark.slow
def test_short_chaos_run_passes_the_audit(tmp_path: pathlib.Path) -> None:
    faults, epochs, n = 6, 2, 1200
    out, m = chaos(tmp_path / "chaos", "--faults", str(faults), "--epochs", str(epochs), "--n", str(n), "--seed", "1",
                   timeout=240)
    assert int(m["faults"]) == faults
    assert int(m["rank"]) > 0 and int(m["coord"]) > 0 and int(m["preempt"]) > 0, m[0]
    assert int(m["rank"]) + int(m["coord"]) + int(m["preempt"]) == faults
    assert int(m["older"]) > 0, m[0]
    assert int(m["epochs"]) == epochs and int(m["samples"]) == epochs * n
    assert int(m["dups"]) == 0 and int(m["missing"]) == 0
    for e in range(epochs):
        assert re.search(rf"^chaos +{e} +{n} +{n} +0 +0  ok: ", out.stdout, re.M), out.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(_faults.available() is not None, reason=f"{_faults.available()}")
def test_short_chaos_run_with_data_center_faults(tmp_path: pathlib.Path) -> None:
    """Pauses of the coordinator and of a worker, clock jumps, a full disk, a partition and a slow, lossy link
    beside the kills, the coordinator and the job on hosts (network namespaces) of their own: one of each
    kind is drawn in the first nine faults (a fault that comes due too near the job's end becomes a
    rollback, so one may be replaced), and the audit is exactly once (make soak runs 1,000)."""
    faults, epochs, n = 9, 4, 1200
    out, m = chaos(tmp_path / "chaos", "--datacenter", "--faults", str(faults), "--epochs", str(epochs), "--n", str(n),
                   "--seed", "1", timeout=400)
    assert int(m["faults"]) == faults and m["pauses"] is not None, m[0]
    assert sum(int(m[k]) for k in ("pauses", "rank_pauses", "jumps", "disks", "partitions", "slow")) >= 5, m[0]
    assert int(m["partitions"]) + int(m["slow"]) >= 1, m[0]
    assert re.search(r"^calls: \d+ joins, grants and checkpoints of the ranks recorded .*: linearizable", out.stdout, re.M)
    assert re.search(r"^history: .*numbered 1\.\.\d+: none twice, none out of order.*no acknowledged join lost",
                     out.stdout, re.M), out.stdout[-2000:]  # the whole journal, read back once the coordinator stopped
    assert int(m["dups"]) == 0 and int(m["missing"]) == 0 and int(m["samples"]) == epochs * n


@pytest.mark.slow  # make slow (the state machine deals both kinds in make test)
@pytest.mark.parametrize("batching", ["tokens", "dynamic"])
def test_short_chaos_run_with_token_budgets_and_dynamic_dealing(tmp_path: pathlib.Path, batching: str) -> None:
    """The same kinds of faults for token-budget batches (batches of varying size) and dynamic dealing (DDP's Join)."""
    faults, epochs, n = 4, 2, 1200
    out, m = chaos(tmp_path / "chaos", "--faults", str(faults), "--epochs", str(epochs), "--n", str(n), "--seed", "1",
                   "--batching", batching, timeout=300)
    assert int(m["faults"]) == faults and int(m["resizes"]) > 0
    assert int(m["epochs"]) == epochs and int(m["samples"]) == epochs * n
    assert int(m["missing"]) == 0
    if batching == "dynamic":  # tail "uneven": nothing may repeat
        assert int(m["dups"]) == 0
    for e in range(epochs):  # tokens' "pad" tail may repeat fewer than W samples of a short last round
        assert re.search(rf"^chaos +{e} +{n} +\d+ +\d+ +0  ok: ", out.stdout, re.M), out.stdout[-3000:]


@pytest.mark.slow
def test_full_chaos_run_100_faults(tmp_path: pathlib.Path) -> None:
    out, m = chaos(tmp_path / "chaos", "--faults", "100", timeout=1800)
    assert int(m["faults"]) == 100
    assert int(m["resizes"]) > 0 and int(m["older"]) > 0
    assert int(m["epochs"]) == 6 and int(m["samples"]) == 6 * 3600
    assert int(m["dups"]) == 0 and int(m["missing"]) == 0


def _source_rows(out: str) -> dict[tuple[int, int], tuple[int, ...]]:
    """The audit's table by source and source epoch: (source, source epoch) -> size, expected, trained, dups, missing."""
    rows = re.findall(r"^ +(\d+) +(\d+) +(\d+) +(\d+) +(\d+) +(\d+) +(\d+)  ok", out, re.M)
    return {(int(r[0]), int(r[1])): tuple(int(x) for x in r[2:]) for r in rows}


# NOTE: make slow; in make test the state machine deals mixtures with amendments through restarts, resizes
# and coordinator losses, and tests/integrations/test_integration_mixture.py runs one on real ranks.
@pytest.mark.slow
def test_short_chaos_run_of_a_mixture_is_exactly_once_per_source_epoch(tmp_path: pathlib.Path) -> None:
    """The same faults over a mixture of three sources whose weights change halfway, the smallest capped at 2 epochs."""
    faults, epochs, n = 6, 2, 1200
    out, m = chaos(tmp_path / "chaos", "--faults", str(faults), "--epochs", str(epochs), "--n", str(n), "--seed", "1",
                   "--mixture", timeout=240)
    assert int(m["faults"]) == faults and int(m["samples"]) == epochs * n
    assert int(m["dups"]) == 0 and int(m["missing"]) == 0
    rows = _source_rows(out.stdout)
    assert "by source and source epoch" in out.stdout and rows, out.stdout[-3000:]
    assert all(dups == 0 and missing == 0 and trained == expected for _, expected, trained, dups, missing in rows.values())
    # the capped source (200 samples) dealt its 2 epochs whole and no more
    assert sorted(e for s, e in rows if s == 2) == [0, 1] and all(rows[(2, e)][1] == 200 for e in (0, 1))
    assert sum(expected for _, expected, _, _, _ in rows.values()) == epochs * n


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["tokens", "dynamic", "mixture"])
def test_chaos_run_30_faults_token_budgets_and_dynamic_dealing(tmp_path: pathlib.Path, batching: str) -> None:
    how = ["--mixture"] if batching == "mixture" else ["--batching", batching]
    out, m = chaos(tmp_path / "chaos", "--faults", "30", "--epochs", "4", "--n", "2400", *how, timeout=1800)
    assert int(m["faults"]) == 30 and int(m["resizes"]) > 0 and int(m["older"]) > 0
    assert int(m["epochs"]) == 4 and int(m["samples"]) == 4 * 2400
    assert int(m["missing"]) == 0
    if batching == "dynamic":
        assert int(m["dups"]) == 0
