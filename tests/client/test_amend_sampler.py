"""A running mixture changed through the samplers and the coordinator: samples skipped, weights set and a source
grown mid-run, then a resume 4 -> 3 audited exactly once per source epoch; the coordinator's decisions and refusals."""

from __future__ import annotations

import collections
import pathlib
import subprocess
import sys

import pytest

from croupier.client import DistributedSampler
from croupier.core.amend import Amendment
from croupier.core.api import JoinRequest
from croupier.core.cursor import Cursor
from croupier.core.errors import FailedPrecondition, InvalidArgument, NotFound
from croupier.core.mixture import PARTS, parts_of
from croupier.core.spec import Spec
from croupier.server._decide import decide_amend, decide_join, decide_report
from croupier.server._service import Server
from croupier.server._state import State
from croupier.tools.audit import audit, by_source, render_sources, verdict
from croupier.tools.status import job_lines

N, SOURCES, GROWN = 240, [30, 90, 400], [40, 90, 400]
WEIGHTS = [5, 3, 2]
#: samples of source 2 (indices 120 + j in the job's numbering before the grow, 130 + j after it)
SKIP = [120 + 7, 120 + 211, 120 + 399]


def _generation(server: Server, logdir: pathlib.Path, world: int, incarnation: str, sources: list[int], state: dict | None,
                epochs: int, stop_at: int | None = None, save_at: int | None = None,
                during=None, job: str = "amend") -> tuple[dict, dict[int, list[int]]]:
    from _ranks import on_ranks

    saved: dict = {}
    seen: dict[int, list[int]] = collections.defaultdict(list)

    def rank(r: int) -> None:
        s = DistributedSampler(N, world, r, address=server.address, job=job, incarnation=incarnation, tail="uneven",
                               sources=sources, weights=WEIGHTS, audit_dir=str(logdir), lease_ahead=8)
        if state:
            s.load_state_dict(state)
        for _ in range(epochs):
            for k, i in enumerate(s, 1):
                seen[r].append(int(i))
                if k == save_at and r == 0:
                    saved.update(s.state_dict())
                if k == 5 and r == 0 and during is not None:
                    during(s)
                if k == stop_at:
                    s.close()
                    return
        s.close()

    on_ranks(world, rank)
    return saved, seen


def _changes(s: DistributedSampler) -> None:
    """What a trainer does mid-run: takes three corrupt samples out, anneals the weights, appends to source 0."""
    assert s.skip(SKIP).kind == "skip"
    assert s.set_weights([1, 1, 8]).values == parts_of([1, 1, 8])
    grown = s.grow(0, 40)
    assert grown.values == (0, 30, 40) and grown.at is None  # pending until the next generation


@pytest.mark.e2e
def test_skips_weights_and_a_grow_mid_run_then_a_resume_4_to_3_is_exactly_once_per_source_epoch(
        server: Server, tmp_path: pathlib.Path) -> None:
    ck, _ = _generation(server, tmp_path, 4, "g1", SOURCES, None, 1, stop_at=30, save_at=20, during=_changes)
    # The running generation deals by the rules it started with: the changes wait for the next one.
    st = server.core.job("amend")
    assert [a.kind for a in st.amendments] == ["skip", "weights", "grow"] and all(a.at is None for a in st.amendments)
    # The restarted job is made on the grown dataset (source 0 has 40 samples now), on 3 ranks.
    ck2, seen = _generation(server, tmp_path, 3, "g2", GROWN, ck, 2, save_at=60)
    held = server.core.job("amend").amendments
    at = held[0].at
    assert at is not None and all(a.at == at for a in held)
    assert at == ck["epoch"] * N + ck["remaining"][0][0]  # the first position the resumed generation dealt
    # The skipped samples (numbered on the grown sizes now: +10) never came again.
    trained = [i for r in seen.values() for i in r]
    assert not {i + 10 for i in SKIP} & set(trained)
    reports = audit(tmp_path)
    ok, summary = verdict(reports)
    assert ok, summary + "\n" + "\n".join(r.why for r in reports)
    rows = by_source(reports)
    assert all(r.duplicates == 0 and r.missing == 0 for r in rows), render_sources(rows)
    # Source 2's epoch 0 was going on when its samples were skipped: they are counted as skipped, not missing.
    assert [(r.source, r.source_epoch, r.skipped) for r in rows if r.skipped] == [(2, 0, 3)]
    # Source 0 grew: the source epoch in progress kept its 30, the ones after deal 40.
    sizes0 = {r.source_epoch: r.size for r in rows if r.source == 0}
    first_grown = min(e for e, n in sizes0.items() if n == 40)
    assert all(n == 30 for e, n in sizes0.items() if e < first_grown) and first_grown >= 1
    assert "skipped" in render_sources(rows)
    # The state the resumed job saves carries its amendments and the job's own sizes.
    assert ck2["sources"] == SOURCES and [a[0] for a in ck2["amendments"]] == ["skip", "weights", "grow"]


