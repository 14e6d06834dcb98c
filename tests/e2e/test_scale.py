"""A join must not cost O(world): a world of thousands of ranks joins in one storm. And the join storm benchmark runs."""

from __future__ import annotations

import pathlib
import subprocess
import sys
from typing import Any

import pytest

from croupier.core.api import JoinRequest
from croupier.core.cursor import Cursor
from croupier.core.spec import Spec
from croupier.server._decide import decide_join
from croupier.server._events import GenerationOpened
from croupier.server._state import State

ROOT = pathlib.Path(__file__).resolve().parents[2]


class _Counting(dict):  # type: ignore[type-arg]
    """A generation's ``joined`` that counts the entries read by scans and copies of it."""

    reads = 0

    def __iter__(self) -> Any:
        _Counting.reads += len(self)
        return super().__iter__()

    def keys(self) -> Any:
        _Counting.reads += len(self)
        return super().keys()

    def items(self) -> Any:
        _Counting.reads += len(self)
        return super().items()

    def values(self) -> Any:
        _Counting.reads += len(self)
        return super().values()


@pytest.mark.parametrize("resume", [None, Cursor(1, ((40, 4096),))])
def test_a_join_storm_reads_each_joined_rank_a_bounded_number_of_times(resume: Cursor | None) -> None:
    world = 2048
    spec = Spec(n=4096)
    st = State()
    _Counting.reads = 0
    for r in range(world):
        for ev in decide_join(st, JoinRequest("j", spec, "t", world, r, resume, None if resume else 0), 0):
            st.apply(ev)
            if isinstance(ev, GenerationOpened):
                gen = st.jobs["j"].generation
                assert gen is not None
                gen.joined = _Counting(gen.joined)
        got = st.join_result("j", r)  # what each rank's join is answered, its polls included
        assert len(got.waiting_for) <= 16 and got.waiting_count == world - r - 1
    assert st.jobs["j"].generation is not None and st.jobs["j"].generation.start is not None
    # O(world) in all (the generation's start reads every rank once), not O(world) per join: before,
    # each join copied and scanned the ranks joined (about world**2 / 2 = 2 million reads here).
    assert _Counting.reads <= 2 * world, _Counting.reads


def test_a_refused_join_names_the_first_rank_that_disagrees() -> None:
    st = State()
    spec = Spec(n=100)
    for r, e in [(0, 3), (1, 3)]:
        for ev in decide_join(st, JoinRequest("j", spec, "t", 4, r, None, e), 0):
            st.apply(ev)
    with pytest.raises(ValueError, match=r"set_epoch\(4\) on rank 2 disagrees with set_epoch\(3\) on rank 0"):
        decide_join(st, JoinRequest("j", spec, "t", 4, 2, None, 4), 0)
    for ev in decide_join(st, JoinRequest("j", spec, "t", 4, 2, Cursor(3, ((10, 100),)), 3), 0):
        st.apply(ev)
    with pytest.raises(ValueError, match="but rank 2 resumes from"):
        decide_join(st, JoinRequest("j", spec, "t", 4, 3, Cursor(3, ((20, 100),)), None), 0)


