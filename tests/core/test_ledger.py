"""The step ledger against a trainer simulated batch by batch: what each step trained, kept and abandoned.

The model is a training loop, not arithmetic: each rank takes its next batch from the epoch's plan,
a step ends when every rank has accumulated the step's micro-batches or the epoch ran out, a
checkpoint after every step is the plan's ``advance`` (what a sampler's state names), and a rollback
moves the steps after it to the abandoned versions. The ledger sees only the segments a coordinator
records (worlds, resume points and steps, reports); it must agree on every step and every index.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from croupier.core.cursor import Cursor, bind, fresh
from croupier.core.errors import FailedPrecondition, InvalidArgument, OutOfRange
from croupier.core.ledger import Ledger, Segment
from croupier.core.registry import plan_epoch
from croupier.core.schedule import Schedule
from croupier.core.spec import Spec
from tests._budget import examples


@dataclasses.dataclass
class Model:
    """A trainer's run: every version of every step, and the timeline's."""

    spec: Spec
    versions: dict[int, list[tuple[int, list[tuple[int, int, list[int]]]]]] = dataclasses.field(default_factory=dict)
    timeline: dict[int, int] = dataclasses.field(default_factory=dict)  # step -> generation kept
    checkpoints: dict[int, tuple[Cursor, int]] = dataclasses.field(default_factory=dict)
    segments: list[Segment] = dataclasses.field(default_factory=list)

    def generation(self, world: int, steps: int, resume: int | None, schedule: Schedule) -> None:
        """A generation of `world` ranks resuming at step `resume` (None: the latest) and training `steps` steps."""
        g = len(self.segments) + 1
        if resume is None:
            resume = max(self.checkpoints, default=0)
        cursor, parent = self.checkpoints.get(resume, (fresh(self.spec, 0), None))
        start = bind(self.spec, cursor, world)
        seg = Segment(g, f"inc{g}", world, start, resume, parent, schedule)
        self.segments.append(seg)
        for t in [t for t in self.timeline if t > resume]:
            del self.timeline[t]
        for t in [t for t in self.checkpoints if t > resume]:
            del self.checkpoints[t]
        t, epoch = resume, start.epoch
        while steps > 0:
            plan = plan_epoch(self.spec, start, world, epoch)
            if plan is None:
                epoch += 1
                continue
            taken = 0  # batches every rank has taken of this epoch's plan
            while steps > 0:
                a = schedule.at(self.spec, world, t + 1)
                got: list[tuple[int, int, list[int]]] = []
                for micro in range(a):
                    for rank in range(world):
                        idx, sizes = plan.lease(rank, taken + micro, 1)
                        if sizes:
                            got.append((rank, micro, idx.tolist()))
                if not got:
                    if not taken:  # an epoch with nothing to deal (a drop tail on a bigger world): so are all
                        return
                    break
                t += 1
                steps -= 1
                taken += a
                seg.report(epoch, min(taken, max(plan.steps(r) for r in range(world))))
                got.sort()
                self.versions.setdefault(t, []).append((g, got))
                self.timeline[t] = g
                after = plan.advance(taken)
                self.checkpoints[t] = (after, g)
                seg.checkpoint(t)
            epoch += 1


def _check(model: Model) -> None:
    ledger = Ledger("job", model.spec, model.segments)
    if not model.timeline:  # nothing to deal at all (a drop tail on a world bigger than the epoch)
        assert ledger.last_step == 0
        return
    last = max(model.timeline)
    assert ledger.last_step == last
    with pytest.raises(OutOfRange):
        ledger.step(max(model.versions) + 1)
    for t, versions in model.versions.items():
        rec = ledger.step(t)
        kept_gen = model.timeline.get(t)
        got_kept = None if rec.kept is None else (rec.kept.generation, sorted(
            (b.rank, b.micro, b.indices.tolist()) for b in rec.kept.batches))
        want_kept = next(((g, b) for g, b in versions if g == kept_gen), None)
        assert got_kept == want_kept, f"step {t}"
        got_ab = sorted((v.generation, sorted((b.rank, b.micro, b.indices.tolist()) for b in v.batches))
                        for v in rec.abandoned)
        assert got_ab == sorted((g, b) for g, b in versions if g != kept_gen), f"step {t}"
    # every index: where the model trained it, kept or abandoned
    where: dict[int, list[tuple[int, int, int, int, bool]]] = {}
    for t, versions in model.versions.items():
        for g, batches in versions:
            for rank, micro, idx in batches:
                for i in idx:
                    where.setdefault(i, []).append((t, rank, g, micro, model.timeline.get(t) == g))
    for i in range(model.spec.n):
        got = sorted((o.step, o.rank, o.generation, o.micro, o.kept) for o in ledger.index(i))
        assert got == sorted(where.get(i, [])), f"index {i}"


specs = st.builds(
    lambda n, b, partition, tail, perm, drop, even: Spec(n=n, seed=7, batch_size=b, partition=partition, tail=tail,
                                                         permutation=perm, drop_last_batch=drop, even_batches=even),
    st.integers(5, 60), st.integers(1, 4), st.sampled_from(["strided", "chunked", "contiguous"]),
    st.sampled_from(["pad", "drop", "uneven", "pad_last"]), st.sampled_from(["feistel", "none", "torch", "window"])
    .map(lambda p: p), st.booleans(), st.booleans())


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs, gens=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 12), st.integers(0, 3), st.integers(1, 2)),
                                 min_size=1, max_size=5))
def test_steps_and_indices_agree_with_a_simulated_trainer(spec: Spec, gens: list[tuple[int, int, int, int]]) -> None:
    if spec.permutation == "window":
        spec = dataclasses.replace(spec, buffer_size=7)
    model = Model(spec)
    for world, steps, back, accumulate in gens:
        resume = None
        if back and model.checkpoints:
            resume = max(0, max(model.checkpoints) - back)
        model.generation(world, steps, resume, Schedule(spec.batch_size * world * accumulate if accumulate > 1 else 0))
    _check(model)


def test_a_rampup_grows_the_global_batch_by_steps() -> None:
    spec = Spec(n=400, seed=3, batch_size=2)
    model = Model(spec)
    sched = Schedule(global_batch=16, rampup=(4, 4, 3))  # 4 samples for 3 steps, then 8, 12, then 16
    model.generation(2, 14, None, sched)
    model.generation(2, 6, 7, sched)  # a rollback into the ramp
    _check(model)
    ledger = Ledger("job", spec, model.segments)
    sizes = [ledger.step(t).kept.indices.size for t in range(1, 14)]  # type: ignore[union-attr]
    assert sizes == [4, 4, 4, 8, 8, 8, 12, 12, 12, 16, 16, 16, 16]


def test_a_replaced_generation_keeps_its_steps_up_to_a_checkpoint_no_report_placed() -> None:
    """A generation whose ranks' only report is a checkpoint at an epoch's end (an epoch one lease long
    asks for its grant before the loop takes a batch; the checkpoint names the next epoch's start, 0
    micro-batches): once a later generation resumed from that checkpoint, its steps are still placed."""
    spec = Spec(n=4, seed=5, batch_size=2)  # one step per epoch on 2 ranks
    model = Model(spec)
    model.generation(2, 3, None, Schedule())
    first = model.segments[0]
    first.reached.clear()
    first.checkpoints = [3]
    first.report(3, 0)  # what the coordinator heard of it: step 3's checkpoint, at epoch 3's start
    model.generation(3, 2, None, Schedule())  # resumes from that checkpoint
    ledger = Ledger("job", spec, model.segments)
    assert [r.kept and r.kept.generation for r in ledger.steps(1, 5)] == [1, 1, 1, 2, 2]
    _check(model)


def test_errors_name_the_value_and_the_reason() -> None:
    spec = Spec(n=50, batch_size=2)
    model = Model(spec)
    model.generation(2, 5, None, Schedule())
    ledger = Ledger("job", spec, model.segments)
    with pytest.raises(InvalidArgument, match="step must be an int >= 1"):
        ledger.step(-1)
    with pytest.raises(OutOfRange, match="step 6 is past the run: job 'job' has trained 5 steps"):
        ledger.step(6)
    # a coordinator that holds the run from step 3 on only
    later = Ledger("job", spec, [dataclasses.replace(model.segments[0], step=3, parent=None,
                                                      start=model.checkpoints[3][0])])
    with pytest.raises(FailedPrecondition, match="history before step 4 is missing"):
        later.step(2)
    assert later.step(4).kept is not None
    with pytest.raises(FailedPrecondition, match="does not divide"):
        Schedule(global_batch=10).check(spec, 4)
    with pytest.raises(InvalidArgument, match="rampup"):
        Schedule(global_batch=10, rampup=(4, 4, 2))


def test_what_it_stores_does_not_grow_with_steps() -> None:
    spec = Spec(n=10**10, batch_size=8)
    seg = Segment(1, "a", 1024, fresh(spec, 0), 0, None)
    seg.report(0, 10**6)
    ledger = Ledger("job", spec, [seg])
    assert ledger.last_step == 10**6
    rec = ledger.step(777_777)
    assert rec.kept is not None and rec.kept.indices.size == 8 * 1024
    i = int(rec.kept.batches[5].indices[3])
    occ = [o for o in ledger.index(i) if o.epoch == 0]
    assert [(o.step, o.rank) for o in occ] == [(777_777, 5)]
    assert np.unique(rec.kept.indices).size == rec.kept.indices.size


@pytest.mark.parametrize("field, value, says", [
    ("generation", "1", "generation must be an int (got generation='1')"),
    ("at_ms", True, "at_ms must be an int (got at_ms=True)"),
    ("step", 2.5, "step must be an int (got step=2.5)"),
    ("incarnation", 5, "incarnation must be of type str (got int)"),
])
def test_a_malformed_segment_is_refused_by_name(field: str, value: object, says: str) -> None:
    """What GetLedger and a snapshot carry of a segment, read back: a field of the wrong type is named."""
    d = Segment(1, "a", 2, fresh(Spec(n=50, batch_size=2), 0), 0, None).to_dict()
    assert Segment.from_dict(d).to_dict() == d
    with pytest.raises(ValueError, match=re.escape(f"segment is malformed: {says}")):
        Segment.from_dict({**d, field: value})