@pytest.mark.e2e
def test_a_coordinator_that_lost_its_store_takes_the_amendments_back_from_the_checkpoint(
        server: Server, tmp_path: pathlib.Path) -> None:
    _, _ = _generation(server, tmp_path / "a", 2, "g1", SOURCES, None, 1, stop_at=12, during=_changes)
    ck, _ = _generation(server, tmp_path / "a", 2, "g2", GROWN, None, 1, save_at=10, stop_at=10)
    assert ck["amendments"]
    again, on_old = _generation(server, tmp_path / "b", 2, "g3", GROWN, ck, 1)
    fresh = Server(f"sqlite:///{tmp_path}/other.db").start()  # the store is gone: a new, empty coordinator
    try:
        _, on_new = _generation(fresh, tmp_path / "c", 2, "g1", GROWN, ck, 1)
        assert [a.at for a in fresh.core.job("amend").amendments] == [a[2] for a in ck["amendments"]]
    finally:
        fresh.stop(grace=0.5)
    assert on_new == on_old  # the same rest of the epoch, rank by rank


def test_a_skip_after_a_pending_grow_takes_out_the_sample_handed_out_and_epochs_keep_the_registered_length(
        server: Server) -> None:
    """One rank, sources of 997, 401 and 113: after grow(1, 431), skip([1438]) names source 2's sample 40, as
    the sampler handed it out (the grow is pending); resumed on the grown dataset, that sample is never dealt,
    every other one of source 2 is, and an epoch is still the 1,511 positions the job was registered with."""
    sources, grown = [997, 401, 113], [997, 431, 113]

    def sampler(sizes: list[int], incarnation: str) -> DistributedSampler:
        return DistributedSampler(sum(sizes), 1, 0, address=server.address, job="numbering", incarnation=incarnation,
                                  tail="uneven", sources=sizes, weights=[1, 1, 1], lease_ahead=8)

    s = sampler(sources, "g1")
    it = iter(s)
    handed = [int(next(it)) for _ in range(40)]
    assert s.grow(1, 431) == Amendment("grow", (1, 401, 431))
    assert s.skip([1438]).pairs == [(2, 40)]
    state = s.state_dict()
    s.close()
    r = sampler(grown, "g2")
    r.load_state_dict(state)
    assert len(r) == 1511  # the registered epoch, not len(dataset) of the grown sources (1,541)
    rest = [int(i) for i in r]
    r.set_epoch(state["epoch"] + 1)
    assert len(r) == 1511
    nxt = [int(i) for i in r]
    r.close()
    assert len(handed) + len(rest) == 1511 and len(nxt) == 1511
    source2 = {i - 1428 for i in rest + nxt if i >= 1428}  # source 2's samples, numbered on the grown sources
    assert 40 not in source2 and source2 == set(range(113)) - {40}
    st = server.core.job("numbering")
    assert "sources: 997, 431, 113 samples (1541 indices)" in "\n".join(job_lines("numbering", st, 0))


# --------------------------------------------------------------------------- the coordinator's decisions


MIX = Spec(n=100, sources=(30, 70), weights=((0, parts_of([1, 1])),))


def _started(spec: Spec = MIX, resume: Cursor | None = None, incarnation: str = "t1", world: int = 1,
             state: State | None = None, amendments: tuple[Amendment, ...] = ()) -> State:
    st = state or State()
    for r in range(world):
        for ev in decide_join(st, JoinRequest("j", spec, incarnation, world, r, resume, amendments=amendments), 0):
            st.apply(ev)
    return st


