"""The batch sampler's resume cases and their oracle: what a world trained, checked three ways (see test_batch_sampler)."""


from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from croupier.client import DistributedBatchSampler
from croupier.core.order import Cursor, FixedPlan, order
from croupier.core.spec import Spec

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

    def sampler(self, address: str, job: str, incarnation: str, world: int, rank: int) -> DistributedBatchSampler:
        """Rank `rank` of a world of `world` ranks of this case's job."""
        kw: dict[str, Any] = {}
        if self.bucket is not None:
            kw = dict(permutation="bucket", lengths=lengths_for(self.n), buffer_size=self.bucket[0],
                      pack_size=self.bucket[1])
        elif self.permutation is not None:
            kw = dict(permutation=self.permutation, buffer_size=self.buffer_size)
        return DistributedBatchSampler(self.n, self.batch_size, world, rank, shuffle=True, seed=SEED,
                                       drop_last=self.drop_last, address=address, job=job, incarnation=incarnation,
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

    plan: FixedPlan
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
    # samples on purpose (real positions past a rank's last batch, from FixedPlan.nb_r and n_r): they
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


def expected_cursor(p: FixedPlan, k: int) -> tuple[int, set[int]]:
    """Brute force, without FixedPlan.advance: (epoch, positions left) once every rank of `p` took k steps."""
    if k >= int(p.nb_r.max()):
        return p.cursor.epoch + 1, set(range(p.spec.n))
    served, _ = Segment(p, k).served()
    return p.cursor.epoch, set(remaining_positions(p.cursor).tolist()) - set(served.tolist())


def plan_batches(p: FixedPlan, steps: int | None = None) -> Batches:
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


