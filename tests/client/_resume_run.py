"""A batch-sampler job killed mid-epoch and resumed under another world, and the checks of its run."""


from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from _ranks import Ranks
from _resume_cases import (
    Batches,
    Case,
    Segment,
    assert_within_packs,
    audit_epoch,
    expected_cursor,
    lengths_for,
    pack_ids,
    plan_batches,
    remaining_positions,
)

from croupier.core.checkpoint import from_state
from croupier.core.order import Cursor, FixedPlan, bind, fixed_plan, fresh
from croupier.core.spec import Spec
from croupier.server._service import Server

# --------------------------------------------------------------------------- the job


def drain(ranks: Ranks) -> Batches:
    """Lockstep steps until every rank's epoch has ended; each rank's batches."""
    out: Batches = [[] for _ in ranks.samplers]
    live = set(range(len(out)))
    while live:
        for r in sorted(live):
            b = ranks.next(r)
            if b is None:
                live.discard(r)
            else:
                out[r].append(b)
    return out


@dataclasses.dataclass
class Run:
    """What a kill-and-resize run of a Case received and saved, for the checks to judge.

    Attributes:
        case: The scenario.
        job: The job's name.
        spec: The job's spec.
        epoch: The epoch the checkpoint was taken in.
        k: Lockstep steps W1 took in it.
        plan1: The plan W1 served that epoch from.
        w1_batches: What each W1 rank received in the k steps.
        ended: Per W1 rank, whether its epoch had ended (its iterator was exhausted) at the save.
        states: Every W1 rank's ``state_dict()`` at the save.
        cursor: Rank 0's state, read back.
        plan2: The plan of the loaded cursor for W2 (bound to W2 at an epoch start).
        w2_batches: What each W2 rank received to the end of the epoch it resumed.
        lens_before: ``len()`` of each W2 rank that loaded the state, before its first batch (None: loaded nothing).
        lens_joined: ``len()`` of each W2 rank once the generation started.
        whole_epochs: (plan, batches received, len() before the epoch) of each warm-up epoch of
            W1 and of the epoch W2 runs after the one it resumed.
    """

    case: Case
    job: str
    spec: Spec
    epoch: int
    k: int
    plan1: FixedPlan
    w1_batches: Batches
    ended: list[bool]
    states: list[dict[str, Any]]
    cursor: Cursor
    plan2: FixedPlan
    w2_batches: Batches
    lens_before: list[int | None]
    lens_joined: list[int]
    whole_epochs: list[tuple[FixedPlan, Batches, list[int]]]

    def segments(self) -> list[Segment]:
        """The segments of the checkpoint's epoch (one when the checkpoint is at its end)."""
        if self.cursor.epoch != self.epoch:
            return [Segment(self.plan1, None)]
        return [Segment(self.plan1, self.k), Segment(self.plan2, None)]

    def trained(self) -> list[int]:
        """Every index the loops received in the checkpoint's epoch."""
        got = [i for rb in self.w1_batches for b in rb for i in b]
        if self.cursor.epoch == self.epoch:
            got += [i for rb in self.w2_batches for b in rb for i in b]
        return got


def steps_for(case: Case, p: FixedPlan) -> int:
    """The k lockstep steps W1 takes in the checkpoint's epoch."""
    most = int(p.nb_r.max())
    if case.stop is not None:
        return most + {"last-batch": 0, "after-end": 1}[case.stop]
    if case.k is not None:
        return case.k
    assert most >= 2, f"case {case.id} has {most} batch(es) on its busiest rank: no mid-epoch checkpoint"
    return min(most - 1, max(1, round(most * case.at)))


def kill_and_resize(server: Server, case: Case) -> Run:
    """Runs the case's job: W1 to the checkpoint, the kill, W2 from the checkpoint to the next epoch's end."""
    job = f"{case.id[:60]}-{uuid.uuid4().hex[:8]}"
    spec = case.spec()
    whole: list[tuple[FixedPlan, Batches, list[int]]] = []

    # ---- world W1, incarnation "a"
    first = [case.sampler(server.address, job, f"{job}/a", case.w1, r) for r in range(case.w1)]

    def next_epoch(e: int) -> list[int]:
        """The loop's epoch line (``set_epoch`` when the case's loop calls it); len() of every rank."""
        if case.set_epoch:
            for s in first:
                s.set_epoch(e)
        return [len(s) for s in first]

    lens = next_epoch(0)  # before the first batch: nothing joined yet
    ranks = Ranks(first)
    try:
        for e in range(case.warmup_epochs):
            if e:
                ranks.new_iterators()
                lens = next_epoch(e)
            whole.append((fixed_plan(spec, bind(spec, fresh(spec, e), case.w1), case.w1), drain(ranks), lens))
        epoch = case.warmup_epochs
        if epoch:
            ranks.new_iterators()
            lens = next_epoch(epoch)
        lens1 = lens
        p1 = fixed_plan(spec, bind(spec, fresh(spec, epoch), case.w1), case.w1)
        assert lens1 == p1.nb_r.tolist(), f"len() of the W1 ranks {lens1} != the plan's batch counts"
        k = steps_for(case, p1)
        w1: Batches = [[] for _ in range(case.w1)]
        ended = [False] * case.w1
        for _ in range(k):
            for r in range(case.w1):
                b = ranks.next(r)
                if b is None:
                    ended[r] = True
                else:
                    w1[r].append(b)
        states = [s.state_dict() for s in first]
    finally:
        ranks.close()  # the kill: nothing of W1 is used again

    state = states[0]
    cursor = from_state(job, spec, state)
    assert cursor is not None

    # ---- world W2, incarnation "b"
    second = [case.sampler(server.address, job, f"{job}/b", case.w2, r) for r in range(case.w2)]
    loads = [not (case.stateless and r >= case.w1) for r in range(case.w2)]
    for s, load in zip(second, loads):
        if load:
            s.load_state_dict(state)
        if case.set_epoch:
            s.set_epoch(cursor.epoch)
    lens_before: list[int | None] = [len(s) if load else None for s, load in zip(second, loads)]
    p2 = fixed_plan(spec, bind(spec, cursor, case.w2), case.w2)
    ranks = Ranks(second)
    try:
        lens_joined = [len(s) for s in second]
        w2 = drain(ranks)
        ranks.new_iterators()
        nxt = cursor.epoch + 1
        if case.set_epoch:
            for s in second:
                s.set_epoch(nxt)
        lens = [len(s) for s in second]
        whole.append((fixed_plan(spec, bind(spec, fresh(spec, nxt), case.w2), case.w2), drain(ranks), lens))
    finally:
        ranks.close()
    return Run(case, job, spec, epoch, k, p1, w1, ended, states, cursor, p2, w2, lens_before, lens_joined, whole)