def test_an_amendment_waits_for_the_next_generation_and_holds_from_its_first_position() -> None:
    st = _started()
    a, events = decide_amend(st, "j", "skip", [3, 40])
    assert a.pairs == [(0, 3), (1, 10)] and a.at is None
    for ev in events:
        st.apply(ev)
    assert st.jobs["j"].dealing_spec == MIX  # the running generation is not changed
    _started(resume=Cursor(2, ((37, 100),)), incarnation="t2", state=st)
    assert [x.at for x in st.jobs["j"].held] == [2 * 100 + 37]
    assert st.jobs["j"].dealing_spec.amendments == (Amendment("skip", (0, 3, 1, 10), 237),)
    # Resumed from an older checkpoint that holds none, every change holds from where it resumes.
    _, events = decide_amend(st, "j", "weights", parts_of([1, 3]))
    for ev in events:
        st.apply(ev)
    _started(resume=Cursor(1, ((5, 100),)), incarnation="t3", state=st)
    assert [x.at for x in st.jobs["j"].held] == [105, 105]
    # Resumed from a checkpoint that holds the first: its position stays, the other holds from the resume.
    _started(resume=Cursor(2, ((50, 100),)), incarnation="t4", state=st, amendments=(Amendment("skip", (0, 3, 1, 10), 237),))
    assert [x.at for x in st.jobs["j"].held] == [237, 250]
    # A snapshot holds them.
    back = State.restore(st.snapshot()).jobs["j"]
    assert (back.amendments, back.held) == (st.jobs["j"].amendments, st.jobs["j"].held)


@pytest.mark.parametrize("job, kind, values, error, words", [
    ("nope", "skip", [1], NotFound, "not known"),
    ("j", "weights", [1, 2], InvalidArgument, "adding up to"),
    ("j", "weights", list(parts_of([1, 2, 3])), InvalidArgument, "the job has 2 sources; 3 weights given$"),
    ("j", "grow", [0, 20], InvalidArgument, "only grows"),
    ("j", "grow", [2, 200], InvalidArgument, "source 2 is not one"),
    ("j", "skip", [100], InvalidArgument, "index 100 is not in the dataset"),
    ("j", "skip", list(range(30)), InvalidArgument, "none to deal"),
    ("plain", "skip", [1], FailedPrecondition, "not a mixture"),
])
def test_a_bad_amendment_is_refused_by_name_and_changes_nothing(job: str, kind: str, values: list[int],
                                                                 error: type, words: str) -> None:
    st = _started()
    for ev in decide_join(st, JoinRequest("plain", Spec(n=10), "p", 1, 0), 0):
        st.apply(ev)
    before = st.snapshot()
    with pytest.raises(error, match=words):
        decide_amend(st, job, kind, values)
    assert st.snapshot() == before


def test_a_lost_store_takes_a_checkpoints_amendments_back_and_ranks_must_agree_on_them() -> None:
    st = _started()
    for ev in decide_amend(st, "j", "skip", [2])[1]:  # recorded since the store was lost
        st.apply(ev)
    mine = (Amendment("skip", (0, 1), 50),)
    _started(resume=Cursor(0, ((60, 100),)), incarnation="t2", state=st, amendments=mine)
    assert st.jobs["j"].held == (*mine, Amendment("skip", (0, 2), 60))
    assert [a.values for a in st.jobs["j"].amendments] == [(0, 2), (0, 1)]
    other = (Amendment("skip", (0, 3), 50),)
    for ev in decide_join(st, JoinRequest("j", MIX, "t3", 2, 0, Cursor(0, ((60, 100),)), amendments=mine), 0):
        st.apply(ev)
    with pytest.raises(FailedPrecondition, match="every rank must load the same checkpoint"):
        decide_join(st, JoinRequest("j", MIX, "t3", 2, 1, Cursor(0, ((60, 100),)), amendments=other), 0)


