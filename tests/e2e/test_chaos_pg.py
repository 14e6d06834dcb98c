"""`croupier chaos` replicated: three replicas on a real PostgreSQL under replica kills and database restarts, audited."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest
from _procs import processes_naming

from croupier.harness import chaos
from croupier.server import GenerationOpened, GenerationStarted, open_store, read_journal

if TYPE_CHECKING:
    from _postgres import Postgres  # the plugin imports it first (pytest_plugins below)

pytestmark = pytest.mark.e2e  # several processes
pytest_plugins = ["_postgres"]

SUMMARY = re.compile(
    r"chaos: (?P<faults>\d+) faults injected \((?P<rank>\d+) rank kills, (?P<replica>\d+) replica kills "
    r"\((?P<first>\d+) of the first endpoint, (?P<busy>\d+) of a replica with active clients\), (?P<db>\d+) database "
    r"restarts \((?P<fast>\d+) fast, (?P<immediate>\d+) immediate\), (?P<preempt>\d+) preemptions\), "
    r"(?P<resizes>\d+) resizes, (?P<older>\d+) restarts from an older checkpoint .*; (?P<samples>\d+) samples audited "
    r"over (?P<epochs>\d+) epochs: (?P<dups>\d+) duplicates, (?P<missing>\d+) missing; G1 holds"
)
HISTORY = re.compile(r"history: (?P<gens>\d+) generations of job 'chaos' opened in journal order, numbered "
                     r"1\.\.(?P=gens): none twice, none out of order, .* (?P<acked>\d+) acknowledged joins .*"
                     r"no acknowledged join lost")


def _journal(url: str) -> tuple[list[tuple[int, str]], set[int]]:
    """(number, incarnation) of every generation job 'chaos' opened, in journal order, and the generations started."""
    store = open_store(url)
    try:
        rec = read_journal(store)  # every record: load() would start after the latest snapshot
    finally:
        store.close()
    assert rec.snapshot is None, "the journal was pruned: the run is too long for this check"
    opened, started = [], set()
    for _, ev in rec.events:
        if isinstance(ev, GenerationOpened) and ev.job == chaos.JOB:
            opened.append((ev.generation, ev.incarnation))
        elif isinstance(ev, GenerationStarted) and ev.job == chaos.JOB:
            assert ev.generation in {g for g, _ in opened}, f"generation {ev.generation} started before it opened"
            started.add(ev.generation)
    return opened, started


def _replicated_run(work: pathlib.Path, url: str, pg: Postgres, capsys: pytest.CaptureFixture[str], *, faults: int,
                    epochs: int, n: int, seed: int) -> re.Match[str]:
    """A replicated chaos run, in this process (the database control is the test's server); checks it passed."""
    code = chaos.main(str(work), faults=faults, epochs=epochs, n=n, seed=seed, store=url, replicas=3, database=pg)
    out = capsys.readouterr().out
    (work / "chaos.out").write_text(out)  # for a look afterwards: the faults and where they landed
    tail = out.replace("\r", "\n")[-6000:]
    assert code == 0, tail
    m, h = SUMMARY.search(out), HISTORY.search(out)
    assert m and h, tail
    assert not processes_naming(str(work), url), "processes left behind"
    assert int(m["faults"]) == faults
    assert int(m["rank"]) + int(m["replica"]) + int(m["db"]) + int(m["preempt"]) == faults
    assert int(m["first"]) >= 1 and int(m["busy"]) >= 1, m[0]  # the endpoint every rank uses first, in use
    assert int(m["fast"]) >= 1 and int(m["immediate"]) >= 1, m[0]
    assert int(m["epochs"]) == epochs and int(m["samples"]) == epochs * n
    assert int(m["dups"]) == 0 and int(m["missing"]) == 0
    for e in range(epochs):
        assert re.search(rf"^chaos +{e} +{n} +{n} +0 +0  ok: ", out, re.M), tail

    # The history, checked again here from the journal and the ranks' records, apart from the run's checker.
    opened, started = _journal(url)
    assert [g for g, _ in opened] == list(range(1, len(opened) + 1)), f"accepted twice or out of order: {opened}"
    assert len({t for _, t in opened}) == len(opened), "an incarnation opened two generations"
    acked = {(j["incarnation"], j["generation"]) for j in map(json.loads, (work / "joins.jsonl").read_text().splitlines())}
    assert acked, "no rank recorded its join"
    assert acked <= {(t, g) for g, t in opened}, f"acknowledged joins lost: {sorted(acked - {(t, g) for g, t in opened})[:5]}"
    assert {g for _, g in acked} <= started
    assert int(h["gens"]) == len(opened) and int(h["acked"]) == len(acked)
    return m


# NOTE: make slow; make test keeps tests/e2e/test_chaos_dc_replicas.py, which runs the same faults (the replica
# every rank calls first killed, PostgreSQL restarted fast and immediate, ranks killed, preemptions) and the
# network's, with the same checks of the journal.
@pytest.mark.slow
def test_short_replicated_chaos_run(tmp_path: pathlib.Path, postgres: Postgres, postgres_url: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Ten faults: the replica every rank calls first killed, PostgreSQL restarted (fast, then immediate), ranks
    killed, the job preempted and resized; every sample exactly once, every acknowledged join in the journal."""
    m = _replicated_run(tmp_path / "chaos", postgres_url, postgres, capsys, faults=10, epochs=2, n=1200, seed=8)
    assert int(m["rank"]) > 0 and int(m["preempt"]) > 0, m[0]


def test_the_command_line_runs_without_database_faults(tmp_path: pathlib.Path, postgres_url: str) -> None:
    """`croupier chaos --store --replicas` has no control of the database: it says so and kills replicas only."""
    work = tmp_path / "chaos"
    out = subprocess.run([sys.executable, "-m", "croupier.tools.cli", "chaos", "--workdir", str(work), "--store",
                          postgres_url, "--replicas", "2", "--faults", "1", "--epochs", "1", "--n", "480",
                          "--seed", "0"], capture_output=True, text=True, timeout=240)
    tail = out.stdout.replace("\r", "\n")[-4000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    assert "no database faults" in out.stdout, tail
    m = SUMMARY.search(out.stdout)
    assert m and HISTORY.search(out.stdout), tail
    assert (int(m["faults"]), int(m["replica"]), int(m["db"])) == (1, 1, 0), m[0]
    assert int(m["dups"]) == 0 and int(m["missing"]) == 0
    assert postgres_url.split(":")[2].split("@")[0] not in out.stdout + out.stderr, "the password was printed"
    assert not processes_naming(str(work), postgres_url), "processes left behind"


def test_a_database_that_holds_a_journal_is_refused(tmp_path: pathlib.Path, postgres_url: str) -> None:
    store = open_store(postgres_url)
    try:
        store.append([b"\x80"])  # any record: the history check needs a journal of the run's own
    finally:
        store.close()
    with pytest.raises(ValueError, match="already holds a journal"):
        chaos.main(str(tmp_path / "chaos"), faults=1, store=postgres_url, replicas=3)
    with pytest.raises(ValueError, match="postgresql:// URL"):
        chaos.main(str(tmp_path / "chaos"), faults=1, store=f"sqlite:///{tmp_path}/x.db", replicas=3)
    with pytest.raises(ValueError, match="shared store"):
        chaos.main(str(tmp_path / "chaos"), faults=1, replicas=3)
    assert not (tmp_path / "chaos").exists()  # refused before the workdir was touched


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_full_replicated_chaos_run_60_faults(tmp_path: pathlib.Path, postgres: Postgres, postgres_url: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    m = _replicated_run(tmp_path / "chaos", postgres_url, postgres, capsys, faults=60, epochs=6, n=3600, seed=2)
    assert int(m["resizes"]) > 0 and int(m["older"]) > 0 and int(m["rank"]) > 0 and int(m["preempt"]) > 0, m[0]
    assert int(m["replica"]) >= 5 and int(m["db"]) >= 4, m[0]
