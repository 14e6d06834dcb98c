"""A torchft job's history read as every job's is (core/quorum_ledger.py, core/history.py): the one lineage walk,
steps from 1, the one version type, abandoned versions of rollbacks and of steps a later quorum trained again."""

from __future__ import annotations

import numpy as np
import pytest

from croupier.core.errors import FailedPrecondition, InvalidArgument, OutOfRange
from croupier.core.ftsteps import CommittedStep, Steps, stream_indices
from croupier.core.history import LineageCycle, lineage
from croupier.core.ledger import Ledger, history
from croupier.core.mixture import sample_seeds
from croupier.core.quorum_ledger import QuorumLedger
from croupier.core.spec import Spec

SPEC = Spec(n=20, seed=3, permutation="feistel", batch_size=4)


def _c(step: int, quorum: int, participants: int) -> CommittedStep:
    return CommittedStep(step, 4 * (step - 1), 4 * step, quorum, participants)


def _record() -> Steps:
    """Run a: steps 1-3 by quorum 1 (two groups), step 3 trained again by quorum 2 (one group: the other died with
    its update), then step 4; run b resumed at step 2 of run a (a rollback) and trained steps 3 and 4."""
    s = Steps()
    for c in (_c(1, 1, 2), _c(2, 1, 2), _c(3, 1, 2), _c(3, 2, 1), _c(4, 2, 1)):
        assert s.check("a", "", 0, "global", 4, c) is None
        assert s.record("a", "", 0, "global", 4, c)
    for c in (_c(3, 5, 1), _c(4, 5, 1)):
        assert s.check("b", "a", 2, "global", 4, c) is None
        assert s.record("b", "a", 2, "global", 4, c)
    return s


def test_a_step_is_kept_along_the_lineage_and_every_other_version_abandoned() -> None:
    led = history("ft", SPEC, [], _record().runs)
    assert isinstance(led, QuorumLedger) and led.last_step == 4
    one = led.step(1)
    assert one.kept is not None and (one.kept.incarnation, one.kept.generation, one.kept.world) == ("a", 1, 2)
    assert one.abandoned == ()
    three = led.step(3)
    assert three.kept is not None and (three.kept.incarnation, three.kept.quorum) == ("b", 5)
    assert sorted((v.incarnation, v.quorum, v.kept) for v in three.abandoned) == [("a", 1, False), ("a", 2, False)]
    for v in (three.kept, *three.abandoned):  # the same span of the stream, whoever trained it
        assert v.span == (8, 12) and v.indices.tolist() == stream_indices(SPEC, 8, 12).tolist()
        rank, micro, idx, src, sep, seeds = v.samples
        assert seeds.tolist() == sample_seeds(SPEC.seed, src, sep, idx).tolist() and not micro.any()
    # two groups split step 3 of quorum 1: part g of the span is group g's batch
    two_groups = next(v for v in three.abandoned if v.quorum == 1)
    assert [(b.rank, b.indices.tolist()) for b in two_groups.batches] == [
        (0, stream_indices(SPEC, 8, 10).tolist()), (1, stream_indices(SPEC, 10, 12).tolist())]


def test_a_samples_steps_are_every_version_that_trained_it() -> None:
    led = history("ft", SPEC, [], _record().runs)
    index = int(stream_indices(SPEC, 10, 11)[0])  # stream position 10: step 3, group 1 of quorum 1's two
    got = [(o.step, o.generation, o.rank, o.kept) for o in led.index(index)]
    assert sorted(got) == [(3, 1, 0, False), (3, 1, 1, False), (3, 2, 0, True)]
    assert {o.epoch for o in led.index(index)} == {0}


def test_the_timeline_keeps_each_run_up_to_where_its_successor_resumed() -> None:
    led = history("ft", SPEC, [], _record().runs)
    rows = [(r["incarnation"], r["generation"], r["parent"], r["from_step"], r["to_step"], r["kept_to"])
            for r in led.timeline()]
    assert rows == [("a", 1, None, 0, 4, 2), ("b", 2, 1, 2, 4, 4)]
    assert led.constant_batch() == 4


def test_steps_count_from_1_and_past_the_record_is_out_of_range() -> None:
    led = history("ft", SPEC, [], _record().runs)
    with pytest.raises(InvalidArgument, match="steps count from 1"):
        led.step(0)
    with pytest.raises(OutOfRange, match="step 5 is past the run"):
        led.step(5)
    with pytest.raises(InvalidArgument, match="not a mixture"):
        led.index(0, source=1)


def test_a_job_of_generations_and_one_of_replica_groups_are_both_histories() -> None:
    assert isinstance(history("g", SPEC, []), Ledger)
    assert isinstance(history("ft", SPEC, [], _record().runs), QuorumLedger)


def test_the_lineage_walk_refuses_a_cycle_and_the_record_a_run_that_would_make_one() -> None:
    parents = {"x": "y", "y": "x"}
    runs = {name: [name] for name in parents}  # objects to walk: a run is one object
    with pytest.raises(LineageCycle, match="comes back to a run"):
        lineage(runs["x"], lambda r: (runs[parents[r[0]]], 0))
    assert lineage(runs["x"], lambda r: None) == [(runs["x"], None)]
    s = Steps()
    assert s.record("x", "y", 1, "global", 4, _c(2, 1, 1))  # run y is not known yet
    why = s.check("y", "x", 1, "global", 4, _c(2, 2, 1))
    assert why is not None and "cannot be its own ancestor" in why


def test_a_record_with_a_cycle_is_refused_by_the_ledger() -> None:
    s = Steps()
    s.record("x", "y", 1, "global", 4, _c(2, 1, 1))
    s.record("y", "x", 1, "global", 4, _c(2, 2, 1))  # recorded without the check (as a journal might replay)
    with pytest.raises(FailedPrecondition, match="make a cycle"):
        QuorumLedger("ft", SPEC, s)


def test_the_stored_form_of_a_committed_step_is_the_count_before_it() -> None:
    """The wire, the journal and snapshots carry the steps committed before a step, as every release wrote."""
    c = _c(3, 7, 2)
    assert c.to_list() == [2, 8, 12, 7, 2] and CommittedStep.from_list([2, 8, 12, 7, 2]) == c
    assert np.array_equal(stream_indices(SPEC, c.start, c.stop), stream_indices(SPEC, 8, 12))
