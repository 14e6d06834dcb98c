"""A history's kept order in pieces (``History.kept_order``) against its steps asked one by one (``History.step``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from croupier.core import kept as kept_mod
from croupier.core.errors import FailedPrecondition, InvalidArgument, OutOfRange
from croupier.core.ftsteps import CommittedStep, Steps
from croupier.core.history import History
from croupier.core.kept import NO_KEPT, KeptSteps, step_major
from croupier.core.ledger import Ledger, history
from croupier.core.schedule import Schedule
from croupier.core.spec import Spec
from tests._budget import examples
from tests.core.test_ledger import Model, specs


def _one_by_one(led: History, a: int, b: int) -> tuple[list[int], list[int]]:
    """(each step's kept size or NO_KEPT, the kept indices one after the other), from ``step(t)``."""
    sizes: list[int] = []
    out: list[int] = []
    for rec in led.steps(a, b):
        sizes.append(NO_KEPT if rec.kept is None else rec.kept.indices.size)
        out += [] if rec.kept is None else rec.kept.indices.tolist()
    return sizes, out


def _in_pieces(led: History, a: int, b: int) -> tuple[list[int], list[int]]:
    pieces = list(led.kept_order(a, b))
    assert [p.first for p in pieces] == [a] + [p.last + 1 for p in pieces[:-1]] and pieces[-1].last == b
    for p in pieces:
        assert p.indices.size == int(p.sizes[p.sizes >= 0].sum())
    return ([int(s) for p in pieces for s in p.sizes], [int(i) for p in pieces for i in p.indices])


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs, gens=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 12), st.integers(0, 3), st.integers(1, 2)),
                                 min_size=1, max_size=5), piece=st.sampled_from([1, 7, 1 << 20]), data=st.data())
def test_the_pieces_are_the_steps_kept_versions(spec: Spec, gens: list[tuple[int, int, int, int]], piece: int,
                                                data: st.DataObject) -> None:
    """Resizes, rollbacks, accumulation, every tail and order, and pieces cut within an epoch (`piece` samples)."""
    if spec.permutation == "window":
        spec = dataclasses.replace(spec, buffer_size=7)
    model = Model(spec)
    for world, steps, back, accumulate in gens:
        resume = max(0, max(model.checkpoints) - back) if back and model.checkpoints else None
        model.generation(world, steps, resume, Schedule(spec.batch_size * world * accumulate if accumulate > 1 else 0))
    led = Ledger("job", spec, model.segments)
    if led.last_step == 0:
        return
    last = max(led.last_step, led.furthest_step)  # past the timeline: steps with no kept version
    a = data.draw(st.integers(1, last))
    b = data.draw(st.integers(a, last))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kept_mod, "PIECE", piece)
        assert _in_pieces(led, a, b) == _one_by_one(led, a, b)


def test_a_rampup_and_a_rollback_past_the_timeline_are_answered_as_the_steps_are() -> None:
    spec = Spec(n=96, seed=5, batch_size=2)
    model = Model(spec)
    model.generation(2, 9, None, Schedule(8, rampup=(4, 4, 3)))
    model.generation(4, 6, 5, Schedule(8))  # a rollback: steps 6-9 of generation 1 abandoned
    model.generation(2, 2, 8, Schedule(8))  # and steps 9-11 of generation 2
    led = Ledger("job", spec, model.segments)
    assert led.furthest_step > led.last_step or led.step(11).abandoned
    assert _in_pieces(led, 1, led.furthest_step) == _one_by_one(led, 1, led.furthest_step)


@pytest.mark.parametrize("tail", ["pad", "drop", "uneven", "pad_last"])
@pytest.mark.parametrize("drop_last_batch", [False, True])
def test_an_epochs_ragged_end_is_answered_as_the_steps_are(tail: str, drop_last_batch: bool) -> None:
    """50 samples on 3 ranks of 4, then on 2 from step 4: the ranks' last batches differ (short, or one rank has
    one more), so a piece's steps are not one transpose away from the ranks' layout."""
    spec = Spec(n=50, seed=7, batch_size=4, tail=tail, drop_last_batch=drop_last_batch)
    model = Model(spec)
    model.generation(3, 12, None, Schedule())
    model.generation(2, 10, 4, Schedule())
    led = Ledger("job", spec, model.segments)
    assert _in_pieces(led, 1, led.last_step) == _one_by_one(led, 1, led.last_step)


def test_a_job_of_replica_groups_is_answered_as_its_steps_are() -> None:
    """Run a: steps 1-4 (step 3 twice, by two quorums); run b resumes at step 2 and trains 3-5; a span that
    crosses an epoch (n = 10, 4 samples a step)."""
    spec = Spec(n=10, seed=3, batch_size=4)
    s = Steps()
    for run, parent, resumed, step, quorum, groups in [("a", "", 0, 1, 1, 2), ("a", "", 0, 2, 1, 2), ("a", "", 0, 3, 1, 2),
                                                        ("a", "", 0, 3, 2, 1), ("a", "", 0, 4, 2, 1), ("b", "a", 2, 3, 5, 1),
                                                        ("b", "a", 2, 4, 5, 2), ("b", "a", 2, 5, 5, 2)]:
        c = CommittedStep(step, 4 * (step - 1), 4 * step, quorum, groups)
        assert s.check(run, parent, resumed, "global", 4, c) is None and s.record(run, parent, resumed, "global", 4, c)
    led = history("ft", spec, [], s.runs)
    for a, b in [(1, 5), (2, 4), (3, 3)]:
        for piece in (1, 8, 1 << 20):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(kept_mod, "PIECE", piece)
                assert _in_pieces(led, a, b) == _one_by_one(led, a, b), (a, b, piece)


def test_it_refuses_what_the_steps_refuse_before_it_is_iterated() -> None:
    spec = Spec(n=40, seed=1, batch_size=2)
    model = Model(spec)
    model.generation(2, 5, None, Schedule())
    led = Ledger("job", spec, model.segments)
    with pytest.raises(InvalidArgument, match="the range is empty"):
        led.kept_order(3, 2)
    with pytest.raises(InvalidArgument, match="got 0"):
        led.kept_order(0, 2)
    with pytest.raises(OutOfRange, match="step 6 is past the run"):
        led.kept_order(1, 6)
    model.segments[0].step = 2  # as if it resumed at step 2 from a store that was lost
    with pytest.raises(FailedPrecondition, match="the history before step 3 is missing"):
        Ledger("job", spec, model.segments).kept_order(1, 5)


def test_step_major_lays_ranks_out_step_by_step_and_sorts_what_is_irregular() -> None:
    # 2 ranks, 3 steps, 2 samples a rank a step: a transpose
    rank, step = np.repeat([0, 1], 6), np.tile(np.repeat([0, 1, 2], 2), 2)
    sizes, pos = step_major(rank, step, np.arange(12), 2, 3)
    assert sizes.tolist() == [4, 4, 4] and pos.tolist() == [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]
    # rank 1 has no sample in step 2 and one more in step 0: sorted by step, stable
    rank, step = np.array([0, 0, 0, 1, 1, 1]), np.array([0, 1, 2, 0, 0, 1])
    sizes, pos = step_major(rank, step, np.array([10, 11, 12, 20, 21, 22]), 2, 3)
    assert sizes.tolist() == [3, 2, 1] and pos.tolist() == [10, 20, 21, 11, 22, 12]
    assert KeptSteps(4, sizes, pos).last == 6
