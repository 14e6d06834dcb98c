"""Unit tests of the state machine: validation, fencing, idempotency, epochs (G5), snapshots, checkpoint states."""

from __future__ import annotations

import msgpack
import pytest
from _sim import checkpoint_of, plan_of, serve

from croupier.core.api import JoinRequest
from croupier.core.checkpoint import PAST_FORMATS, VERSION, from_state, to_state
from croupier.core.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
)
from croupier.core.order import Cursor, fresh
from croupier.core.spec import ORDER_VERSION, Spec
from croupier.server._decide import decide_join
from croupier.server._events import decode_event, encode_event
from croupier.server._state import State

SPEC = Spec(n=100, seed=1, batch_size=4)


def commit(s: State, req: JoinRequest) -> list:
    evs = decide_join(s, req, 0)
    for ev in evs:
        s.apply(decode_event(msgpack.unpackb(msgpack.packb(encode_event(ev)))))
    return evs


def started(world: int = 2, incarnation: str = "a", resume: Cursor | None = None, epoch: int | None = None) -> State:
    s = State()
    for r in range(world):
        commit(s, JoinRequest("j", SPEC, incarnation, world, r, resume, epoch))
    return s


def frozen(s: State) -> bytes:
    return msgpack.packb(s.snapshot())


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"job": ""}, "job name"),
        ({"job": "x" * 300}, "job name"),
        ({"rank": 2}, "rank must be in [0, 2)"),
        ({"rank": -1}, "rank"),
        ({"world": 0, "rank": 0}, "world must be"),
        ({"incarnation": ""}, "incarnation"),
        ({"epoch": -3}, "epoch"),
        ({"resume": Cursor(0, ((50, 200),))}, "inside [0, 100)"),
        ({"resume": Cursor(0, ((10, 5),))}, "sorted"),
    ],
)
def test_bad_join_is_refused_and_changes_nothing(kwargs: dict, words: str) -> None:
    s = started()
    before = frozen(s)
    base = dict(job="j", spec=SPEC, incarnation="b", world=2, rank=0)
    base.update(kwargs)
    with pytest.raises(InvalidArgument, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        decide_join(s, JoinRequest(**base), 0)
    assert frozen(s) == before


def test_other_spec_is_refused_showing_both() -> None:
    s = started()
    other = Spec(n=100, seed=2, batch_size=4)
    with pytest.raises(FailedPrecondition) as e:
        decide_join(s, JoinRequest("j", other, "a", 2, 0), 0)
    assert "seed=1" in str(e.value) and "seed=2" in str(e.value)


def test_world_mismatch_in_a_generation() -> None:
    s = State()
    commit(s, JoinRequest("j", SPEC, "a", 2, 0))
    with pytest.raises(FailedPrecondition, match="world size 2"):
        decide_join(s, JoinRequest("j", SPEC, "a", 3, 1), 0)


def test_generation_waits_for_every_rank() -> None:
    s = State()
    commit(s, JoinRequest("j", SPEC, "a", 3, 2))
    commit(s, JoinRequest("j", SPEC, "a", 3, 0))
    assert s.join_result("j", 0).waiting_for == (1,)
    with pytest.raises(FailedPrecondition, match=r"waiting for ranks \[1\]"):
        serve(s, 1, 0, 0, 0, job="j")
    commit(s, JoinRequest("j", SPEC, "a", 3, 1))
    assert s.join_result("j", 1).start == fresh(SPEC, 0)
    assert serve(s, 1, 0, 0, 0, job="j") is not None


def test_join_is_idempotent_and_serving_is_deterministic() -> None:
    s = started()
    assert decide_join(s, JoinRequest("j", SPEC, "a", 2, 1), 0) == []
    a = serve(s, 1, 1, 0, 3, job="j")
    b = serve(s, 1, 1, 0, 3, job="j")
    assert a is not None and b is not None and a.tolist() == b.tolist()


def test_fencing_old_generation() -> None:
    s = started(incarnation="a")
    commit(s, JoinRequest("j", SPEC, "b", 3, 0))
    before = frozen(s)
    with pytest.raises(Aborted, match="replaced by generation 2"):
        serve(s, 1, 0, 0, 0, job="j")
    with pytest.raises(Aborted, match="older generation"):
        decide_join(s, JoinRequest("j", SPEC, "a", 2, 1), 0)
    with pytest.raises(NotFound):
        serve(s, 7, 0, 0, 0, job="j")
    with pytest.raises(NotFound, match="not known"):
        serve(s, 1, 0, 0, 0, job="nope")
    assert frozen(s) == before


def test_ranks_must_resume_from_the_same_checkpoint() -> None:
    s = State()
    commit(s, JoinRequest("j", SPEC, "a", 3, 0, Cursor(0, ((40, 100),))))
    commit(s, JoinRequest("j", SPEC, "a", 3, 2, None))  # a scale-up rank: no state
    before = frozen(s)
    with pytest.raises(FailedPrecondition, match="same checkpoint"):
        decide_join(s, JoinRequest("j", SPEC, "a", 3, 1, Cursor(0, ((44, 100),))), 0)
    assert frozen(s) == before
    commit(s, JoinRequest("j", SPEC, "a", 3, 1, Cursor(0, ((40, 100),))))
    assert s.join_result("j", 2).start == Cursor(0, ((40, 100),))


def test_epochs_advance_by_themselves() -> None:
    s = started(world=1)
    p0 = plan_of(s, 1, 0, job="j")
    p1 = plan_of(s, 1, 1, job="j")
    assert p0 is not None and p1 is not None
    e0 = [i for j in range(25) for i in p0.batch_indices(0, j).tolist()]  # type: ignore[union-attr]
    e1 = [i for j in range(25) for i in p1.batch_indices(0, j).tolist()]  # type: ignore[union-attr]
    assert sorted(e0) == sorted(e1) == list(range(100)) and e0 != e1


def test_set_epoch_on_a_fresh_job_starts_there() -> None:
    s = started(epoch=5)
    assert s.join_result("j", 0).start == fresh(SPEC, 5)
    assert serve(s, 1, 0, 4, 0, job="j") is None  # the epoch before a fresh start counts as complete
    with pytest.raises(OutOfRange, match="epoch 3 is before"):
        serve(s, 1, 0, 3, 0, job="j")


def test_set_epoch_must_agree_with_the_checkpoint() -> None:
    mid = Cursor(3, ((40, 100),))
    s = State()
    commit(s, JoinRequest("j", SPEC, "a", 2, 0, mid, 3))
    with pytest.raises(FailedPrecondition, match=r"set_epoch\(7\)"):
        decide_join(s, JoinRequest("j", SPEC, "a", 2, 1, None, 7), 0)
    commit(s, JoinRequest("j", SPEC, "a", 2, 1, None, 3))
    # A finished epoch: the checkpoint is epoch 4's fresh start; set_epoch(3) gets no batches.
    s2 = started(resume=fresh(SPEC, 4), epoch=3)
    assert serve(s2, 1, 0, 3, 0, job="j") is None
    assert serve(s2, 1, 0, 4, 0, job="j") is not None
    with pytest.raises(OutOfRange):
        serve(s2, 1, 0, 2, 0, job="j")


@pytest.mark.parametrize(
    ("resume", "epoch"),
    [(Cursor(3, ((40, 100),)), 2), (Cursor(3, ((40, 100),)), 4), (fresh(SPEC, 4), 2), (fresh(SPEC, 4), 5)],
)
def test_a_rank_whose_own_resume_point_contradicts_its_own_set_epoch_is_refused(resume: Cursor, epoch: int) -> None:
    """The first rank of a generation has nobody to disagree with but itself."""
    for s in (State(), started(incarnation="old")):
        before = frozen(s)
        with pytest.raises(FailedPrecondition, match=rf"contradicts its own set_epoch\({epoch}\)"):
            decide_join(s, JoinRequest("j", SPEC, "new", 2, 0, resume, epoch), 0)
        assert frozen(s) == before


def test_snapshot_and_journal_rebuild_the_same_state() -> None:
    s = State()
    journal = []
    for tok, world in (("a", 2), ("b", 3), ("c", 1)):
        for r in range(world):
            for ev in decide_join(s, JoinRequest("j", SPEC, tok, world, r, Cursor(1, ((10, 100),)) if tok == "c" else None), 0):
                journal.append(msgpack.packb(encode_event(ev)))
                s.apply(ev)
        if tok == "a":
            snap, upto = msgpack.packb(s.snapshot()), len(journal)
    restored = State.restore(msgpack.unpackb(snap), [decode_event(msgpack.unpackb(b)) for b in journal[upto:]])
    assert restored.snapshot() == s.snapshot()
    replayed = State.restore(None, [decode_event(msgpack.unpackb(b)) for b in journal])
    assert replayed.snapshot() == s.snapshot()
    assert serve(restored, 3, 0, 1, 2, job="j").tolist() == serve(s, 3, 0, 1, 2, job="j").tolist()  # type: ignore[union-attr]


def test_checkpoint_state_round_trip_and_refusals() -> None:
    cur = Cursor(2, ((5, 9), (20, 100)))
    st = to_state("j", SPEC, cur)
    assert from_state("j", SPEC, st) == cur
    assert from_state("j", SPEC, {}) is None
    with pytest.raises(FailedPrecondition, match="from job 'j', not from this job 'k'"):
        from_state("k", SPEC, st)
    other = Spec(n=100, seed=9, batch_size=4)
    with pytest.raises(FailedPrecondition) as e:
        from_state("j", other, st)
    assert SPEC.fingerprint in str(e.value) and other.fingerprint in str(e.value)
    with pytest.raises(InvalidArgument, match="missing keys"):
        from_state("j", SPEC, {"version": VERSION})
    with pytest.raises(InvalidArgument, match="missing keys"):
        from_state("j", SPEC, {k: v for k, v in st.items() if k != "version"})
    with pytest.raises(InvalidArgument, match="malformed"):
        from_state("j", SPEC, {**st, "remaining": [[5, 200]]})
    with pytest.raises(InvalidArgument, match="order version must be an int"):
        from_state("j", SPEC, {**st, "order": "2"})
    with pytest.raises(FailedPrecondition, match="format version 99 .*newer than this release"):
        from_state("j", SPEC, {**st, "version": 99})


def test_checkpoint_states_of_other_versions_are_refused_naming_both() -> None:
    """A state of croupier 0.1 (format 1, no order key) or of other orders names positions of other orders."""
    assert (VERSION, ORDER_VERSION) == (3, 2) and PAST_FORMATS[1] == ("croupier 0.1", 1)
    st = to_state("j", SPEC, Cursor(3, ((5, 9),)))
    assert st["version"] == VERSION and st["order"] == ORDER_VERSION
    v1 = {k: v for k, v in st.items() if k != "order"} | {"version": 1}
    with pytest.raises(FailedPrecondition) as e:
        from_state("j", SPEC, v1)
    assert str(e.value) == (
        "checkpoint state format version 1 (croupier 0.1, order version 1) is from an earlier release; this release "
        "reads format 3 with order version 2; restart epoch 3 (load an empty state and call set_epoch(3)) or use "
        "the release that wrote it"
    )
    for other in (1, 3):
        with pytest.raises(FailedPrecondition) as e:
            from_state("j", SPEC, {**st, "order": other})
        assert f"has order version {other} (format 3)" in str(e.value)
        assert "reads format 3 with order version 2" in str(e.value) and "set_epoch(3)" in str(e.value)
    with pytest.raises(FailedPrecondition, match="format version 'x' is not a known format"):
        from_state("j", SPEC, {**st, "version": "x"})


def test_the_fingerprint_holds_the_order_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same settings under another release's orders are another spec."""
    ours = SPEC.fingerprint
    monkeypatch.setattr("croupier.core.spec.ORDER_VERSION", ORDER_VERSION - 1)
    assert SPEC.fingerprint != ours
    monkeypatch.undo()
    assert SPEC.fingerprint == ours


def test_checkpoint_is_topology_free() -> None:
    """All ranks' states agree, and a strided job's state is one interval whatever the world."""
    s = started(world=4)
    st = checkpoint_of(s, 1, 0, 3, job="j")
    assert st["remaining"] == [[3 * 4 * 4, 100]]
    assert len(msgpack.packb(st)) < 200


def test_scope_rank_layout_is_kept_across_a_resize() -> None:
    spec = Spec(n=40, partition="contiguous", scope="rank", permutation="feistel", tail="uneven", batch_size=2)
    s = State()
    for r in range(4):
        commit(s, JoinRequest("d", spec, "a", 4, r))
    assert s.join_result("d", 0).start.base_world == 4  # type: ignore[union-attr]
    st = checkpoint_of(s, 1, 0, 2, job="d")
    assert st["base_world"] == 4
    part0 = set(plan_of(s, 1, 0, job="d").batch_indices(0, 0).tolist())  # type: ignore[union-attr]
    assert part0 <= set(range(10))  # split first, then shuffled within rank 0's part
    s2 = State()
    for r in range(2):
        commit(s2, JoinRequest("d", spec, "b", 2, r, from_state("d", spec, st)))
    p = plan_of(s2, 1, 0, job="d")
    got = [i for r in range(2) for j in range(10) if (b := p.batch_indices(r, j)) is not None for i in b.tolist()]  # type: ignore[union-attr]
    first = [i for r in range(4) for j in range(2) for i in plan_of(s, 1, 0, job="d").batch_indices(r, j).tolist()]  # type: ignore[union-attr]
    assert sorted(got + first) == list(range(40))