@pytest.mark.e2e  # processes: a croupier serve, two drivers of 128 ranks each; a store filled, killed, recovered
def test_the_scale_benchmark_runs_quick(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "scale.md"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale_bench.py"), "--worlds", "128,256", "--drivers", "2",
                          "--jobs", "50", "--events", "20000", "--steady", "256", "--steady-lease", "16",
                          "--steady-step", "0.1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    table = out.read_text()
    assert "| 256 |" in table and "| 50 (" in table and "50 in " in table  # every job listed after the recovery
    steady = next(ln for ln in table.splitlines() if ln.startswith("| 256 | 16 steps"))
    assert "| 160 (160) |" in steady and "| 0 |" in steady  # every rank asked its grant, none failed
    assert out.with_suffix(".png").stat().st_size > 10_000  # the plot


def test_snapshot_every_sets_how_much_journal_a_recovery_replays(tmp_path: pathlib.Path) -> None:
    from croupier.server import ServerOptions
    from croupier.server._service import Server
    from croupier.server._stores import open_store

    with pytest.raises(ValueError, match=r"snapshot_every must be >= 1 \(got snapshot_every=0\)"):
        ServerOptions(snapshot_every=0)
    bad = subprocess.run([sys.executable, "-m", "croupier.tools.cli", "serve", "--port", "0", "--store", "memory://",
                          "--snapshot-every", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "snapshot_every must be >= 1 (got snapshot_every=0)" in bad.stderr
    url = f"sqlite:///{tmp_path}/c.db"
    for every, snapshotted in [(3, True), (1000, False)]:
        (tmp_path / "c.db").unlink(missing_ok=True)
        server = Server(url, options=ServerOptions(snapshot_every=every)).start()
        try:
            for r in range(4):  # a job registered, a generation opened, 4 joins and its start: 7 records
                server.core.join(JoinRequest(f"j{every}", Spec(n=10), "t", 4, r))
        finally:
            server.stop(grace=0.5)
        store = open_store(url)
        try:
            rec = store.load()
        finally:
            store.close()
        assert (rec.snapshot_seq > 0) == snapshotted, (every, rec.snapshot_seq)
        assert len(rec.records) <= every


@pytest.mark.e2e  # a croupier status process against a real coordinator
def test_list_jobs_and_croupier_status_go_by_pages() -> None:
    from croupier.client import CoordinatorClient
    from croupier.core.errors import InvalidArgument as Invalid
    from croupier.server._service import Server

    server = Server("memory://").start()
    try:
        names = [f"job-{i:03d}" for i in range(120)]
        for name in names:
            server.core.join(JoinRequest(name, Spec(n=10), "t", 1, 0))
        with CoordinatorClient(server.address) as c:
            pages, after = [], ""
            while True:
                page, after, total = c.jobs_page(50, after)
                assert total == 120
                pages.append(page)
                if not after:
                    break
            assert [len(p) for p in pages] == [50, 50, 20] and sum(pages, []) == names
            assert c.jobs() == names  # no page size: every one, as before
            with pytest.raises(Invalid, match="page_size must be at most 10000"):
                c.jobs_page(10_001)
        run = subprocess.run([sys.executable, "-m", "croupier.tools.cli", "status", "--address", server.address],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        rows = [ln for ln in run.stdout.splitlines() if ln.startswith("job-")]
        assert len(rows) == 50 and "50 of 120 jobs; the next ones: croupier status --after job-049" in run.stdout
        run = subprocess.run([sys.executable, "-m", "croupier.tools.cli", "status", "--address", server.address,
                              "--after", "job-099", "--limit", "50"], capture_output=True, text=True, timeout=60)
        rows = [ln for ln in run.stdout.splitlines() if ln.startswith("job-")]
        assert rows[0].startswith("job-100") and len(rows) == 20 and "20 of 120 jobs after 'job-099'" in run.stdout
    finally:
        server.stop(grace=0.5)


def test_the_status_page_goes_by_pages_and_reads_only_its_page() -> None:
    import json
    import urllib.error
    import urllib.request

    from croupier.server import ServerOptions
    from croupier.server._service import Server

    server = Server("memory://", options=ServerOptions(metrics_port=0)).start()
    try:
        names = [f"job-{i:03d}" for i in range(120)]
        for name in names:
            server.core.join(JoinRequest(name, Spec(n=10), "t", 1, 0))
        read: list[str] = []
        job = server.core.job
        server.core.job = lambda name: (read.append(name), job(name))[1]  # type: ignore[method-assign]

        def get(query: str) -> dict[str, Any]:
            with urllib.request.urlopen(f"http://{server.metrics_address}/api/jobs{query}", timeout=10) as r:
                return json.loads(r.read())  # type: ignore[no-any-return]

        seen, after = [], ""
        while True:
            body = get(f"?after={after}")
            assert body["total"] == 120
            seen += [j["name"] for j in body["jobs"]]
            if body["next_after"] is None:
                break
            after = body["next_after"]
        assert seen == names and len(read) == 120  # three pages of 50, 50, 20: each job read once
        read.clear()
        assert [j["name"] for j in get("?limit=7&after=job-050")["jobs"]] == names[51:58] and len(read) == 7
        for bad, why in (("0", "limit must be in [1, 10001) (got limit=0)"), ("abc", "limit must be an int (got limit='abc')"),
                         ("10001", "limit must be in [1, 10001) (got limit=10001)")):
            with pytest.raises(urllib.error.HTTPError) as e:
                get(f"?limit={bad}")
            assert e.value.code == 400 and why in e.value.read().decode()
    finally:
        server.stop(grace=0.5)
