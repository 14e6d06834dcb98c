"""Recovery: a coordinator rebuilds its state from what its store holds, or refuses a record it cannot read.

The journal fixture ``fixtures/journal-v2.db`` was written by this release (see
``fixtures/make_journal.py``). Keep it, and the test that reads it, forever: every later
release MUST recover from it the state asserted here, or refuse it with an error naming both
the fixture's version and the one the release reads.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import msgpack
import pytest

from croupier.core.api import JoinRequest
from croupier.core.errors import Aborted
from croupier.core.order import Cursor, fixed_plan, fresh
from croupier.core.spec import Spec
from croupier.server._coordinator import Coordinator
from croupier.server._decide import decide_join
from croupier.server._events import (
    FORMAT_VERSION,
    FormatError,
    GenerationOpened,
    GenerationStarted,
    JobRegistered,
    RankJoined,
    decode_event,
    encode_event,
)
from croupier.server._journal import pack_event, pack_snapshot
from croupier.server._state import State
from croupier.server._store import StoreCorrupt
from croupier.server._stores import open_store

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SPEC = Spec(n=50, seed=2, batch_size=5)


def _events() -> list[dict[str, Any]]:
    """The encoded events of a first join to a world of 2: JobRegistered, GenerationOpened, RankJoined."""
    return [encode_event(ev) for ev in decide_join(State(), JoinRequest("j", SPEC, "t", 2, 0), 0)]


def _rank_1() -> dict[str, Any]:
    """The encoded RankJoined of rank 1, which follows :func:`_events`."""
    return encode_event(RankJoined("j", 1, 1, None, None))


def _packed(d: object) -> bytes:
    return bytes(msgpack.packb(d))


# -- the fixture -----------------------------------------------------------------------------------------


@pytest.fixture
def journal_v2(tmp_path: Path) -> str:
    """A copy of the committed fixture (opening a store may write next to its file); its URL."""
    copy = tmp_path / "journal-v2.db"
    shutil.copyfile(FIXTURES / "journal-v2.db", copy)
    return f"sqlite:///{copy}"


def test_the_fixture_holds_a_snapshot_and_records_after_it(journal_v2: str) -> None:
    """Recovery below reads both a snapshot and journal records of version 1."""
    store = open_store(journal_v2)
    try:
        rec = store.load()
    finally:
        store.close()
    assert rec.snapshot is not None and rec.snapshot_seq == 9
    assert [seq for seq, _ in rec.records] == [10, 11, 12]
    assert msgpack.unpackb(rec.snapshot)["version"] == 2
    assert [msgpack.unpackb(p)["version"] for _, p in rec.records] == [2, 2, 2]


def test_a_coordinator_recovers_the_v2_journal(journal_v2: str) -> None:
    alpha = Spec(n=100, seed=7, batch_size=4, permutation="feistel")
    beta = Spec.with_lengths([5, 3, 9, 1, 7, 2, 8, 4], seed=3, buffer_size=4, pack_size=2, batch_size=2)
    resume = Cursor(1, ((40, 100),))
    core = Coordinator(open_store(journal_v2))
    try:
        st = core.job("alpha")
        spec, gen = st.spec, st.result
        assert spec == alpha
        assert (gen.generation, gen.world, gen.start, gen.waiting_for) == (2, 3, None, (2,))
        st = core.job("beta")
        spec, gen = st.spec, st.result
        assert spec == beta
        assert (gen.generation, gen.world, gen.start, gen.waiting_for) == (1, 1, fresh(beta, 3), ())
        state = msgpack.unpackb(core.snapshot_state())
        assert [j["tokens"] for j in state["jobs"]] == [["alpha-1", "alpha-2"], ["beta-1"]]
        assert state["jobs"][0]["generation"]["joined"] == [[0, [1, [[40, 100]], 0], 1], [1, [1, [[40, 100]], 0], 1]]
        with pytest.raises(Aborted, match="older generation"):  # the token of generation 1 is fenced
            core.join(JoinRequest("alpha", alpha, "alpha-1", 2, 0))
        # The recovered journal goes on: the last rank joins and generation 2 starts where the others resume.
        result = core.join(JoinRequest("alpha", alpha, "alpha-2", 3, 2, resume, 1))
        assert (result.generation, result.start) == (2, resume)
        first = core.lease("alpha", 2, 0, 1, 0, 1)
        assert first.indices.tolist() == fixed_plan(alpha, resume, 3).batch_indices(0, 0).tolist()  # type: ignore[union-attr]
        rest = [i for r in range(3) for i in core.lease("alpha", 2, r, 1, 0, 100).indices.tolist()]
        assert len(rest) == len(set(rest)) == 60  # what is left of epoch 1, each index once
    finally:
        core.close()
    store = open_store(journal_v2)
    try:
        assert store.load().last_seq == 14  # RankJoined and GenerationStarted, numbered after the fixture's
    finally:
        store.close()


# -- records the store vouches for but this croupier cannot read -------------------------------------------


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


BAD_RECORDS: dict[str, tuple[bytes, str]] = {
    "not msgpack": (b"\xc1 this is not msgpack", r"its 21 bytes are not msgpack"),
    "truncated msgpack": (_packed(_rank_1())[:-4], r"bytes are not msgpack \(ValueError: Unpack failed: incomplete input\)"),
    "msgpack with bytes after it": (_packed(_rank_1()) + b"\x00", r"bytes are not msgpack \(ExtraData"),
    "not a map": (_packed([1, 2, 3]), r"an event must be a map \(got list\)"),
    "unknown event type": (
        _packed({"type": "JobDeleted", "version": 2, "order": 2, "job": "j"}),
        r"unknown event type 'JobDeleted' \(known: \['AmendmentRecorded', 'AmendmentsLoaded', 'BatchesCommitted', 'BatchesDealt', 'CheckpointRecorded', 'EpochCut', 'GenerationAmended', 'GenerationOpened', 'GenerationStarted', 'JobRegistered', 'ProgressReported', 'RankJoined', 'StepCommitted'\]\)",
    ),
    "newer format version": (
        _packed({**_rank_1(), "version": FORMAT_VERSION + 1}),
        rf"event format version {FORMAT_VERSION + 1} is not one this croupier reads \(it reads versions 2, 3, 4, 5, 6, 7, 8, 9\); a newer croupier wrote it",
    ),
    "no format version": (_packed(_without(_rank_1(), "version")), r"the event has no format version"),
    "missing field": (_packed(_without(_rank_1(), "rank")), r"missing \['rank'\], unknown \[\]"),
    "unknown field": (_packed({**_rank_1(), "colour": "red"}), r"missing \[\], unknown \['colour'\]"),
    "mistyped field": (_packed({**_rank_1(), "rank": "1"}), r"RankJoined.rank must be an int \(got RankJoined.rank='1'\)"),
    "event out of place": (
        _packed(encode_event(RankJoined("ghost", 1, 0, None, None))),
        r"its RankJoined event does not follow the records before it \(KeyError: 'ghost'\)",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_an_unreadable_record_is_corrupt_naming_file_and_seq(tmp_path: Path, case: str) -> None:
    payload, why = BAD_RECORDS[case]
    path = tmp_path / "journal.db"
    store = open_store(f"sqlite:///{path}")
    store.append([_packed(e) for e in _events()])  # records 1-3 are fine
    store.append([payload, _packed(_rank_1())])  # record 4 is not; its checksum is valid
    store.close()
    with pytest.raises(StoreCorrupt, match=why) as info:
        Coordinator(open_store(f"sqlite:///{path}"))
    message = str(info.value)
    assert str(path) in message and "journal record 4 cannot be read" in message, message
    # The coordinator closed the store it refused: the file can be opened again at once.
    open_store(f"sqlite:///{path}").close()


BAD_SNAPSHOTS: dict[str, tuple[bytes, str]] = {
    "not msgpack": (b"\xc1\xc1\xc1", r"its 3 bytes are not msgpack"),
    "newer format version": (
        _packed({"version": FORMAT_VERSION + 1, "order": 2, "jobs": [], "quotas": {}}),
        rf"snapshot format version {FORMAT_VERSION + 1} is not one this croupier reads \(it reads versions 2, 3, 4, 5, 6, 7, 8, 9\)",
    ),
    "no format version": (_packed({"jobs": []}), r"the snapshot has no format version"),
    "unknown field": (_packed({"version": 2, "order": 2, "jobs": [], "quotas": {}}), r"unknown \['quotas'\]"),
    "another order version": (
        _packed({"version": 2, "order": 1, "jobs": []}),
        r"snapshot was written with order version 1, but this croupier computes order version 2",
    ),
    "croupier 0.1's snapshot": (
        _packed({"version": 1, "jobs": []}),
        r"snapshot format version 1 is not one this croupier reads \(it reads versions 2, 3, 4, 5, 6, 7, 8, 9\)",
    ),
    "mistyped job": (
        _packed({"version": 2, "order": 2, "jobs": [{"name": 7, "spec": {}, "generation": None, "tokens": []}]}),
        r"snapshot job 0 name must be a str \(got snapshot job 0 name=7\)",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SNAPSHOTS))
def test_an_unreadable_snapshot_is_corrupt_naming_file_and_seq(tmp_path: Path, case: str) -> None:
    payload, why = BAD_SNAPSHOTS[case]
    path = tmp_path / "journal.db"
    store = open_store(f"sqlite:///{path}")
    store.append([_packed(e) for e in _events()])
    store.write_snapshot(3, payload)
    store.append([_packed(_rank_1())])
    store.close()
    with pytest.raises(StoreCorrupt, match=why) as info:
        Coordinator(open_store(f"sqlite:///{path}"))
    message = str(info.value)
    assert str(path) in message and "the snapshot at seq 3 cannot be read" in message, message


def test_a_good_snapshot_and_the_records_after_it_are_recovered(tmp_path: Path) -> None:
    """The stores above differ from a readable one only in the bad payload."""
    path = tmp_path / "journal.db"
    state = State()
    for ev in decide_join(State(), JoinRequest("j", SPEC, "t", 2, 0), 0):
        state.apply(ev)
    store = open_store(f"sqlite:///{path}")
    store.append([_packed(e) for e in _events()])
    store.write_snapshot(3, pack_snapshot(state))
    store.append([_packed(_rank_1())])
    store.close()
    core = Coordinator(open_store(f"sqlite:///{path}"))
    try:
        assert core.job("j").result.waiting_for == ()
    finally:
        core.close()


def test_an_unreadable_record_in_a_memory_store_names_it(tmp_path: Path) -> None:
    store = open_store("memory://")
    store.append([pack_event(decide_join(State(), JoinRequest("j", SPEC, "t", 1, 0), 0)[0]), b"\xc1"])
    with pytest.raises(StoreCorrupt, match=r"store memory:// is corrupt: journal record 2 cannot be read"):
        Coordinator(store)


# -- the formats, field by field ----------------------------------------------------------------------------

BUCKET = Spec.with_lengths([4, 1, 3, 2], seed=5, buffer_size=2, pack_size=2, batch_size=2)
EVENTS = [
    JobRegistered("j", BUCKET),
    GenerationOpened("j", 1, 2, "tok"),
    RankJoined("j", 1, 0, Cursor(2, ((0, 1), (3, 4)), 2), 2),
    RankJoined("j", 1, 1, None, None),
    GenerationStarted("j", 1, Cursor(2, ((0, 1), (3, 4)), 2)),
]


@pytest.mark.parametrize("ev", EVENTS, ids=lambda ev: type(ev).__name__)
def test_every_event_round_trips_with_its_version(ev: Any) -> None:
    d = msgpack.unpackb(pack_event(ev))
    assert (d["type"], d["version"]) == (type(ev).__name__, FORMAT_VERSION)
    assert decode_event(d) == ev


def _mutated(ev: Any, **changes: Any) -> dict[str, Any]:
    return {**encode_event(ev), **changes}


@pytest.mark.parametrize(
    ("d", "why"),
    [
        (_mutated(EVENTS[1], version=True), r"event format version must be an int \(got event format version=True\)"),
        (_mutated(EVENTS[1], version=0), r"event format version 0 is not one this croupier reads \(it reads versions 2, 3, 4, 5, 6, 7, 8, 9\)$"),
        (_without(encode_event(EVENTS[1]), "type"), r"unknown event type None"),
        (_mutated(EVENTS[1], type=["RankJoined"]), r"unknown event type \['RankJoined'\]"),
        (_mutated(EVENTS[1], job=7), r"GenerationOpened.job must be a str \(got GenerationOpened.job=7\)"),
        (_mutated(EVENTS[1], generation=True), r"GenerationOpened.generation must be an int \(got .*=True\)"),
        (_mutated(EVENTS[1], world=2.0), r"GenerationOpened.world must be an int \(got .*=2.0\)"),
        (_mutated(EVENTS[2], epoch="2"), r"RankJoined.epoch must be an int"),
        (_mutated(EVENTS[2], resume={"epoch": 2}), r"RankJoined.resume \(a cursor \[epoch, intervals, base world\]\) must be"),
        (_mutated(EVENTS[2], resume=[2, [[0, 1, 2]], 0]), r"RankJoined.resume interval 0 must be a list of 2"),
        (_mutated(EVENTS[2], resume=[2, [[0, "1"]], 0]), r"RankJoined.resume interval 0 end must be an int"),
        (_mutated(EVENTS[2], resume=[2, 5, 0]), r"RankJoined.resume intervals must be a list"),
        (_mutated(EVENTS[4], start=None), r"GenerationStarted.start \(a cursor .*\) must be a list of 3 \(got .*=None\)"),
        (_mutated(EVENTS[0], spec=[1, 2]), r"JobRegistered.spec must be a map of spec fields"),
        (
            _mutated(EVENTS[0], spec={**BUCKET.to_dict(), "shelves": 4}),
            r"JobRegistered.spec is not a valid spec: unknown spec fields \['shelves'\]",
        ),
        (_mutated(EVENTS[0], spec={**BUCKET.to_dict(), "pack_size": -1}), r"JobRegistered.spec is not a valid spec: pack_size"),
    ],
)
def test_decode_event_refuses_what_encode_event_would_not_write(d: dict[str, Any], why: str) -> None:
    with pytest.raises(FormatError, match=why):
        decode_event(msgpack.unpackb(_packed(d)))


def _snapshot(**changes: Any) -> dict[str, Any]:
    """The snapshot of a job whose generation 1 has rank 0 joined with a resume point, changed as given."""
    state = State()
    for ev in EVENTS[:3]:
        state.apply(ev)
    snap = msgpack.unpackb(pack_snapshot(state))
    job, gen = snap["jobs"][0], snap["jobs"][0]["generation"]
    for key, value in changes.items():
        where, _, field = key.partition("__")
        {"snap": snap, "job": job, "gen": gen}[where][field] = value
    return snap  # type: ignore[no-any-return]


def test_a_snapshot_round_trips_with_its_version() -> None:
    snap = _snapshot()
    assert snap["version"] == FORMAT_VERSION
    assert State.restore(snap).snapshot() == snap


@pytest.mark.parametrize(
    ("snap", "why"),
    [
        ([], r"a snapshot must be a map \(got list\)"),
        (_snapshot(snap__version="1"), r"snapshot format version must be an int \(got snapshot format version='1'\)"),
        (_snapshot(snap__jobs={}), r"snapshot jobs must be a list"),
        (_snapshot(job__tokens="tok"), r"snapshot job 0 tokens must be a list"),
        (_snapshot(job__tokens=["tok", 3]), r"snapshot job 0 token 1 must be a str"),
        (_snapshot(job__spec={"n": 0}), r"snapshot job 0 spec is not a valid spec"),
        (_snapshot(job__owner="me"), r"snapshot job 0 must have the fields .* unknown \['owner'\]"),
        (_snapshot(gen__world=None), r"snapshot job 0 \('j'\) generation world must be an int"),
        (_snapshot(gen__joined=[[0, None]]), r"generation joined entry 0 \(\[rank, resume, epoch\]\) must be a list of 3"),
        (_snapshot(gen__joined=[[0, [2, [[0, 1]]], None]]), r"generation rank 0 resume \(a cursor .*\) must be a list of 3"),
        (_snapshot(gen__start=[2, [], "0"]), r"generation start base world must be an int"),
    ],
)
def test_restore_refuses_what_snapshot_would_not_write(snap: Any, why: str) -> None:
    with pytest.raises(FormatError, match=why):
        State.restore(msgpack.unpackb(_packed(snap)))


def test_restore_refuses_a_job_twice() -> None:
    snap = _snapshot()
    snap["jobs"].append(snap["jobs"][0])
    with pytest.raises(FormatError, match=r"snapshot job 1: job 'j' appears twice"):
        State.restore(snap)


# -- the format-3 fixture (croupier at e5c0cab: progress reports and checkpoint records) ----------------


def test_a_coordinator_recovers_the_v3_journal(tmp_path: Path) -> None:
    """A journal of format 3 (fixtures/make_journal_v3.py) recovers, records and progress included, and goes on."""
    copy = tmp_path / "journal-v3.db"
    shutil.copyfile(FIXTURES / "journal-v3.db", copy)
    gamma = Spec(n=60, seed=5, batch_size=3, permutation="feistel")
    at_step_4 = Cursor(0, ((24, 60),))
    core = Coordinator(open_store(f"sqlite:///{copy}"))
    try:
        st = core.job("gamma")
        assert st.spec == gamma
        assert (st.result.generation, st.result.world, st.result.start) == (2, 3, at_step_4)
        assert [(c.step, c.cursor, c.origin, c.generation, c.rank) for c in st.checkpoints] == [
            (4, at_step_4, "gamma-1/0/4", 1, 0)]
        assert core.checkpoint("gamma", 4)[1].cursor == at_step_4
        with pytest.raises(Aborted, match="older generation"):
            core.join(JoinRequest("gamma", gamma, "gamma-1", 2, 0))
        rest = [i for r in range(3) for i in core.lease("gamma", 2, r, 0, 0, 100).indices.tolist()]
        assert len(rest) == len(set(rest)) == 36  # what is left of epoch 0, each index once
        # it goes on in this release's format: a progress report of generation 2 is journaled
        core.report("gamma", 2, 1, 0, 3, (5, Cursor(0, ((33, 60),)), "gamma-2/0/3"))
        assert [c.step for c in core.job("gamma").checkpoints] == [4, 5]
    finally:
        core.close()


# -- the format-4 fixture (croupier at 78940ee: mixtures, dynamic dealing; no amendments) ---------------


def test_a_coordinator_recovers_the_v4_journal_and_amends_its_mixture(tmp_path: Path) -> None:
    """A journal of format 4 (fixtures/make_journal_v4.py) recovers, its jobs with no amendments, and goes on in format 5."""
    from croupier.core.mixture import parts_of

    copy = tmp_path / "journal-v4.db"
    shutil.copyfile(FIXTURES / "journal-v4.db", copy)
    delta = Spec(n=60, seed=9, batch_size=2, sources=(20, 40), weights=((0, parts_of([1, 3])),))
    at_step_5 = Cursor(0, ((20, 60),))
    core = Coordinator(open_store(f"sqlite:///{copy}"))
    try:
        st = core.job("delta")
        assert st.spec == delta and st.amendments == ()
        assert (st.result.generation, st.result.world, st.result.start) == (2, 3, at_step_5)
        assert core.checkpoint("delta", 5)[1].cursor == at_step_5
        rest = [i for r in range(3) for i in core.lease("delta", 2, r, 0, 0, 100).indices.tolist()]
        assert len(rest) == 42  # the 40 positions left, padded for 3 ranks (tail pad)
        eps = core.job("eps")
        assert eps.result.generation == 1 and core.grant("eps", 1, 0, 0, 0, 3).runs == ((0, 3),)  # the deal on record
        # it goes on in this release's format: an amendment, held by the next generation
        core.amend("delta", "skip", [3])
        for rank in range(2):
            core.join(JoinRequest("delta", delta, "delta-3", 2, rank, at_step_5))
        assert [a.at for a in core.job("delta").amendments] == [20]
    finally:
        core.close()
    again = Coordinator(open_store(f"sqlite:///{copy}"))
    try:
        assert [a.at for a in again.job("delta").amendments] == [20]
    finally:
        again.close()


def test_a_coordinator_recovers_the_v8_journal_into_each_generations_segment(tmp_path: Path) -> None:
    """A journal of format 8 (fixtures/make_journal_v8.py, written by that release) recovers with each generation's
    progress, deals, commits and held amendments in its segment, the job's view of them as that release had it,
    and goes on in this release's format."""
    from croupier.core.amend import Amendment
    from croupier.core.mixture import parts_of

    copy = tmp_path / "journal-v8.db"
    shutil.copyfile(FIXTURES / "journal-v8.db", copy)
    eta = Spec(n=60, seed=9, batch_size=2, sources=(20, 40), weights=((0, parts_of([1, 1])),))
    core = Coordinator(open_store(f"sqlite:///{copy}"))
    try:
        state = State.restore(msgpack.unpackb(core.snapshot_state(), strict_map_key=False))
        zeta, eta_job, zeta_seg = state.jobs["zeta"], state.jobs["eta"], state.jobs["zeta"].segment
        assert zeta_seg is not None and zeta_seg.cuts == {} and sorted(zeta_seg.deals) == [0, 1, 2]
        assert {r: p[:2] for r, p in zeta.progress.items()} == {0: (2, 2), 1: (2, 2)} and zeta.progress is zeta_seg.ranks
        assert sorted(zeta.deals) == [1, 2]  # epoch 0, all committed, is left behind; its segment keeps it
        assert zeta.deals[1].committed == {0: 8, 1: 7} and zeta.deals[2].runs == {0: [(0, 2)], 1: [(2, 2)]}
        assert zeta.deals[1].next == 15 and zeta.deals[1] is zeta_seg.deals[1]
        skip = (Amendment("skip", (0, 3), 10),)
        assert eta_job.held == skip and [s.amendments for s in eta_job.ledger] == [(), skip]
        assert {r: p[:2] for r, p in eta_job.progress.items()} == {0: (0, 2)}
        assert core.grant("zeta", 1, 0, 2, 0, 2).runs == ((0, 2),)  # the deal on record
        assert core.step_ledger("eta").step(6).kept is not None
        # it goes on in this release's format: a checkpoint of epoch 2, recorded, read back
        core.report("zeta", 1, 0, 2, 2, (99, None, "zeta-1/0/99"), lockstep=False)
        assert core.job("eta").spec == eta
    finally:
        core.close()
    again = Coordinator(open_store(f"sqlite:///{copy}"))
    try:
        assert again.checkpoint("zeta", 99)[1].step == 99
    finally:
        again.close()
