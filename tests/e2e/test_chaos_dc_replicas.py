"""`croupier chaos --datacenter --replicas 3`: PostgreSQL, three replicas and the job on hosts of their own, audited."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import sys

import pytest
from _procs import processes_naming

from croupier.harness import _dc_replicas, chaos, linearize

WHY = _dc_replicas.available()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(WHY is not None, reason=f"{WHY}")]

SUMMARY = re.compile(
    r"chaos: (?P<faults>\d+) faults injected \((?P<rank>\d+) rank kills, (?P<replica>\d+) replica kills \(\d+ of the "
    r"first endpoint, \d+ of a replica with active clients\), (?P<db>\d+) database restarts \((?P<fast>\d+) fast, "
    r"(?P<immediate>\d+) immediate\), (?P<replica_pause>\d+) replica pauses, (?P<rank_pause>\d+) rank pauses, "
    r"(?P<db_partition>\d+) replica-database partitions, (?P<job_partition>\d+) job-replica partitions, "
    r"(?P<db_slow>\d+) slow replica-database links, (?P<job_slow>\d+) slow job-replica links, (?P<preempt>\d+) "
    r"preemptions\), \d+ resizes, \d+ restarts from an older checkpoint .*; (?P<samples>\d+) samples audited over "
    r"(?P<epochs>\d+) epochs: (?P<dups>\d+) duplicates, (?P<missing>\d+) missing; G1 holds"
)
NEW = ("replica_pause", "rank_pause", "db_partition", "job_partition", "db_slow", "job_slow")


def _leftovers(work: pathlib.Path, pid: int, out: str) -> list[str]:
    """What the run (process `pid`, which printed `out`) left behind: processes whose command line or environment
    names its workdir or its PostgreSQL directory, that directory, its hosts' network namespaces."""
    m = re.search(r"host=(/\S*croupier-chaos-pg-[^&\s)]+)", out)
    assert m, "the run did not name its database's directory"
    found = [f"directory {m[1]}"] if pathlib.Path(m[1]).exists() else []
    found += processes_naming(str(work), m[1])
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout.split()
    return found + [f"namespace {ns}" for ns in netns if ns.startswith(f"cr{pid % 100000}-")]  # tools/_netns.Hosts.tag


def test_short_replicated_datacenter_run(tmp_path: pathlib.Path) -> None:
    """13 faults, the first one of each kind (the database restarted with both shutdown modes): every sample
    exactly once, every acknowledged join in the journal, the calls linearizable with the replicas' staleness
    bound, nothing left behind; and the same calls with one stale grant planted are not linearizable."""
    work, faults, epochs, n = tmp_path / "chaos", 13, 3, 1200
    proc = subprocess.Popen([sys.executable, "-m", "croupier.tools.cli", "chaos", "--workdir", str(work), "--datacenter",
                             "--replicas", "3", "--faults", str(faults), "--epochs", str(epochs), "--n", str(n), "--seed",
                             "3", "--step-ms", "100"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the run takes its hosts and its database down on SIGTERM
            proc.communicate(timeout=60)
    (tmp_path / "chaos.out").write_text(stdout)
    tail = stdout.replace("\r", "\n")[-6000:] + stderr[-3000:]
    assert proc.returncode == 0, tail
    m = SUMMARY.search(stdout)
    assert m, tail
    left = _leftovers(work, proc.pid, stdout)
    assert not left, f"left behind: {left}"
    assert int(m["faults"]) == faults
    # NOTE: a fault due too near the job's end becomes a preemption that rolls back, so one kind may be missing.
    assert sum(int(m[k]) >= 1 for k in NEW) >= 5 and int(m["replica"]) + int(m["db"]) >= 2, m[0]
    assert int(m["epochs"]) == epochs and int(m["samples"]) == epochs * n
    assert int(m["dups"]) == 0 and int(m["missing"]) == 0
    assert re.search(r"^history: .*numbered 1\.\.\d+: none twice, none out of order.*no acknowledged join lost",
                     stdout, re.M), tail
    assert re.search(r"^calls: \d+ joins, grants and checkpoints .*: linearizable", stdout, re.M), tail
    assert (work / "postgres.log").exists() and all((work / f"replica-{i}.log").exists() for i in range(3))

    # The check can fail: a grant of the generation before the last, answered after the last one's join was
    # acknowledged and past the replicas' staleness bound, as a replica serving from a state it never confirmed.
    calls = linearize.load(sorted(str(f) for f in (work / "calls").glob("*.jsonl")))
    assert linearize.check(calls, stale_s=chaos.STALENESS_S).ok
    joins = [c for c in calls if c.kind == "join" and c.outcome == "ok"]
    last = max(c.generation for c in joins)
    assert last >= 2, "the run opened one generation: nothing to be stale about"
    opened = min(c.returned for c in joins if c.generation == last)
    at = opened + chaos.STALENESS_S + 0.05
    stale = dataclasses.replace(joins[0], process="planted", kind="grant", generation=last - 1, outcome="ok",
                                invoked=at, returned=at + 0.01)
    verdict = linearize.check([*calls, stale], stale_s=chaos.STALENESS_S)
    assert not verdict.ok, "a grant of a replaced generation past the staleness bound was taken as linearizable"


def test_bad_settings_are_refused(tmp_path: pathlib.Path) -> None:
    """The replicated data-center run starts its own database: a store given with it is refused, before the
    workdir is touched."""
    with pytest.raises(ValueError, match="datacenter faults need no store="):
        chaos.main(str(tmp_path / "chaos"), faults=1, store="postgresql://u@127.0.0.1:1/x", replicas=3, datacenter=True)
    assert not (tmp_path / "chaos").exists()
