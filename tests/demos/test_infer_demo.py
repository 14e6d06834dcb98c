"""`croupier infer-demo`: exactly-once batch inference under worker kills, resizes and coordinator kills, and its audit."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from typing import Any

import pytest

from croupier.core.api import JoinRequest
from croupier.core.spec import Spec
from croupier.demos.infer_audit import JOB, Journal, audit
from croupier.server._coordinator import Coordinator
from croupier.server._stores import open_store

N, BATCH, FAULTS = 2000, 4, 5
SUMMARY = re.compile(r"infer-demo: (?P<n>\d+) samples audited: (?P<valid>\d+) committed outputs, (?P<dups>\d+) duplicates, "
                     r"(?P<missing>\d+) missing, (?P<discarded>\d+) lines discarded as uncommitted; (?P<faults>\d+) faults")


def _left_behind(workdir: pathlib.Path) -> list[str]:
    """Processes whose command line mentions `workdir` (workers and coordinators of the run)."""
    needle = str(workdir).encode()
    found = []
    for d in pathlib.Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmdline = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if needle in cmdline:
                found.append(f"{d.name}: {cmdline.replace(bytes(1), b' ').decode(errors='replace')}")
    return found


pytestmark = pytest.mark.xdist_group("infer_demo")  # its end-to-end tests resume one module-scoped run: one worker runs them all (make test's --dist loadgroup)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, subprocess.CompletedProcess[str], float]:
    """One short run of the demo (5 faults: worker kills, resizes and a coordinator kill -9); its workdir, output, seconds."""
    work = tmp_path_factory.mktemp("infer") / "demo"
    began = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "croupier.tools.cli", "infer-demo", "--workdir", str(work), "--n", str(N),
                          "--batch-size", str(BATCH), "--faults", str(FAULTS), "--seed", "3", "--batch-ms", "10"],
                         capture_output=True, text=True, timeout=180, check=False)
    return work, out, time.monotonic() - began


@pytest.mark.e2e
def test_the_demo_is_exactly_once_under_faults(demo_run: tuple[pathlib.Path, subprocess.CompletedProcess[str], float]) -> None:
    work, out, seconds = demo_run
    tail = out.stdout[-5000:] + out.stderr[-3000:]
    assert out.returncode == 0, tail
    assert "infer-demo: exactly once holds" in out.stdout, tail
    m = SUMMARY.search(out.stdout)
    assert m and int(m["n"]) == N and int(m["valid"]) == N and int(m["dups"]) == 0 and int(m["missing"]) == 0, tail
    fig: dict[str, Any] = json.loads((work / "summary.json").read_text())
    a = fig["audit"]
    assert (a["samples"], a["valid"], a["duplicates"], a["missing"], a["wrong"], a["violations"]) == (N, N, 0, 0, 0, [])
    assert a["lines"] == a["valid"] + a["discarded"]
    faults = fig["faults"]
    assert fig["faults_total"] == FAULTS and int(m["faults"]) == FAULTS
    assert faults.get("coordinator", 0) >= 1 and faults.get("kill", 0) >= 1, faults
    assert faults.get("add", 0) + faults.get("remove", 0) >= 1, faults
    relaunches = FAULTS - faults["coordinator"]
    assert fig["generations"] == fig["launches"] == 1 + relaunches
    assert all(1 <= w <= 4 for w in fig["worlds"])
    # the workers rode through every coordinator kill: each running one committed again after it
    assert fig["riders"] >= 1 and fig["rode_through"] == fig["riders"], fig
    assert fig["worker_failures"] == [] and fig["coordinator_deaths"] == []
    assert fig["journal_reads"] >= 1 + relaunches
    assert fig["snapshots_read"] >= 1  # ~3 journal records per batch: the coordinator snapshotted, and pruned
    assert not _left_behind(work), _left_behind(work)
    print(f"the demo took {seconds:.0f} s")


def _copy(demo_run: tuple[pathlib.Path, subprocess.CompletedProcess[str], float], tmp_path: pathlib.Path
          ) -> tuple[pathlib.Path, Journal]:
    work, out, _ = demo_run
    if out.returncode != 0:
        pytest.skip("the demo run failed (see test_the_demo_is_exactly_once_under_faults)")
    outputs = tmp_path / "outputs"
    shutil.copytree(work / "outputs", outputs)
    journal = Journal.load(work / "journal.json")
    assert audit(outputs, journal, N).ok
    return outputs, journal


def _committed_files(outputs: pathlib.Path, journal: Journal) -> list[tuple[pathlib.Path, int]]:
    """Output files with at least one committed batch, and how many."""
    out = []
    for p in sorted(outputs.glob("*.jsonl")):
        incarnation, _, rank = p.stem.rpartition("-r")
        k = journal.committed(journal.generations[incarnation], int(rank))
        if k:
            out.append((p, k))
    return out


def _lines(path: pathlib.Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _append(path: pathlib.Path, recs: list[dict[str, Any]]) -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))


@pytest.mark.e2e
def test_the_audit_catches_a_batch_written_twice(demo_run: tuple[pathlib.Path, subprocess.CompletedProcess[str], float],
                                                 tmp_path: pathlib.Path) -> None:
    """A committed batch's lines copied into another worker's file, inside its committed range."""
    outputs, journal = _copy(demo_run, tmp_path)
    (a, _), (b, _) = _committed_files(outputs, journal)[:2]
    batch = [r for r in _lines(a) if r["seq"] == 0]
    _append(b, [{**r, "seq": 0} for r in batch])
    result = audit(outputs, journal, N)
    assert not result.ok and result.duplicates == len(batch) and result.missing == 0
    assert [v for v in result.violations if v.startswith("duplicates:")], result.violations


@pytest.mark.e2e
def test_the_audit_catches_a_lost_output(demo_run: tuple[pathlib.Path, subprocess.CompletedProcess[str], float],
                                         tmp_path: pathlib.Path) -> None:
    """One committed output line deleted."""
    outputs, journal = _copy(demo_run, tmp_path)
    path, _ = _committed_files(outputs, journal)[-1]
    lines = path.read_text().splitlines(keepends=True)
    gone = json.loads(lines[0])["index"]
    path.write_text("".join(lines[1:]))
    result = audit(outputs, journal, N)
    assert not result.ok and result.missing == 1 and result.duplicates == 0
    assert [v for v in result.violations if v.startswith("missing:") and f"[{gone}]" in v], result.violations


@pytest.mark.e2e
def test_uncommitted_and_torn_lines_are_discarded(demo_run: tuple[pathlib.Path, subprocess.CompletedProcess[str], float],
                                                  tmp_path: pathlib.Path) -> None:
    """Lines of a batch past the committed count (a worker killed before its commit), and a torn last line, do not count."""
    outputs, journal = _copy(demo_run, tmp_path)
    before = audit(outputs, journal, N)
    path, k = _committed_files(outputs, journal)[0]
    redone = [r for r in _lines(path) if r["seq"] == 0]
    _append(path, [{**r, "seq": k} for r in redone])
    with open(path, "a") as f:
        f.write(json.dumps({"seq": k + 1, "index": 1})[:-4])  # killed in the middle of a write
    result = audit(outputs, journal, N)
    assert result.ok, result.violations
    assert (result.discarded, result.torn) == (before.discarded + len(redone) + 1, before.torn + 1)
    assert (result.valid, result.duplicates, result.missing) == (N, 0, 0)


@pytest.mark.e2e
def test_the_audit_catches_outputs_of_an_unknown_generation(
        demo_run: tuple[pathlib.Path, subprocess.CompletedProcess[str], float], tmp_path: pathlib.Path) -> None:
    outputs, journal = _copy(demo_run, tmp_path)
    _append(outputs / "rogue-r0.jsonl", [{"seq": 0, "index": 0, "output": "x"}])
    result = audit(outputs, journal, N)
    assert [v for v in result.violations if v.startswith("unknown incarnation:") and "'rogue'" in v], result.violations


def test_the_journal_keeps_commits_that_a_snapshot_pruned(tmp_path: pathlib.Path) -> None:
    """Commits are read from the records and from the snapshot; a read at the end of each generation misses none."""
    url = f"sqlite:///{tmp_path}/j.db"
    spec = Spec(n=400, batch_size=8, tail="uneven", dealing="dynamic")
    journal = Journal()

    def generation(incarnation: str, number: int, world: int, per_rank: int, resume: Any) -> Any:
        core = Coordinator(open_store(url), snapshot_every=5)
        for r in range(world):
            core.join(JoinRequest(JOB, spec, incarnation, world, r, resume))
        cursor = None
        for r in range(world):
            for k in range(per_rank):
                core.grant(JOB, number, r, 0, k, 1)
                cursor = core.report(JOB, number, r, 0, k + 1, (None, None, f"{incarnation}/0/{k + 1}"), lockstep=False)
        core.close()
        journal.read(url)  # the coordinator is down: read its store
        return cursor

    cursor = generation("t1", 1, 2, 4, None)
    generation("t2", 2, 3, 3, cursor)
    assert journal.generations == {"t1": 1, "t2": 2} and journal.worlds == {1: 2, 2: 3}
    assert {k: journal.committed(*map(int, k.split("/"))) for k in journal.commits} == {
        "1/0": 4, "1/1": 4, "2/0": 3, "2/1": 3, "2/2": 3}
    assert journal.snapshots == 2  # both reads found a snapshot: records before it were pruned
    last = Journal()
    last.read(url)
    assert "1/0" not in last.commits  # one read at the end alone would not see the first generation's commits
    journal.save(tmp_path / "journal.json")
    assert Journal.load(tmp_path / "journal.json") == journal