# --------------------------------------------------------------------------- the checks


def check_states_agree(run: Run) -> None:
    """Every W1 rank still in its epoch saves rank 0's state, apart from "origin" and "items" (the rank's own).

    A rank that has had its last batch (a short share: uneven tails, chunked parts) reports its
    own epoch as finished; the job's checkpoint is rank 0's, which always has the most batches.
    """
    # A rank's epoch ends once its last batch is handed out (no call past it needed).
    ended = [e or len(got) >= int(run.plan1.nb_r[r]) for r, (e, got) in enumerate(zip(run.ended, run.w1_batches))]
    ref = {k: v for k, v in run.states[0].items() if k not in ("origin", "items")}
    for r, st in enumerate(run.states):
        if ended[0] or not ended[r]:  # once rank 0's epoch has ended, every rank's has
            assert {k: v for k, v in st.items() if k not in ("origin", "items")} == ref, f"rank {r}'s state differs from rank 0's"


def check_cursor(run: Run) -> None:
    """The saved cursor names exactly the positions no W1 rank was served (brute force)."""
    epoch, left = expected_cursor(run.plan1, run.k)
    got = set(remaining_positions(run.cursor).tolist())
    assert run.cursor.epoch == epoch, f"checkpoint in epoch {run.cursor.epoch}, expected {epoch}"
    assert not got - left, f"the checkpoint re-serves positions {sorted(got - left)[:10]} ({len(got - left)})"
    assert not left - got, f"the checkpoint skips positions {sorted(left - got)[:10]} ({len(left - got)})"
    assert run.cursor.base_world == (run.plan1.cursor.base_world if epoch == run.epoch else 0)


def check_batches_follow_plans(run: Run) -> None:
    """W1's first k steps and all of W2 are, batch for batch, what fixed_plan() computes for their starts."""
    assert run.w1_batches == plan_batches(run.plan1, run.k), "W1's batches differ from its plan"
    assert run.w2_batches == plan_batches(run.plan2), "the resumed world's batches differ from fixed_plan(spec, cursor, W2)"
    for p, got, _ in run.whole_epochs:
        assert got == plan_batches(p), f"epoch {p.cursor.epoch} at world {p.world} differs from its plan"


def check_lens(run: Run) -> None:
    """len(sampler) is the rank's whole share of the epoch: the batches the checkpointing rank had
    taken in it before the checkpoint, plus the batches the rank then gets (before its first batch
    when it can know)."""
    counts = [len(rb) for rb in run.w2_batches]
    _, at_epoch, at_items = run.states[0]["origin"].rsplit("/", 2)
    taken = int(at_items) if int(at_epoch) == run.cursor.epoch else 0
    if run.case.w2 != run.case.w1 and None in run.lens_before:
        # A rank that loaded no state counts what was taken in the new world's batches; only
        # the ranks that loaded the state know the checkpointing rank's count.
        counts = [c for c, b in zip(counts, run.lens_before) if b is not None]
    for r, (before, joined, got) in enumerate(zip(run.lens_before, run.lens_joined, counts)):
        if before is not None:  # loaded the state: knows its share before joining
            assert before == taken + got, f"W2 rank {r}: len() {before} before its first batch, then {taken} + {got} batches"
        if got > 1:  # once joined (its first batch taken; a rank with at most one has finished the epoch)
            assert joined == taken + got, f"W2 rank {r}: len() {joined} once joined, then {taken} + {got} batches"
    for p, batches, lens in run.whole_epochs:
        assert lens == [len(rb) for rb in batches], f"epoch {p.cursor.epoch}: len() {lens} != batches received"


def check_everything(run: Run) -> None:
    """Every check of a kill-and-resize run."""
    check_states_agree(run)
    check_cursor(run)
    check_batches_follow_plans(run)
    check_lens(run)
    audit_epoch(run.spec, run.trained(), run.segments())
    if run.cursor.epoch != run.epoch:  # the checkpoint was at the epoch's end: W2 ran the next one whole
        audit_epoch(run.spec, [i for rb in run.w2_batches for b in rb for i in b], [Segment(run.plan2, None)])
    for p, got, _ in run.whole_epochs:
        audit_epoch(run.spec, [i for rb in got for b in rb for i in b], [Segment(p, None)])
    if run.case.bucket is not None and run.case.packs_promised:
        ids = pack_ids(lengths_for(run.spec.n), *run.case.bucket)
        strided = run.spec.partition == "strided"
        assert_within_packs(run.w1_batches, ids, strided, "before the kill")
        assert_within_packs(run.w2_batches, ids, strided, "after the resume")
        for p, got, _ in run.whole_epochs:
            assert_within_packs(got, ids, strided, f"epoch {p.cursor.epoch} at world {p.world}")


