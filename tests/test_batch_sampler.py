"""DistributedBatchSampler killed mid-epoch and resumed under another world size, audited for exactly-once.

Every case runs a world of W1 ranks for k lockstep steps (each rank takes one batch per step),
saves rank 0's ``state_dict()``, closes every sampler (the kill), starts a world of W2 ranks with
a new incarnation token that loads the state, and runs the epoch (and the next one) to its end.
What the training loops received in the epoch -- W1's batches before the checkpoint and W2's
after it -- is then checked three ways:

* the exactly-once rule of the tail policy (W the final world): ``uneven``: every index of
  [0, N) once; ``drop``: none twice, fewer than W missing; ``pad`` / ``pad_last``: each at least
  once, fewer than W repeats (chunked / contiguous: each generation that trained padding may add
  fewer than its own W, see the NOTE of ``tests/_sim.py`` ``Job.allowance``);
* exactly: the multiset received is every index once, minus what the final plan drops on
  purpose (``drop_last`` / ``even_batches`` and the ``drop`` tail), plus the padding the plans
  serve (see :func:`audit_epoch`);
* batch for batch: each world gets what :func:`croupier.core.order.plan` computes for its start.

The checkpoint cursor itself is compared with a brute-force recomputation (the positions no rank
has been served yet), which does not use :meth:`Plan.advance`, the function that makes it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _ranks import Ranks

from croupier.client import DistributedBatchSampler
from croupier.core.checkpoint import from_state, to_state
from croupier.core.order import Cursor, Plan, bind, fresh, order, plan
from croupier.core.spec import PARTITIONS, TAILS, Spec
from croupier.server._service import Server

SEED = 11

Batches = list[list[list[int]]]  # per rank, the batches it received, in order


class G1Violation(AssertionError):
    """What the training loops received in an epoch breaks the exactly-once rule of its tail policy."""


def lengths_for(n: int) -> list[int]:
    """Per-sample lengths for bucketing, with ties (so the sort's tie-break by index matters)."""
    return [(i * 37) % 23 + i % 5 for i in range(n)]


# --------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One kill-and-resize scenario of a DistributedBatchSampler job.

    Attributes:
        n: Dataset size.
        batch_size: Indices per batch of one rank.
        tail: The sampler's ``tail=``.
        partition: The sampler's ``partition=``.
        drop_last: Drop a rank's last incomplete batch.
        even_batches: Every rank gets as many batches as the rank with fewest.
        w1: World size before the kill.
        w2: World size after the restart.
        at: Where W1 is killed: this fraction of its busiest rank's batches (at least one step,
            and before the epoch's last step, so the checkpoint is mid-epoch).
        k: Overrides `at`: exactly k lockstep steps.
        stop: Overrides `at` and `k`: ``"last-batch"``: as many steps as the busiest rank has
            batches (every rank took its last batch, none has seen its iterator end);
            ``"after-end"``: one step more (every iterator is exhausted). Both put the
            checkpoint at the epoch's end.
        bucket: ``(buffer_size, pack_size)``: ``permutation="bucket"`` with :func:`lengths_for`.
        packs_promised: The case's sizes keep every batch inside one pack, before and after the
            resume (see :func:`assert_within_packs`).
        scope: The sampler's ``scope=``.
        permutation: The sampler's ``permutation=`` (None: its default).
        buffer_size: The sampler's ``buffer_size=`` (for ``window``).
        warmup_epochs: Whole epochs W1 trains (and the test audits) before the checkpoint's epoch.
        stateless: Ranks that a scale-up adds (rank >= w1) load nothing; only the others load the state.
        set_epoch: The loops call ``set_epoch`` as torch's usual epoch loop does.
    """

    n: int
    batch_size: int
    tail: str = "uneven"
    partition: str = "strided"
    drop_last: bool = False
    even_batches: bool = False
    w1: int = 3
    w2: int = 2
    at: float = 0.5
    k: int | None = None
    stop: str | None = None
    bucket: tuple[int, int] | None = None
    packs_promised: bool = False
    scope: str = "global"
    permutation: str | None = None
    buffer_size: int | None = None
    warmup_epochs: int = 0
    stateless: bool = False
    set_epoch: bool = False

    @property
    def id(self) -> str:
        """A readable pytest id."""
        parts = [self.tail, self.partition]
        if self.bucket:
            parts.append(f"bucket{self.bucket[0]}x{self.bucket[1]}")
        if self.scope != "global":
            parts.append(f"scope-{self.scope}-{self.permutation}")
        parts.append("drop_last" if self.drop_last else "keep_last")
        if self.even_batches:
            parts.append("even_batches")
        parts.append(f"{self.w1}to{self.w2}")
        parts.append(f"n{self.n}b{self.batch_size}")
        if self.stateless:
            parts.append("new-ranks-load-nothing")
        if self.warmup_epochs:
            parts.append(f"after-{self.warmup_epochs}-epochs")
        if self.set_epoch:
            parts.append("set_epoch")
        if self.stop:
            parts.insert(0, self.stop)
        return "-".join(parts)

    def sampler(self, address: str, job: str, token: str, world: int, rank: int) -> DistributedBatchSampler:
        """Rank `rank` of a world of `world` ranks of this case's job."""
        kw: dict[str, Any] = {}
        if self.bucket is not None:
            kw = dict(permutation="bucket", lengths=lengths_for(self.n), buffer_size=self.bucket[0],
                      pack_size=self.bucket[1])
        elif self.permutation is not None:
            kw = dict(permutation=self.permutation, buffer_size=self.buffer_size)
        return DistributedBatchSampler(self.n, self.batch_size, world, rank, shuffle=True, seed=SEED,
                                       drop_last=self.drop_last, address=address, job=job, token=token,
                                       partition=self.partition, tail=self.tail, even_batches=self.even_batches,
                                       scope=self.scope, lease_ahead=3, **kw)

    def spec(self) -> Spec:
        """The spec this case's samplers send (no coordinator is contacted to make it)."""
        return self.sampler("unused:0", "spec", "t", 1, 0).spec


# --------------------------------------------------------------------------- the oracle


def remaining_positions(cursor: Cursor) -> np.ndarray:
    """The positions a cursor has left, in the order the engine lays them end to end."""
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in cursor.remaining])