def test_a_grown_rank_spec_is_the_job_spec_and_other_sizes_are_refused() -> None:
    st = _started()
    for ev in decide_amend(st, "j", "grow", [1, 80])[1]:
        st.apply(ev)
    grown = Spec(n=110, sources=(30, 80), weights=MIX.weights)  # a ConcatDataset of the grown sources
    for ev in decide_join(st, JoinRequest("j", grown, "t2", 1, 0), 0):
        st.apply(ev)
    assert st.join_result("j", 0).spec == MIX and st.jobs["j"].spec == MIX
    with pytest.raises(FailedPrecondition, match="different spec"):
        decide_join(st, JoinRequest("j", Spec(n=110, sources=(30, 81), weights=MIX.weights), "t3", 1, 0), 0)


def test_a_skip_reads_indices_as_the_ranks_hand_them_out_whatever_grows_are_pending() -> None:
    st = _started()
    for ev in decide_amend(st, "j", "grow", [0, 40])[1]:  # pending: the ranks still deal sources of (30, 70)
        st.apply(ev)
    a, events = decide_amend(st, "j", "skip", [35])
    assert a.pairs == [(1, 5)]  # not (0, 35), which index 35 names once the grow holds
    for ev in events:
        st.apply(ev)
    _started(incarnation="t2", state=st)  # the next generation holds the grow: sources of (40, 70) now
    assert decide_amend(st, "j", "skip", [35])[0].pairs == [(0, 35)]
    for ev in decide_join(st, JoinRequest("j", MIX, "t3", 2, 0), 0):  # a generation waiting for rank 1
        st.apply(ev)
    for ev in decide_amend(st, "j", "grow", [1, 75])[1]:
        st.apply(ev)
    # It will hold every grow recorded from its start: its ranks hand out sources of (40, 75).
    assert decide_amend(st, "j", "skip", [114])[0].pairs == [(1, 74)]


def test_a_join_settles_its_amendments_in_one_step_after_the_rank_is_in() -> None:
    """A lost store: the checkpoint's amendments are taken back, loaded and held, in that order, after the
    rank joined and the generation started."""
    ck = (Amendment("skip", (0, 1), 50),)
    events = decide_join(State(), JoinRequest("j", MIX, "t1", 1, 0, Cursor(0, ((60, 100),)), amendments=ck), 0)
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["JobRegistered", "GenerationOpened", "RankJoined", "GenerationStarted", "AmendmentRecorded",
                     "AmendmentsLoaded", "GenerationAmended"]


