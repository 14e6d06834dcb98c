"""Network partitions for real: PostgreSQL, two replicas and the ranks on hosts of their own (Linux network
namespaces behind one router, tests/_netns.py), cut from each other and healed while a rank trains.

The faults, in order: the rank cut from every replica; one replica cut from the database while a new
generation is opened through the other; the database cut from both replicas; a replica cut from the
database with a join in flight through it, healed before the join's deadline. Throughout, a training
rank (a `DistributedBatchSampler` over both replicas, audited) trains epoch after epoch, and a probe
records every call it makes (tools/linearize.py). What must hold: every epoch exactly once; the probe's
history linearizable (grants given the replicas' staleness bound); no acknowledged join missing from
the journal; and the replica cut from the database never answers a grant of the generation replaced
meanwhile (fails if a replica serves from what it knew without confirming it: tried, by making the
watch's confirmation never expire).

The kernel of this machine has no netem, so loss and delay on a link are not among the faults.
"""

from __future__ import annotations

import json
import pathlib
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _netns import Hosts, unavailable_reason
from _postgres import USER, Postgres
from _postgres import unavailable_reason as pg_unavailable

from croupier.server._events import GenerationOpened
from croupier.server._journal import read_journal
from croupier.server._stores import open_store
from croupier.tools.audit import audit
from croupier.tools.linearize import check, load

WHY = unavailable_reason() or pg_unavailable()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(WHY is not None, reason=f"{WHY}")]
HERE = pathlib.Path(__file__).resolve().parent
AGENTS = HERE / "_partition_agents.py"
PORT = 7001
STALE_S = 0.1  # the replicas' --max-staleness-ms, the default


class HostedPostgres(Postgres):
    """The throwaway PostgreSQL server, run in host `name` of `hosts`; administered over its Unix socket."""

    def __init__(self, hosts: Hosts, name: str) -> None:
        super().__init__()
        self.hosts, self.name = hosts, name

    def _run(self, *args: str, check: bool = True, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        if args[0] != "pg_ctl":
            return super()._run(*args, check=check, timeout=timeout)
        import shutil

        cmd = self.hosts.run(self.name, ["runuser", "-u", "postgres", "--", str(self._bindir / "pg_ctl"), *args[1:]]
                             if shutil.which("runuser") and self._as_postgres else [str(self._bindir / "pg_ctl"), *args[1:]])
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=timeout, stdin=subprocess.DEVNULL)
        if check and out.returncode != 0:
            raise RuntimeError(f"pg_ctl failed ({out.returncode}): {out.stdout}{out.stderr}{self._log_tail()}")
        return out

    def _init(self) -> None:
        super()._init()
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(f"listen_addresses = '{self.hosts.addr[self.name]}'\n")
        with (self.data / "pg_hba.conf").open("a") as hba:
            hba.write("host all all 10.233.0.0/16 scram-sha-256\n")

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{USER}:{self.password}@/{dbname}?host={self.root}&port={self.port}"

    def hosted_url(self, dbname: str) -> str:
        """The URL the other hosts reach the database by."""
        return f"postgresql://{USER}:{self.password}@{self.hosts.addr[self.name]}:{self.port}/{dbname}"