def virtual_of(partition: str, t: int, world: int, rank: int, local: np.ndarray) -> np.ndarray:
    """Virtual positions of rank's local positions, from the partition's definition (see core/spec.py)."""
    if partition == "strided":
        return rank + local * world
    if partition == "chunked":
        return min(rank * -(-t // world), t) + local
    q, m = divmod(t, world)
    return rank * q + min(rank, m) + local


@dataclasses.dataclass(frozen=True)
class Segment:
    """One generation's share of an epoch: the plan it was served from and how many lockstep steps it took.

    Attributes:
        plan: The plan of the generation's start in the epoch, for its world.
        steps: Lockstep steps every rank took (a rank with fewer batches took all of its own);
            None: to the end of the epoch.
    """

    plan: Plan
    steps: int | None

    def served_locals(self, rank: int) -> np.ndarray:
        """Local positions of `rank` that it was served."""
        p = self.plan
        taken = int(p.nb_r[rank]) if self.steps is None else min(self.steps, int(p.nb_r[rank]))
        return np.arange(min(taken * p.spec.batch_size, int(p.n_r[rank])), dtype=np.int64)

    def served(self) -> tuple[np.ndarray, np.ndarray]:
        """(real order positions served, padding order positions served), over every rank."""
        p, spec = self.plan, self.plan.spec
        rem = remaining_positions(p.cursor)
        real: list[np.ndarray] = []
        pad: list[np.ndarray] = []
        for r in range(p.world):
            v = virtual_of(spec.partition, p.t, p.world, r, self.served_locals(r))
            real.append(rem[v[v < p.left]])
            extra = v[v >= p.left]
            # pad: repeat from the start of the epoch's order; pad_last: the order's last position.
            pad.append((extra - p.left) % spec.n if spec.tail == "pad" else np.full(extra.shape, spec.n - 1))
        return np.concatenate(real), np.concatenate(pad).astype(np.int64)

    def dropped(self) -> tuple[np.ndarray, np.ndarray]:
        """(positions the tail drops, real positions ``drop_last`` / ``even_batches`` drop) of a final plan.

        Tail ``drop`` deals virtual [T, R) to no rank; a rank's local positions past its last
        served batch, min(nb_r * batch_size, n_r) .. n_r, are dealt but never served. Only the
        plan that finishes the epoch drops: a generation killed mid-epoch leaves all it did not
        serve in the checkpoint, and the next world deals it out again.
        """
        p, spec = self.plan, self.plan.spec
        rem = remaining_positions(p.cursor)
        tail = rem[np.arange(p.t, p.left, dtype=np.int64)] if p.t < p.left else np.zeros(0, dtype=np.int64)
        batch: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
        for r in range(p.world):
            lo = min(int(p.nb_r[r]) * spec.batch_size, int(p.n_r[r]))
            v = virtual_of(spec.partition, p.t, p.world, r, np.arange(lo, int(p.n_r[r]), dtype=np.int64))
            batch.append(rem[v[v < p.left]])
        return tail, np.concatenate(batch)

    def indices(self, positions: np.ndarray) -> list[int]:
        """Dataset indices of order positions of this segment's epoch."""
        c = self.plan.cursor
        return order(self.plan.spec, c.epoch, positions, c.base_world).tolist()  # type: ignore[no-any-return]


def audit_epoch(spec: Spec, trained: Sequence[int], segments: Sequence[Segment]) -> None:
    """Checks what the loops received in one finished epoch, served by `segments` (the last finished it).

    Raises:
        G1Violation: the tail policy's rule is broken, or the multiset received is not exactly
            every index once, minus what the final plan drops, plus the padding served.
    """
    audit_rule(spec, trained, segments)
    audit_exact(spec, trained, segments)


def audit_rule(spec: Spec, trained: Sequence[int], segments: Sequence[Segment]) -> None:
    """The tail policy's exactly-once rule, with what drop_last / even_batches leave out on purpose.

    Raises:
        G1Violation: more missing or more repeated than the rule allows.
    """
    final = segments[-1]
    assert final.steps is None, "the last segment must finish the epoch"
    n, w = spec.n, final.plan.world
    seen = collections.Counter(trained)
    bad = sorted(i for i in seen if not 0 <= i < n)
    if bad:
        raise G1Violation(f"indices out of [0, {n}): {bad[:10]}")
    _, batch_drop = final.dropped()
    missing = n - len(seen)
    repeats = len(trained) - len(seen)
    # The rule, W the final world. drop_last and even_batches leave out exactly len(batch_drop)
    # samples on purpose (real positions past a rank's last batch, from Plan.nb_r and n_r): they
    # add to what may be missing and to nothing else.
    may_miss = (w - 1 if spec.tail == "drop" else 0) + len(batch_drop)
    if spec.tail not in ("pad", "pad_last"):
        may_repeat = 0
    elif spec.partition == "strided":
        may_repeat = w - 1  # strided padding is dealt in the epoch's last step: only the final world pads
    else:
        may_repeat = sum(s.plan.world - 1 for s in segments)
    if missing > may_miss or repeats > may_repeat:
        raise G1Violation(
            f"tail {spec.tail}, partition {spec.partition}, worlds {[s.plan.world for s in segments]}: "
            f"{missing} missing (at most {may_miss}: {len(batch_drop)} dropped by drop_last/even_batches) and "
            f"{repeats} repeats (at most {may_repeat}), N={n}"
        )


def audit_exact(spec: Spec, trained: Sequence[int], segments: Sequence[Segment]) -> None:
    """The multiset received is exactly what the plans serve: [0, N) once, minus drops, plus padding.

    Raises:
        G1Violation: naming what was received beyond that and what it lacks.
    """
    final = segments[-1]
    assert final.steps is None, "the last segment must finish the epoch"
    n = spec.n
    seen = collections.Counter(trained)
    tail_drop, batch_drop = final.dropped()
    # Exactly: no sample twice beyond the padding the plans served, none missing beyond what the
    # final plan drops. Dropped positions are distinct real positions, so each removes one index.
    expected = collections.Counter(range(n))
    expected.subtract(final.indices(np.concatenate([tail_drop, batch_drop])))
    for s in segments:
        expected.update(s.indices(s.served()[1]))
    expected = +expected
    if seen != expected:
        extra = sorted((seen - expected).elements())
        lacking = sorted((expected - seen).elements())
        raise G1Violation(f"received {len(extra)} indices beyond what the plans serve {extra[:10]} and lacks "
                          f"{len(lacking)} they serve {lacking[:10]} (N={n})")


def expected_cursor(p: Plan, k: int) -> tuple[int, set[int]]:
    """Brute force, without Plan.advance: (epoch, positions left) once every rank of `p` took k steps."""
    if k >= int(p.nb_r.max()):
        return p.cursor.epoch + 1, set(range(p.spec.n))
    served, _ = Segment(p, k).served()
    return p.cursor.epoch, set(remaining_positions(p.cursor).tolist()) - set(served.tolist())


def plan_batches(p: Plan, steps: int | None = None) -> Batches:
    """Every rank's batches of plan `p` (the first `steps` of each; None: all), as the engine computes them."""
    out: Batches = []
    for r in range(p.world):
        got: list[list[int]] = []
        while (steps is None or len(got) < steps) and (b := p.batch_indices(r, len(got))) is not None:
            got.append(b.tolist())
        out.append(got)
    return out


def pack_ids(lengths: Sequence[int], buffer_size: int, pack_size: int) -> np.ndarray:
    """d9d's packs, independently: each window of buffer_size sorted by (length, index), cut in pack_size.

    The pack shuffle only reorders whole packs, so which indices share a pack does not depend on
    the epoch or the seed.
    """
    n = len(lengths)
    ids = np.empty(n, dtype=np.int64)
    pack = itertools.count()
    for start in range(0, n, buffer_size):
        ranked = sorted(range(start, min(start + buffer_size, n)), key=lambda i: (lengths[i], i))
        for a in range(0, len(ranked), pack_size):
            ids[ranked[a : a + pack_size]] = next(pack)
    return ids


def assert_within_packs(batches: Batches, ids: np.ndarray, strided: bool, what: str) -> None:
    """Every batch lies inside one pack; with a strided partition, so does every lockstep step's union.

    Raises:
        AssertionError: naming the first batch (or step) that spans several packs.
    """
    for r, rank_batches in enumerate(batches):
        for j, b in enumerate(rank_batches):
            packs = set(ids[b].tolist())
            assert len(packs) == 1, f"{what}: batch {j} of rank {r} spans packs {sorted(packs)}: {b}"
    if strided:
        for j in range(max(map(len, batches), default=0)):
            step = [i for rb in batches if j < len(rb) for i in rb[j]]
            packs = set(ids[step].tolist())
            assert len(packs) == 1, f"{what}: step {j} spans packs {sorted(packs)}"


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
    plan1: Plan
    w1_batches: Batches
    ended: list[bool]
    states: list[dict[str, Any]]
    cursor: Cursor
    plan2: Plan
    w2_batches: Batches
    lens_before: list[int | None]
    lens_joined: list[int]
    whole_epochs: list[tuple[Plan, Batches, list[int]]]

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


def steps_for(case: Case, p: Plan) -> int:
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
    whole: list[tuple[Plan, Batches, list[int]]] = []

    # ---- world W1, incarnation token "a"
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
            whole.append((plan(spec, bind(spec, fresh(spec, e), case.w1), case.w1), drain(ranks), lens))
        epoch = case.warmup_epochs
        if epoch:
            ranks.new_iterators()
            lens = next_epoch(epoch)
        lens1 = lens
        p1 = plan(spec, bind(spec, fresh(spec, epoch), case.w1), case.w1)
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

    # ---- world W2, incarnation token "b"
    second = [case.sampler(server.address, job, f"{job}/b", case.w2, r) for r in range(case.w2)]
    loads = [not (case.stateless and r >= case.w1) for r in range(case.w2)]
    for s, load in zip(second, loads):
        if load:
            s.load_state_dict(state)
        if case.set_epoch:
            s.set_epoch(cursor.epoch)
    lens_before: list[int | None] = [len(s) if load else None for s, load in zip(second, loads)]
    p2 = plan(spec, bind(spec, cursor, case.w2), case.w2)
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
        whole.append((plan(spec, bind(spec, fresh(spec, nxt), case.w2), case.w2), drain(ranks), lens))
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
    """W1's first k steps and all of W2 are, batch for batch, what plan() computes for their starts."""
    assert run.w1_batches == plan_batches(run.plan1, run.k), "W1's batches differ from its plan"
    assert run.w2_batches == plan_batches(run.plan2), "the resumed world's batches differ from plan(spec, cursor, W2)"
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


# --------------------------------------------------------------------------- the matrix

RESIZES = [(3, 2), (2, 5), (4, 1), (1, 3), (5, 2), (2, 4)]
SIZES = [23, 29, 31, 37, 41, 43, 47, 53, 59, 61]


def matrix() -> Iterator[Case]:
    """Every tail x partition x drop_last x even_batches, with resizes, sizes and kill points spread over them."""
    combos = itertools.product(TAILS, PARTITIONS, (False, True), (False, True))
    for i, (tail, partition, drop_last, even) in enumerate(combos):
        w1, w2 = RESIZES[i % len(RESIZES)]
        n = SIZES[(i * 3) % len(SIZES)]
        b = (2, 3, 4)[(i // 2) % 3]
        b = min(b, n // (2 * w1 + 2))  # the busiest rank has >= 2 batches: a mid-epoch kill exists
        yield Case(n, b, tail, partition, drop_last, even, w1, w2, at=(0.3, 0.5, 0.8)[(i // 3) % 3],
                   warmup_epochs=1 if i % 7 == 3 else 0, set_epoch=i % 4 == 1)


MATRIX = list(matrix())

OTHER = [
    # DGL's DistributedItemSampler: split first, shuffle each part in windows; the parts keep W1's layout.
    Case(37, 3, "uneven", "contiguous", True, True, 3, 2, scope="rank", permutation="window", buffer_size=5),
    Case(43, 2, "uneven", "contiguous", False, True, 2, 4, scope="rank", permutation="window", buffer_size=4),
    Case(31, 2, "pad", "chunked", True, False, 4, 2, scope="rank", permutation="feistel"),
    # Chunked shares that end early: rank 3 of 4 has 2 batches, the others 4; killed after 3 steps
    # (with drop_last, rank 3's dropped last sample stays in the checkpoint and is dealt again).
    Case(25, 2, "uneven", "chunked", False, False, 4, 2, k=3),
    Case(29, 2, "uneven", "chunked", True, False, 4, 3, k=3),
    # The same world again, and a world of one grown to several.
    Case(41, 3, "pad", "strided", False, False, 3, 3, at=0.6),
    Case(29, 2, "drop", "contiguous", True, False, 1, 4, at=0.4),
]


@pytest.mark.parametrize("case", MATRIX + OTHER, ids=lambda c: c.id)
def test_resume_under_another_world(server: Server, case: Case) -> None:
    check_everything(kill_and_resize(server, case))


STATELESS = [
    Case(37, 2, "pad", "strided", False, False, 2, 5, stateless=True),
    Case(31, 3, "uneven", "chunked", True, False, 1, 3, stateless=True, set_epoch=True),
    Case(47, 2, "drop", "contiguous", False, True, 2, 4, stateless=True),
    Case(43, 2, "pad_last", "chunked", True, True, 3, 4, stateless=True, at=0.7),
    Case(53, 3, "uneven", "contiguous", False, False, 2, 3, stateless=True, warmup_epochs=1, set_epoch=True),
    Case(41, 2, "pad", "contiguous", False, False, 1, 5, stateless=True, at=0.8),
    Case(43, 2, "uneven", "contiguous", True, True, 2, 4, stateless=True, scope="rank", permutation="window",
         buffer_size=4),
]


@pytest.mark.parametrize("case", STATELESS, ids=lambda c: c.id)
def test_ranks_added_by_a_scale_up_need_no_state(server: Server, case: Case) -> None:
    run = kill_and_resize(server, case)
    assert any(b is None for b in run.lens_before), "the case must add stateless ranks"
    check_everything(run)


BOUNDARY = [
    Case(37, 2, "uneven", "strided", False, False, 3, 2, stop="last-batch"),
    Case(41, 3, "pad", "chunked", True, True, 2, 5, stop="last-batch", set_epoch=True),
    Case(29, 2, "drop", "contiguous", True, False, 4, 1, stop="after-end"),
    Case(31, 2, "pad_last", "strided", False, True, 1, 3, stop="after-end", warmup_epochs=1),
    Case(33, 2, "uneven", "chunked", True, False, 2, 4, stop="after-end", stateless=True, set_epoch=True),
    Case(60, 2, "uneven", "strided", False, False, 3, 2, stop="after-end", bucket=(36, 12), packs_promised=True),
]


@pytest.mark.parametrize("case", BOUNDARY, ids=lambda c: c.id)
def test_resume_at_an_epoch_boundary_starts_the_next_epoch(server: Server, case: Case) -> None:
    run = kill_and_resize(server, case)
    assert run.cursor == fresh(run.spec, run.epoch + 1)
    assert run.states[0]["remaining"] == [[0, run.spec.n]] and run.states[0]["epoch"] == run.epoch + 1
    assert all(run.ended) == (case.stop == "after-end")
    check_everything(run)


BUCKETS = [
    # Strided, N = 60, windows of 36 and 24 holding whole packs of 12, batch 2 and W in {1, 2, 3, 6}:
    # W * batch_size divides pack_size, and each kill is at a pack boundary (k * W1 * batch_size a
    # multiple of 12), so every lockstep step of either world lies inside one pack.
    Case(60, 2, "pad", "strided", w1=3, w2=2, k=2, bucket=(36, 12), packs_promised=True),
    Case(60, 2, "drop", "strided", w1=2, w2=3, k=3, bucket=(36, 12), packs_promised=True, set_epoch=True),
    Case(60, 2, "uneven", "strided", w1=6, w2=2, k=2, bucket=(36, 12), packs_promised=True, warmup_epochs=1),
    Case(60, 2, "pad_last", "strided", w1=1, w2=6, k=6, bucket=(36, 12), packs_promised=True),
    Case(60, 2, "uneven", "strided", w1=2, w2=6, k=6, bucket=(36, 12), packs_promised=True, stateless=True),
    # Chunked / contiguous, batch_size == pack_size == 4, N = 48, windows of 16: every part start and
    # every interval the checkpoint leaves is a multiple of 4, so every batch is one whole pack.
    Case(48, 4, "uneven", "contiguous", w1=2, w2=4, k=2, bucket=(16, 4), packs_promised=True),
    Case(48, 4, "pad", "chunked", w1=2, w2=4, k=2, bucket=(16, 4), packs_promised=True, stateless=True),
    Case(48, 4, "drop", "contiguous", w1=4, w2=2, k=1, bucket=(16, 4), packs_promised=True),
    # Sizes that promise nothing about packs: the exactly-once and plan checks only.
    Case(47, 3, "uneven", "chunked", True, False, 3, 2, bucket=(16, 4)),
    Case(53, 2, "pad", "contiguous", False, True, 2, 5, bucket=(20, 5), at=0.7),
    Case(41, 2, "drop", "strided", True, True, 4, 1, bucket=(12, 3)),
    Case(61, 3, "pad_last", "strided", False, False, 2, 3, bucket=(25, 6), stateless=True),
]


@pytest.mark.parametrize("case", BUCKETS, ids=lambda c: c.id)
def test_bucketing_resumes(server: Server, case: Case) -> None:
    run = kill_and_resize(server, case)
    if case.packs_promised:
        # The kill is at a pack boundary: the checkpoint leaves whole packs.
        ids = pack_ids(lengths_for(case.n), *case.bucket)  # type: ignore[misc]
        left = order(run.spec, run.cursor.epoch, remaining_positions(run.cursor), run.cursor.base_world)
        served = np.setdiff1d(np.arange(case.n), left)
        assert not set(ids[left].tolist()) & set(ids[served].tolist()), "a pack is split by the checkpoint"
    check_everything(run)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("preloaded", [False, True], ids=["nothing-loaded", "own-state-loaded"])
@pytest.mark.parametrize("change", ["batch_size", "lengths"])
def test_a_state_of_another_spec_is_refused_and_changes_nothing(server: Server, tmp_path: Path, change: str,
                                                                preloaded: bool) -> None:
    n, w = 40, 2
    saved_case = Case(n, 2, "uneven", bucket=(16, 4), w1=w)
    job = f"refuse-{change}-{uuid.uuid4().hex[:8]}"
    ranks = Ranks([saved_case.sampler(server.address, job, f"{job}/a", w, r) for r in range(w)])
    try:
        for _ in range(3):
            for r in range(w):
                assert ranks.next(r) is not None
        saved = ranks.samplers[0].state_dict()
    finally:
        ranks.close()

    # The restarted job was changed: another batch size, or one sample's length. Its coordinator
    # is a new one (the old one holds the job with the old spec, and would refuse the join).
    other = Server(f"sqlite:///{tmp_path}/other.db").start()
    try:
        if change == "batch_size":
            new_case = dataclasses.replace(saved_case, batch_size=3)
            samplers = [new_case.sampler(other.address, job, f"{job}/b", w, r) for r in range(w)]
        else:
            lengths = lengths_for(n)
            lengths[7] += 1
            samplers = [DistributedBatchSampler(n, 2, w, r, seed=SEED, address=other.address, job=job,
                                                token=f"{job}/b", tail="uneven", permutation="bucket",
                                                lengths=lengths, buffer_size=16, pack_size=4, lease_ahead=3)
                        for r in range(w)]
        spec = samplers[0].spec
        assert spec.fingerprint != saved["fingerprint"]
        own = Cursor(epoch=1, remaining=((4, 20), (26, n)))
        if preloaded:
            for s in samplers:
                s.load_state_dict(to_state(job, spec, own))
        before = [(s.state_dict(), len(s), s.epoch) for s in samplers]
        snapshot = other.core.snapshot_state()
        for s in samplers:
            with pytest.raises(ValueError) as refused:
                s.load_state_dict(saved)
            msg = str(refused.value)
            assert saved["fingerprint"] in msg and spec.fingerprint in msg, msg
            assert ("batch_size=3" if change == "batch_size" else "lengths='<40 keys") in msg, msg
        assert [(s.state_dict(), len(s), s.epoch) for s in samplers] == before
        assert other.core.snapshot_state() == snapshot
        ranks = Ranks(samplers)
        try:
            got = drain(ranks)
        finally:
            ranks.close()
        start = own if preloaded else fresh(spec, 0)
        assert got == plan_batches(plan(spec, start, w))
    finally:
        other.stop(grace=0.5)


# --------------------------------------------------------------------------- the checks can fail


@pytest.mark.parametrize("shift", [-1, 1], ids=["cursor-one-batch-early", "cursor-one-batch-late"])
@pytest.mark.parametrize(
    "case",
    [Case(37, 2, "uneven", "chunked", w1=3, w2=2, k=3), Case(43, 3, "pad", "strided", True, False, 2, 5, k=3),
     Case(41, 2, "drop", "contiguous", False, True, 4, 3, k=2)],
    ids=lambda c: c.id,
)
def test_the_checks_catch_a_checkpoint_one_batch_off(server: Server, monkeypatch: pytest.MonkeyPatch, case: Case,
                                                     shift: int) -> None:
    real = Plan.advance
    monkeypatch.setattr(Plan, "advance", lambda self, j: real(self, j + shift))
    run = kill_and_resize(server, case)
    trained, segments = run.trained(), run.segments()
    # Early: the last step before the kill is served again; late: the step after it is skipped.
    with pytest.raises(G1Violation, match="received [1-9]" if shift < 0 else "lacks [1-9]"):
        audit_exact(run.spec, trained, segments)
    if case.tail == "uneven":  # nothing is allowed missing or repeated: the rule alone sees it too
        with pytest.raises(G1Violation, match=r"[1-9]\d* repeats" if shift < 0 else r"[1-9]\d* missing"):
            audit_rule(run.spec, trained, segments)
    with pytest.raises(G1Violation):
        audit_epoch(run.spec, trained, segments)
    with pytest.raises(AssertionError, match="re-serves" if shift < 0 else "skips"):
        check_cursor(run)
    # What the resumed world got is still what the plan of the (wrong) cursor says: the serving is
    # right, the checkpoint is not, and only the checks above notice.
    check_batches_follow_plans(run)


def test_the_pack_check_catches_batches_across_packs() -> None:
    case = Case(60, 2, "pad", "strided", w1=3, w2=2, bucket=(36, 12))
    ids = pack_ids(lengths_for(60), 36, 12)
    spec = case.spec()
    assert_within_packs(plan_batches(plan(spec, fresh(spec, 0), 3)), ids, True, "bucketed")
    shuffled = dataclasses.replace(case, bucket=None, permutation="feistel").spec()
    with pytest.raises(AssertionError, match="spans packs"):
        assert_within_packs(plan_batches(plan(shuffled, fresh(shuffled, 0), 3)), ids, True, "not bucketed")


# --------------------------------------------------------------------------- len() before the join


def test_len_when_the_loop_replays_the_epoch_the_checkpoint_finished(server: Server) -> None:
    case = Case(20, 2, "uneven", "strided", w1=2, w2=2, stop="last-batch")
    run = kill_and_resize(server, case)
    assert run.cursor == fresh(run.spec, 1)
    samplers = [case.sampler(server.address, run.job, f"{run.job}/c", 2, r) for r in range(2)]
    for s in samplers:
        s.set_epoch(0)  # the loop's epoch variable, saved with the checkpoint at the end of epoch 0
        s.load_state_dict(run.states[0])
    lens = [len(s) for s in samplers]
    ranks = Ranks(samplers)
    try:
        got = drain(ranks)
    finally:
        ranks.close()
    assert got == [[], []]  # epoch 0 is complete: its iteration yields nothing
    assert lens == [0, 0], f"len() said {lens} for an iteration that yields no batch"