def test_the_hold_position_follows_the_resume_point() -> None:
    for start, at in [(None, 0), (Cursor(3, ((0, 100),)), 300), (Cursor(3, ((40, 100),)), 340),
                      (Cursor(3, ((10, 20), (40, 90))), 400)]:
        st = _started()
        for ev in decide_amend(st, "j", "weights", [PARTS // 2, PARTS // 2])[1]:
            st.apply(ev)
        _started(resume=start, incarnation="t2", state=st)
        assert st.jobs["j"].held[0].at == at, start


# --------------------------------------------------------------------------- the command line


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "croupier.tools.cli", *args], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.e2e
def test_croupier_skip_and_amend_record_changes_and_refuse_bad_ones_by_name(server: Server) -> None:
    from croupier.client import CoordinatorClient

    with CoordinatorClient(server.address) as c:
        c.join_started(JoinRequest("cli", MIX, "t1", 1, 0))
    ok = _cli("skip", "cli", "3", "40", "--address", server.address)
    assert ok.returncode == 0, ok.stderr
    assert "recorded skip 2 samples, (source, sample) (0, 3), (1, 10) (pending)" in ok.stdout
    assert "next generation" in ok.stdout and "skipped: source 0, sample 3\n  skipped: source 1, sample 10\n" in ok.stdout
    assert _cli("amend", "cli", "--weights", "1,3", "--address", server.address).returncode == 0
    assert _cli("amend", "cli", "--grow", "1", "90", "--address", server.address).returncode == 0
    before = server.core.snapshot_state()
    bad = _cli("skip", "cli", "3", "--address", server.address)
    assert bad.returncode == 1 and "index 3 (source 0, sample 3) is skipped already" in bad.stderr
    bad = _cli("amend", "cli", "--grow", "1", "50", "--address", server.address)
    assert bad.returncode == 1 and "only grows" in bad.stderr
    bad = _cli("skip", "cli", "100", "--address", server.address)  # the grow to 90 is pending: no index 100 yet
    assert bad.returncode == 1 and "indices are in [0, 100) (sources of 30, 70 samples)" in bad.stderr
    bad = _cli("amend", "cli", "--address", server.address)
    assert bad.returncode == 2 and "takes one change" in bad.stderr
    bad = _cli("amend", "cli", "--weights", "1,x", "--address", server.address)
    assert bad.returncode == 2 and "weights takes numbers" in bad.stderr
    assert server.core.snapshot_state() == before
    assert [a.kind for a in server.core.job("cli").amendments] == ["skip", "weights", "grow"]
    shown = _cli("status", "cli", "--address", server.address)
    assert shown.returncode == 0 and "amendments (3):" in shown.stdout and "grow source 1 from 70 to 90" in shown.stdout
    assert "sources: 30, 70 samples (100 indices); 30, 90 (120) once the pending grows hold" in shown.stdout
    assert "epoch: 100 positions" in shown.stdout


def test_a_checkpoint_record_carries_the_amendments_its_generation_dealt_with() -> None:
    from croupier.core.checkpoint import amendments_of, state_of_record

    st = _started()
    for ev in decide_amend(st, "j", "skip", [24])[1]:
        st.apply(ev)
    _started(resume=Cursor(0, ((20, 100),)), incarnation="t2", state=st)  # holds the skip from position 20
    gen = st.jobs["j"].generation
    assert gen is not None
    _, events = decide_report(st, "j", gen.number, 0, 0, 4, 1, (7, Cursor(0, ((60, 100),)), "t2/0/40"))
    for ev in events:
        st.apply(ev)
    record = st.checkpoint("j", 7)
    assert record.amendments == (Amendment("skip", (0, 24), 20),)
    assert State.restore(st.snapshot()).checkpoint("j", 7) == record
    # Resumed from that record (resume_from_step), positions before 60 keep the skip at 20.
    state = state_of_record("j", MIX, record)
    _started(resume=record.cursor, incarnation="t3", state=st, amendments=amendments_of(state))
    assert st.jobs["j"].held == (Amendment("skip", (0, 24), 20),)


def test_the_same_weights_recorded_twice_are_two_changes() -> None:
    a, b = parts_of([1, 3]), parts_of([3, 1])
    st = _started()
    for w, incarnation, start in [(a, "t2", Cursor(1, ((0, 100),))), (b, "t3", Cursor(2, ((0, 100),))),
                            (a, "t4", Cursor(3, ((0, 100),)))]:
        for ev in decide_amend(st, "j", "weights", w)[1]:
            st.apply(ev)
        assert [x.values for x in st.jobs["j"].pending] == [w]
        _started(resume=start, incarnation=incarnation, state=st, amendments=st.jobs["j"].held)  # a checkpoint of the last
    assert [(x.values, x.at) for x in st.jobs["j"].held] == [(a, 100), (b, 200), (a, 300)]
    assert st.jobs["j"].dealing_spec.amended(st.jobs["j"].held)  # the stream is made: a holds from 300 on


def test_ranks_resuming_with_other_amendments_are_refused_whichever_joins_first() -> None:
    x = (Amendment("skip", (0, 3), 40),)
    for first, second in [(x, ()), ((), x)]:
        st = _started()
        for ev in decide_join(st, JoinRequest("j", MIX, "t2", 2, 0, Cursor(0, ((60, 100),)), amendments=first), 0):
            st.apply(ev)
        with pytest.raises(FailedPrecondition, match="every rank must load the same checkpoint"):
            decide_join(st, JoinRequest("j", MIX, "t2", 2, 1, Cursor(0, ((60, 100),)), amendments=second), 0)


def test_weights_for_another_number_of_sources_are_counted_before_they_become_parts() -> None:
    s = DistributedSampler(100, weights=[1, 1], sources=[30, 70], num_replicas=1, rank=0, job="x",
                           address="127.0.0.1:1")
    try:
        with pytest.raises(ValueError, match=r"^the job has 2 sources; 3 weights given$"):
            s.set_weights([1, 2, 3])  # refused before any call: the sampler knows its sources
    finally:
        s.close()
