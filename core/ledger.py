"""The step ledger: which samples the trainer's optimizer step T trained, and at which steps sample I was trained.

Nothing here is a record of samples. A job's history is a list of :class:`Segment`: one per
generation that started, with its world, its resume point (a cursor), the trainer's step at that
resume point, the checkpoint's generation it resumed from, the amendments it dealt with, how far
its ranks reported, and (dynamic dealing alone) the batches the coordinator dealt. The order is a
pure function of those, so a step's samples are computed when asked, and what is kept grows with
generations and amendments, not with steps or ranks.

Vocabulary:
    step        -- the trainer's global optimizer step, counted from 1 as the trainers log it (the
                   T-th step; a checkpoint saved after step s has ``step=s``; a fresh job is at 0).
    micro-batch -- one batch of one rank (what the sampler yields); a step is ``A`` micro-batches of
                   every rank, ``A`` = the step's global batch / (batch_size x world).
    chunk       -- the steps of one epoch within one segment. A step never holds micro-batches of two
                   epochs: the last step of an epoch may be short (the HF Trainer and Lightning step at
                   an epoch's end with what is accumulated).
    timeline    -- the segments that the latest one descends from (each resumed from a checkpoint of
                   the one before it): their steps are *kept*. A step trained by a segment past the
                   step its successor resumed from (a rollback), or by a segment no later one descends
                   from, is *abandoned*.

NOTE: what a segment trained past its last checkpoint is known from its ranks' progress reports (how
many micro-batches of an epoch a rank took); a step is counted as trained when every one of its
micro-batches was reported taken by the rank furthest on. Reports are periodic, so an abandoned
segment's last few steps may be missing from what it lists.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from croupier.core.answers import Batch, Occurrence, StepRecord, Version
from croupier.core.checks import check_int
from croupier.core.errors import FailedPrecondition, InvalidArgument, OutOfRange
from croupier.core.ftsteps import StepRun, Steps
from croupier.core.history import History, StepRange, check_step, lineage
from croupier.core.kept import KeptSteps, step_major, steps_per_piece, with_gaps
from croupier.core.mixture import sample_seeds
from croupier.core.order import order, tags
from croupier.core.plan import EpochPlan
from croupier.core.quorum_ledger import QuorumLedger
from croupier.core.registry import plan_epoch, sized_batches
from croupier.core.schedule import Schedule
from croupier.core.segments import Segment, fresh_segment, pack, unpack
from croupier.core.spec import Spec

__all__ = ["Batch", "History", "Ledger", "Occurrence", "Schedule", "Segment", "StepRecord", "Version", "fresh_segment",
           "history", "pack", "unpack"]


# --------------------------------------------------------------------------- the ledger


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """Steps ``first + 1 .. first + steps`` of one segment, all in `epoch`."""

    first: int
    steps: int
    epoch: int
    micro: int  # micro-batches of the furthest rank in the epoch


class Ledger(StepRange):
    """Answers a job's step and sample questions from its history (a pure function of spec and segments).

    Args:
        job: The job's name (for messages).
        spec: The job's spec (without amendments).
        segments: Every generation that started, oldest first. They MUST NOT change while the ledger
            is used: it keeps what it computed of them (a coordinator's copy, or GetLedger's).
    """

    def __init__(self, job: str, spec: Spec, segments: Sequence[Segment]) -> None:
        self.job, self.spec = job, spec
        self.segments = list(segments)
        self._by_gen = {s.generation: s for s in self.segments}
        self._chunks: dict[int, list[_Chunk]] = {}
        self._reached: dict[int, int] = {}  # generation -> its last step (a Ledger answers for segments that do not change)
        self._kept = self._timeline()

    # ---------------------------------------------------------------- the timeline

    def _timeline(self) -> list[tuple[Segment, int | None]]:
        """The kept segments, oldest first, each with the last step it keeps (None: the newest, open)."""
        return lineage(self.segments[-1] if self.segments else None, self._resumed_from)

    def _resumed_from(self, seg: Segment) -> tuple[Segment, int] | None:
        """The segment `seg` resumed from and the step it resumed at (None: a fresh start, or not held)."""
        if seg.step is None or seg.step == 0 and seg.parent is None:
            return None
        p = self._parent(seg)
        return None if p is None else (p, seg.step)

    def _parent(self, seg: Segment) -> Segment | None:
        """The segment that took the checkpoint `seg` resumed from, when this history holds it.

        NOTE: a store that lost the job's history numbers its generations apart from the lost store's
        (``croupier.server._decide.next_number``), so a checkpoint of the lost store names no generation
        held here; a history written before that rule may still reuse a number, so a parent is taken
        only if it is older, began before the step and recorded a checkpoint at it.
        """
        if seg.parent is not None:
            p = self._by_gen.get(seg.parent)
            ok = (p is not None and p.generation < seg.generation and p.step is not None and seg.step is not None
                  and p.step <= seg.step and (seg.step in p.checkpoints or seg.step == p.step))
            return p if ok else None
        # A checkpoint that named its step but not its generation (a state of an older release): the
        # latest earlier segment that had begun by then made it.
        assert seg.step is not None
        earlier = [s for s in self.segments if s.generation < seg.generation and s.step is not None and s.step <= seg.step]
        return earlier[-1] if earlier else None

    def _spec(self, seg: Segment) -> Spec:
        return self.spec.amended(seg.amendments) if seg.amendments else self.spec

    def _plan(self, seg: Segment, epoch: int) -> EpochPlan | None:
        return plan_epoch(self._spec(seg), seg.start, seg.world, epoch)

    def _epoch_micro(self, seg: Segment, epoch: int, plan: EpochPlan) -> int:
        """Micro-batches of the rank with the most in `epoch` of `seg` (up to where its trainer cut it, if it did)."""
        most = plan.most_steps(seg.deals.get(epoch))
        return min(most, seg.cuts[epoch]) if epoch in seg.cuts else most

    def cut_by(self, seg: Segment, epoch: int, micro: int, step: int) -> tuple[int, int] | None:
        """The epoch cut a checkpoint of `seg` shows: its ranks had taken `micro` micro-batches of `epoch` at the
        trainer's step `step`. When fewer steps lie before it than `seg`'s earlier epochs take whole, the trainer
        cut the epoch before `epoch` short (``set_epoch`` of the next before it ended): (that epoch, the
        micro-batches of its rank with the most that its steps took). None when the steps agree, when they say
        more steps (not a cut: the audit names such a step), or when the cut would lie in another epoch.

        NOTE: only a checkpoint (its step and its ranks' progress) tells the coordinator where a cut was: the
        ranks' progress reports are periodic, and a rank that finished its share of an epoch reports no
        differently from one whose trainer cut it. The next epoch's steps before such a checkpoint are placed
        from the cut once it is recorded (``EpochCut``); those of an epoch cut after a generation's last
        checkpoint are still placed as if it had ended.
        """
        if seg.step is None or epoch <= seg.start.epoch or epoch - 1 in seg.cuts:
            return None
        chunks = self._chunks_to(seg, epoch=epoch)
        before = next((c for c in chunks if c.epoch == epoch - 1), None)
        now = next((c for c in chunks if c.epoch == epoch), None)
        if before is None or now is None:
            return None
        sp = self._spec(seg)
        began = step - seg.schedule.covering(sp, seg.world, now.first, micro)
        for _ in range(4):  # a ramped global batch: the steps of `micro` depend on where they begin
            began = step - seg.schedule.covering(sp, seg.world, began, micro)
        if not before.first <= began < now.first:
            return None
        return epoch - 1, seg.schedule.between(sp, seg.world, before.first, began)

    def _chunks_to(self, seg: Segment, step: int | None = None, epoch: int | None = None) -> list[_Chunk]:
        """`seg`'s chunks, computed up to the one holding `step` (or epoch `epoch`), cached."""
        assert seg.step is not None
        sp = self._spec(seg)
        if seg.generation not in self._chunks:
            seg.schedule.check(sp, seg.world)  # once per segment: its world and schedule do not change
        chunks = self._chunks.setdefault(seg.generation, [])
        while True:
            if chunks:
                last = chunks[-1]
                if step is not None and last.first + last.steps >= step:
                    return chunks
                if epoch is not None and last.epoch >= epoch:
                    return chunks
                e, first = last.epoch + 1, last.first + last.steps
            else:
                e, first = seg.start.epoch, seg.step
            # NOTE: the steps up to the segment's last checkpoint were trained whether or not a report
            # names their epochs: reports ride on grant requests (a rank whose epoch is one lease long
            # asks once, before its loop took anything), and a checkpoint at an epoch's end reports the
            # next epoch's start (0 micro-batches, which a segment does not record). So a segment that
            # is no longer the newest is computed on past its reported epochs up to that step.
            if e > self._last_epoch(seg) and first >= self._checkpointed(seg):
                return chunks
            plan = self._plan(seg, e)
            micro = self._epoch_micro(seg, e, plan) if plan is not None else 0
            n = seg.schedule.covering(sp, seg.world, first, micro) if micro else 0
            if not n and e > self._known_epoch(seg):
                return chunks  # nothing dealt past what the segment reported
            chunks.append(_Chunk(first, n, e, micro))

    @staticmethod
    def _known_epoch(seg: Segment) -> int:
        """The last epoch `seg`'s reports or deals name (its start's when none)."""
        return max([*seg.reached, *seg.deals, seg.start.epoch])

    def _last_epoch(self, seg: Segment) -> int:
        """The last epoch `seg` may have reached (its reports', its deals', or unbounded for a kept open segment)."""
        known = self._known_epoch(seg)
        return known if seg is not self.segments[-1] else max(known, 2**62)

    @staticmethod
    def _checkpointed(seg: Segment) -> int:
        """The step of `seg`'s last checkpoint (its resume step without one): every step up to it was trained."""
        assert seg.step is not None
        return max([seg.step, *seg.checkpoints])

    def _reached_step(self, seg: Segment) -> int:
        """The last step `seg` trained: its last checkpoint's, or the last step its reports cover wholly."""
        if seg.generation not in self._reached:
            self._reached[seg.generation] = self._reached_uncached(seg)
        return self._reached[seg.generation]

    def _reached_uncached(self, seg: Segment) -> int:
        best = self._checkpointed(seg)
        for e, micro in sorted(seg.reached.items()):
            for c in self._chunks_to(seg, epoch=e):
                if c.epoch == e:
                    done = c.steps if micro >= c.micro else seg.schedule.within(self._spec(seg), seg.world, c.first, micro)
                    best = max(best, c.first + min(done, c.steps))
        return best

    @functools.cached_property
    def last_step(self) -> int:
        """The last step the job's timeline trained (0 before its first)."""
        if not self._kept:
            return 0
        seg, _ = self._kept[-1]
        if seg.step is None:
            return 0
        return self._reached_step(seg)

    @functools.cached_property
    def furthest_step(self) -> int:
        """The last step any version trained (an abandoned one may have gone past the timeline)."""
        return max([self.last_step, *(self._reached_step(s) for s in self.segments if s.step is not None)])

    def _check_step(self, t: int) -> None:
        check_step(t)
        if not self.segments:
            raise FailedPrecondition(f"job {self.job!r} has no generation that started: no step was trained yet")
        if t > self.last_step and t > self.furthest_step:
            raise OutOfRange(f"step {t} is past the run: job {self.job!r} has trained {self.last_step} steps "
                             f"(as far as its ranks reported)")
        first = self._kept[0][0]
        if first.step is None:
            raise FailedPrecondition(
                f"job {self.job!r}: generation {first.generation} resumed from a checkpoint that named no step "
                "(its state_dict was saved without step=), so the steps before it cannot be placed")
        if t <= first.step:
            raise FailedPrecondition(
                f"job {self.job!r}: the history before step {first.step + 1} is missing: generation "
                f"{first.generation}, the oldest this coordinator holds on the timeline, resumed from a checkpoint at "
                f"step {first.step} (a coordinator rebuilt from checkpoints, or a job moved to a new store)")

    # ---------------------------------------------------------------- steps

    def step(self, t: int) -> StepRecord:
        """What step `t` trained: the kept version and every abandoned one.

        Raises:
            InvalidArgument: `t` is not an int >= 1.
            OutOfRange: `t` is past the last step the job trained.
            FailedPrecondition: the history that would place `t` is missing (the message says which part).
        """
        self._check_step(t)
        kept = None
        for seg, _ in self._kept:
            kr = self._kept_range(seg)
            if kr is not None and kr[0] < t <= kr[1]:
                kept = self._version(seg, t, True)
        abandoned = [v for v in (self._abandoned(seg, t) for seg in self.segments) if v is not None]
        return StepRecord(t, kept, tuple(abandoned))

    def ends_epoch(self, t: int) -> bool:
        """Whether kept step `t` is the last step of its epoch: by then the ranks of the generation that
        trained it had taken every batch its plan of that epoch deals them, and nothing of the epoch was
        left to deal. A job run to an epoch's end and checkpointed there has finished that epoch, though no
        step of the next one exists (the checkpoint names the next epoch's start, which no step trains)."""
        for seg, _ in self._kept:
            kr = self._kept_range(seg)
            if kr is None or not kr[0] < t <= kr[1]:
                continue
            c = self._chunk_of(seg, t)
            plan = None if c is None else self._plan(seg, c.epoch)
            return (c is not None and plan is not None and c.steps > 0 and t == c.first + c.steps
                    and self._dealt_out(seg, c.epoch, plan))
        return False

    @staticmethod
    def _dealt_out(seg: Segment, epoch: int, plan: EpochPlan) -> bool:
        """Whether `plan` (of `epoch` in `seg`) has nothing left to deal: a plan the coordinator deals once
        every global batch of the epoch was dealt (its ranks' shares grow as they ask), any other always
        (its shares are the plan's)."""
        return plan.dealt_out(seg.deals.get(epoch))

    def _kept_range(self, seg: Segment) -> tuple[int, int] | None:
        for s, end in self._kept:  # NOTE: the timeline is short (one segment per generation it kept)
            if s is seg:
                assert s.step is not None
                return s.step, (self._reached_step(s) if end is None else end)
        return None

    def _abandoned(self, seg: Segment, t: int) -> Version | None:
        if seg.step is None or t <= seg.step:
            return None
        kr = self._kept_range(seg)
        if kr is not None and t <= kr[1]:
            return None
        if t > self._reached_step(seg):
            return None
        return self._version(seg, t, False)

    def _version(self, seg: Segment, t: int, kept: bool) -> Version | None:
        chunk = self._chunk_of(seg, t)
        if chunk is None:
            return None
        sp = self._spec(seg)
        k0 = seg.schedule.between(sp, seg.world, chunk.first, t - 1)
        a = seg.schedule.at(sp, seg.world, t)
        return Version(t, seg.generation, seg.incarnation, seg.world, chunk.epoch, kept,
                       self._micro_samples(seg, chunk.epoch, k0, a))

    def kept_order(self, a: int, b: int) -> Iterator[KeptSteps]:
        """``History.kept_order``. Raises what :meth:`steps` raises, at once (not when iterated)."""
        self._check_range(a, b)
        # NOTE: kept ranges (seg.step, end] do not overlap (a parent is kept up to where its child resumed)
        return with_gaps(a, b, (p for seg, _ in self._kept for p in self._kept_chunks(seg, a, b)))

    def _kept_chunks(self, seg: Segment, a: int, b: int) -> Iterator[KeptSteps]:
        """Steps `a` .. `b` that `seg` keeps and its chunks hold, in pieces (a ramped schedule's one step each),
        each piece's positions laid out and mapped to indices at once."""
        kr = self._kept_range(seg)
        assert kr is not None
        lo, hi, sp = max(a, kr[0] + 1), min(b, kr[1]), self._spec(seg)
        for c in self._chunks_to(seg, step=hi) if lo <= hi else ():
            c_lo, c_hi = max(lo, c.first + 1), min(hi, c.first + c.steps)
            per = 1 if seg.schedule.rampup else steps_per_piece(seg.schedule.at(sp, seg.world, c_lo) * seg.world * sp.batch_size)
            for s0 in range(c_lo, c_hi + 1, per):
                steps, a = min(per, c_hi + 1 - s0), seg.schedule.at(sp, seg.world, s0)
                got = self._micro_positions(seg, c.epoch, seg.schedule.between(sp, seg.world, c.first, s0 - 1), steps * a)
                assert got is not None  # a chunk that has steps has a plan
                sizes, pos = step_major(got[0], got[1] // a, got[2], seg.world, steps)
                yield KeptSteps(s0, sizes, order(sp, c.epoch, pos, got[3].cursor.base_world))

    def _chunk_of(self, seg: Segment, t: int) -> _Chunk | None:
        for c in self._chunks_to(seg, step=t):
            if c.first < t <= c.first + c.steps:
                return c
        return None

    def _micro_positions(self, seg: Segment, epoch: int, first: int,
                         count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, EpochPlan] | None:
        """(rank, micro-batch, position) of every sample of micro-batches first .. first + count - 1 of
        every rank of `seg` in `epoch`, in rank then micro-batch order, with the epoch's plan."""
        plan = self._plan(seg, epoch)
        if plan is None:
            return None
        r, m, p = plan.step_positions(first, count, seg.deals.get(epoch))
        return r, m, p, plan

    def _micro_samples(self, seg: Segment, epoch: int, first: int, count: int) -> tuple[np.ndarray, ...]:
        """Micro-batches first .. first + count - 1 of every rank of `seg` in `epoch`, as flat arrays
        (rank, micro-batch, index, source, source epoch, seed: :class:`Version`'s samples); () for none."""
        got = self._micro_positions(seg, epoch, first, count)
        if got is None or got[2].size == 0:
            return ()
        rank_a, micro_a, pos_a, plan = got
        sp = self._spec(seg)
        idx = order(sp, epoch, pos_a, plan.cursor.base_world)
        src, sep = tags(sp, epoch, pos_a)
        return rank_a, micro_a, idx, src, sep, sample_seeds(sp.seed, src, sep, idx)

    # ---------------------------------------------------------------- samples

    def index(self, index: int, source: int | None = None) -> list[Occurrence]:
        """Every step at which dataset index `index` (of `source`, numbered within it, when given) was
        trained, kept or abandoned, oldest epoch first.

        Raises:
            InvalidArgument: `index` (or `source`) is out of the dataset's range.
        """
        spec = self.spec
        check_int("index", index, 0, None, InvalidArgument)
        if source is not None:
            if spec.sources is None:
                raise InvalidArgument(f"source={source}: job {self.job!r} is not a mixture (it has one source, 0)")
            check_int("source", source, 0, len(spec.sources), InvalidArgument)
        out: list[Occurrence] = []
        for seg in self.segments:
            if seg.step is None:
                continue
            kr = self._kept_range(seg)
            reached = self._reached_step(seg)
            for c in self._chunks_to(seg, step=reached):
                if c.first >= reached:
                    break
                out.extend(self._find(seg, c, index, source, kr, reached))
        return sorted(out)

    def _global_index(self, seg: Segment, index: int, source: int | None) -> int | None:
        sp = self._spec(seg)
        if source is None:
            return index if index < sp.space else None
        from croupier.core.amend import sizes_after

        assert sp.sources is not None
        sizes = sizes_after(sp.sources, sp.amendments or ())
        if index >= sizes[source]:
            return None
        return int(sum(sizes[:source])) + index

    def _find(self, seg: Segment, c: _Chunk, index: int, source: int | None, kept: tuple[int, int] | None,
              reached: int) -> Iterator[Occurrence]:
        """Where `index` lies in chunk `c` of `seg`: (rank, micro-batch) -> step."""
        sp = self._spec(seg)
        g = self._global_index(seg, index, source)
        if g is None:
            return
        plan = self._plan(seg, c.epoch)
        if plan is None:
            return
        hits = plan.where(g)
        if hits is None:  # no inverse at hand: the chunk's order is computed
            hits = self._scan(seg, c, g)
        for rank, micro, p in hits:
            step = c.first + seg.schedule.covering(sp, seg.world, c.first, micro + 1)
            if step > reached:
                continue
            is_kept = kept is not None and kept[0] < step <= kept[1]
            src, sep = tags(sp, c.epoch, np.array([p], dtype=np.int64))
            yield Occurrence(c.epoch, step, rank, seg.generation, micro - seg.schedule.between(sp, seg.world, c.first, step - 1),
                             is_kept, int(src[0]), int(sep[0]))

    def _scan(self, seg: Segment, c: _Chunk, g: int) -> list[tuple[int, int, int]]:
        """Every (rank, micro-batch, position) of chunk `c` that deals index `g`, by computing the chunk's
        order: the orders without an inverse at hand (torch's, windows, buckets, mixtures, token budgets,
        dynamic dealing) cost O(samples of the chunk) here."""
        hits: list[tuple[int, int, int]] = []
        block = max(1, 1 << 20 // max(1, seg.world * self._spec(seg).batch_size))
        for k in range(0, c.micro, block):
            got = self._micro_positions(seg, c.epoch, k, min(block, c.micro - k))
            if got is None:
                continue
            rank_a, micro_a, pos_a, plan = got
            idx = order(self._spec(seg), c.epoch, pos_a, plan.cursor.base_world)
            for j in np.flatnonzero(idx == g).tolist():
                hits.append((int(rank_a[j]), k + int(micro_a[j]), int(pos_a[j])))
        return hits

    # ---------------------------------------------------------------- summaries

    def timeline(self) -> list[dict[str, Any]]:
        """Each segment: generation, world, first and last step trained, whether (and up to which step) it is kept."""
        out = []
        for seg in self.segments:
            kr = self._kept_range(seg) if seg.step is not None else None
            out.append({"generation": seg.generation, "incarnation": seg.incarnation, "world": seg.world,
                        "epoch": seg.start.epoch, "from_step": seg.step, "parent": seg.parent,
                        "to_step": self._reached_step(seg) if seg.step is not None else None,
                        "kept_to": kr[1] if kr else None, "amendments": [a.to_list() for a in seg.amendments],
                        "global_batch": seg.schedule.global_batch, "at_ms": seg.at_ms})
        return out

    def constant_batch(self) -> int | None:
        """The samples per step when every kept step has the same number (an order file's batch), else None."""
        sizes: set[int] = set()
        for seg, _ in self._kept:
            if seg.schedule.rampup is not None:
                return None
            if seg.schedule.global_batch:
                sizes.add(seg.schedule.global_batch)
            else:
                sizes.add(self._spec(seg).batch_size * seg.world)
        return sizes.pop() if len(sizes) == 1 and sized_batches(self.spec) else None

    def why_batch_varies(self) -> str:
        """Why the kept timeline's steps differ in size (when :meth:`constant_batch` is None), in words."""
        if not sized_batches(self.spec):
            return "its batches are token budgets (max_tokens): a step holds as many samples as fit, so steps differ in size"
        sizes = []
        for seg, _ in self._kept:
            if seg.schedule.rampup is not None:
                start, inc, every = seg.schedule.rampup
                return (f"generation {seg.generation} ramps its global batch up (from {start} by {inc} every {every} "
                        f"steps to {seg.schedule.global_batch})")
            sizes.append((seg.generation, seg.world, seg.schedule.global_batch or self.spec.batch_size * seg.world))
        return "its global batch changed: " + ", ".join(f"generation {g} (world {w}) took {b} samples a step"
                                                         for g, w, b in sizes)


def history(job: str, spec: Spec, segments: Sequence[Segment], runs: Sequence[StepRun] = ()) -> History:
    """A job's history (``croupier.core.history``) from what its coordinator holds: its generations' segments,
    or, for a job of torchft replica groups (whose runs report committed steps), its step runs.

    NOTE: the one place the kind of a job's runs picks how they are read; a coordinator holds one or the
    other for a job (it refuses step reports under a job whose samplers joined it).
    """
    if runs and not segments:
        return QuorumLedger(job, spec, Steps(runs))
    return Ledger(job, spec, segments)