class Lines:
    """A process's stdout lines, read by a thread, waited for with a deadline."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.q: queue.Queue[str] = queue.Queue()
        assert proc.stdout is not None
        out = proc.stdout
        threading.Thread(target=lambda: [self.q.put(x) for x in out], daemon=True).start()

    def next(self, timeout: float) -> str:
        return self.q.get(timeout=timeout)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    h = Hosts(["db", "r0", "r1", "rk"])
    try:
        yield h
    finally:
        h.close()


def test_partitions_lose_nothing_and_serve_no_replaced_generation(hosts: Hosts, tmp_path: pathlib.Path) -> None:
    pg = HostedPostgres(hosts, "db")
    procs: list[subprocess.Popen[str]] = []
    try:
        pg.start()
        pg.create_database("croupier")
        store = pg.hosted_url("croupier")
        replicas = {}
        for r in ("r0", "r1"):
            p = subprocess.Popen(hosts.run(r, [sys.executable, "-m", "croupier.tools.cli", "serve", "--host", hosts.addr[r],
                                               "--port", str(PORT), "--store", store]),
                                 stdout=subprocess.PIPE, stderr=open(tmp_path / f"{r}.log", "w"), text=True)
            procs.append(p)
            assert p.stdout is not None and p.stdout.readline().startswith("listening on"), r
            replicas[r] = f"{hosts.addr[r]}:{PORT}"
        stop = tmp_path / "stop"
        # NOTE: the rank asks r1 first, so r0 serves only the probe: in step 2, r0 has no write of the rank's
        # in flight to the database (which would hold its lock until the store's timeout), and what
        # stands between the probe's grant and a stale answer is the replica's staleness bound alone.
        rank = subprocess.Popen(hosts.run("rk", [sys.executable, str(AGENTS), "rank", f"{replicas['r1']},{replicas['r0']}",
                                                  str(tmp_path / "audit"), str(stop)]),
                                stdout=subprocess.PIPE, stderr=open(tmp_path / "rank.log", "w"), text=True)
        procs.append(rank)
        epochs = Lines(rank)
        probe = subprocess.Popen(hosts.run("rk", [sys.executable, str(AGENTS), "probe", str(tmp_path / "probe.jsonl")]),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp_path / "probe.log", "w"),
                                 text=True)
        procs.append(probe)
        answers = Lines(probe)

        def call(op: str, on: str, **kw: Any) -> dict[str, Any]:
            assert probe.stdin is not None
            probe.stdin.write(json.dumps({"op": op, "addr": replicas[on], "job": "p", **kw}) + "\n")
            probe.stdin.flush()
            return json.loads(answers.next(timeout=30))  # type: ignore[no-any-return]

        def until(op: str, on: str, want: str, **kw: Any) -> dict[str, Any]:
            t0 = time.monotonic()
            while (a := call(op, on, **kw))["code"] != want:  # bounded: a replica reconnecting to the database
                assert time.monotonic() - t0 < 60, f"{op} on {on} answered {a} for 60 s, not {want}"
            return a

        assert epochs.next(timeout=120).startswith("EPOCH 0")

        # 1. The rank cut from every replica: it trains on from its plan (an epoch ends during the cut).
        hosts.cut("rk", "r0")
        hosts.cut("rk", "r1")
        assert epochs.next(timeout=60).startswith("EPOCH")
        assert call("join", "r0", token="cut")["code"] != "OK"
        hosts.heal()

        # 2. One replica cut from the database while a new generation is opened through the other.
        old = until("join", "r0", "OK", token="a")["generation"]
        hosts.cut("r0", "db")
        new = until("join", "r1", "OK", token="b")["generation"]
        assert new == old + 1
        time.sleep(3 * STALE_S)  # the scenario: past the bound of what r0 last confirmed
        stale = call("grant", "r0", generation=old)
        assert stale["code"] != "OK", "a replica cut from the database served a generation that was replaced"
        hosts.heal("r0", "db")
        until("grant", "r0", "ABORTED", generation=old)

        # 3. The database cut from both replicas: the rank trains on; joins get no answer.
        hosts.cut("db", "r0")
        hosts.cut("db", "r1")
        assert epochs.next(timeout=60).startswith("EPOCH")
        assert call("join", "r1", token="c")["code"] != "OK"
        hosts.heal()
        until("join", "r1", "OK", token="d")

        # 4. A partition that heals mid-commit: a join in flight through r0 while r0 is cut from the database.
        hosts.cut("r0", "db")
        healer = threading.Timer(1.0, lambda: hosts.heal("r0", "db"))  # heals while the join waits for its commit
        healer.start()
        call("join", "r0", token="e")  # answered or not: the history takes either
        healer.join()
        until("grant", "r1", "OK", generation=until("join", "r1", "OK", token="f")["generation"])

        stop.touch()
        rank.wait(timeout=120)
        assert rank.returncode == 0, (tmp_path / "rank.log").read_text()[-3000:]
    except BaseException:
        pg.close()
        raise
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        hosts.heal()
    try:
        reports = audit(tmp_path / "audit")
        assert reports and all(r.ok and r.finished and r.duplicates == 0 and r.missing == 0 for r in reports), reports
        calls = load([str(tmp_path / "probe.jsonl")])
        verdict = check(calls, stale_s=STALE_S)
        assert verdict.ok, verdict.why
        s = open_store(pg.url("croupier"))
        try:
            opened = {e.generation for _, e in read_journal(s).events if isinstance(e, GenerationOpened) and e.job == "p"}
        finally:
            s.close()
        acked = {c.generation for c in calls if c.kind == "join" and c.outcome == "ok"}
        assert acked and acked <= opened, f"acknowledged generations {sorted(acked - opened)} are not in the journal"
    finally:
        pg.close()
