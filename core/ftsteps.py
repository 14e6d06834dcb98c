"""Committed-step dealing: the positions a committed step trains, split over the step's quorum, and its record.

A fault-tolerant job (torchft's replica groups that leave and heal between steps) reads its data
as one *stream*: the job's epochs laid end to end, stream position ``p`` being place ``p % n`` of
epoch ``p // n``: that position of the epoch's order, or, for a spec whose way of dealing has a stepped
variant (``croupier.core.registry.PlanKind.stepped``), the position that variant takes there. Steps
are numbered from 1 as everywhere (``croupier.core.history``): step ``T`` is the one that runs once ``s = T - 1`` steps have
committed (torchft's ``manager.current_step()`` reads ``s`` while it runs, ``T`` once it
committed); the dealing goes by that count ``s``. A step's samples are a run of the stream:

* ``mode="global"`` (the global batch stays constant): step ``T`` takes ``[s * B, (s + 1) * B)``;
* ``mode="group"`` (each group's batch stays constant): step ``T`` takes ``[c * b, (c + q) * b)``
  where ``c`` is the number of group-batches committed before it (torchft's
  ``batches_committed``) and ``q`` the step's participating groups.

An attempt of step ``T`` that does not commit leaves the committed count where it was, so the next
attempt of step ``T`` is dealt the same run again, split over whoever is in its quorum: the samples
of a step become trained when (and only when) the step commits. A step may straddle an epoch's end
(it trains the end of one epoch and the start of the next): the batch stays what was promised.

The quorum's ``q`` participating groups split the run in contiguous parts whose sizes differ by at
most one (part ``g`` of ``q``), and a group's ``w`` ranks split its part the same way.

What the coordinator records (:class:`StepRun`, :class:`Steps`): per *run* (a start of the whole
job, fresh or from a checkpoint's step: a run of the job's history, ``croupier.core.history``) the
committed steps with their quorum, so that a step's samples, and who trained which part, can be
answered later (``croupier.core.quorum_ledger``); a run that resumed at an earlier step abandons the
steps an earlier run committed after it (the one lineage walk, ``croupier.core.history.lineage``). Within a run, a step committed
again by a later quorum (the groups that had committed it alone died with its update, and the
survivors, one step behind, trained it again) supersedes the earlier record and every record
of a later step from an earlier quorum: those updates are gone with the groups that made them.
Quorum ids grow within a run (torchft's Lighthouse numbers them).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from croupier.core.checks import check_choice, check_int
from croupier.core.history import LineageCycle, lineage
from croupier.core.order import order
from croupier.core.registry import kind_of
from croupier.core.spec import Spec

__all__ = ["MODES", "CommittedStep", "StepDeal", "StepRun", "Steps", "committed_span", "part", "rank_deal",
           "stream_indices", "stream_runs"]

#: How a step's size is kept as groups leave and join: ``global`` (the global batch) or ``group``
#: (each group's batch; the global batch is the group batch times the step's participants).
MODES = ("global", "group")


def part(start: int, stop: int, parts: int, k: int) -> tuple[int, int]:
    """Part `k` of `parts` contiguous parts of [start, stop) whose sizes differ by at most one."""
    check_int("parts", parts, 1)
    check_int("k", k, 0, parts)
    size = stop - start
    return start + size * k // parts, start + size * (k + 1) // parts


def committed_span(mode: str, batch: int, committed: int, committed_batches: int,
                   participants: int) -> tuple[int, int]:
    """The stream positions [start, stop) of the samples of step ``committed + 1``.

    Args:
        mode: ``"global"`` or ``"group"`` (see the module's docstring).
        batch: The global batch (``global``) or the group batch (``group``).
        committed: The steps committed before it (torchft's ``current_step()`` while it runs).
        committed_batches: ``group`` only: the group-batches committed before the step.
        participants: The step's participating groups.
    """
    check_choice("mode", mode, MODES)
    check_int("batch", batch, 1)
    check_int("committed", committed, 0)
    check_int("participants", participants, 1)
    if mode == "global":
        return committed * batch, (committed + 1) * batch
    check_int("committed_batches", committed_batches, 0)
    return committed_batches * batch, (committed_batches + participants) * batch


@dataclasses.dataclass(frozen=True)
class StepDeal:
    """What one rank trains in one attempt of step `step` (from 1): stream positions [start, stop) of the step's
    [first, last)."""

    step: int
    first: int  # the step's stream span
    last: int
    start: int  # this rank's part of it
    stop: int


def rank_deal(mode: str, batch: int, committed: int, committed_batches: int, participants: int, participant: int,
              group_world: int, group_rank: int) -> StepDeal:
    """This rank's part of step ``committed + 1``: the quorum's participant `participant` of `participants`
    takes its part of the step's span, and rank `group_rank` of its group's `group_world` ranks its part of that."""
    first, last = committed_span(mode, batch, committed, committed_batches, participants)
    check_int("participant", participant, 0, participants)
    check_int("group_world", group_world, 1)
    check_int("group_rank", group_rank, 0, group_world)
    g0, g1 = part(first, last, participants, participant)
    r0, r1 = part(g0, g1, group_world, group_rank)
    return StepDeal(committed + 1, first, last, r0, r1)


def stream_runs(n: int, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
    """Stream positions [start, stop) as (epoch, first position, stop position) runs of epochs of `n`."""
    check_int("n", n, 1)
    p = start
    while p < stop:
        epoch, at = divmod(p, n)
        take = min(stop - p, n - at)
        yield epoch, at, at + take
        p += take


def stream_indices(spec: Spec, start: int, stop: int) -> np.ndarray:
    """The dataset indices at stream positions [start, stop) of `spec`'s order (int64), as its kind's steps take it."""
    kind = kind_of(spec)
    parts = [order(spec, epoch, kind.stepped_positions(spec, epoch, a, b))
             for epoch, a, b in stream_runs(spec.n, start, stop)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


# --------------------------------------------------------------------------- the record


@dataclasses.dataclass(frozen=True)
class CommittedStep:
    """One committed step as recorded: its number (from 1), its stream span and the quorum (id, participants)
    that trained it."""

    step: int
    start: int
    stop: int
    quorum: int
    participants: int

    def to_list(self) -> list[int]:
        """The step as its report, the journal and snapshots carry it: ``[steps committed before it, start,
        stop, quorum, participants]`` (torchft's count, which every release wrote)."""
        return [self.step - 1, self.start, self.stop, self.quorum, self.participants]

    @classmethod
    def from_list(cls, v: Sequence[int]) -> CommittedStep:
        """Inverse of :meth:`to_list`. Raises ValueError for a list it would not have written."""
        if len(v) != 5:
            raise ValueError(f"a committed step is [steps before it, start, stop, quorum, participants] (got {list(v)!r})")
        before, start, stop, quorum, participants = (int(x) for x in v)
        return cls(before + 1, start, stop, quorum, participants)


def _shown(c: CommittedStep) -> str:
    return f"stream [{c.start}, {c.stop}) of quorum {c.quorum} with {c.participants} participants"


@dataclasses.dataclass
class StepRun:
    """One start of a fault-tolerant job: its incarnation, the run whose checkpoint it resumed from and
    at which step (`resumed`: the steps committed before it; it trains steps ``resumed + 1`` on), how it
    sizes steps, and the steps it committed (in step order; a step reported twice is recorded once)."""

    run: str
    parent: str  # the run that saved the checkpoint it resumed from ("" for a fresh start)
    resumed: int
    mode: str
    batch: int
    steps: list[CommittedStep] = dataclasses.field(default_factory=list)
    #: records a later quorum superseded (their updates died with the groups that made them)
    dropped: list[CommittedStep] = dataclasses.field(default_factory=list)

    @property
    def reached(self) -> int:
        """The last step recorded (the resume step when none is)."""
        return self.steps[-1].step if self.steps else self.resumed

    def find(self, step: int) -> CommittedStep | None:
        i = bisect.bisect_left(self.steps, step, key=lambda c: c.step)
        return self.steps[i] if i < len(self.steps) and self.steps[i].step == step else None

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "parent": self.parent, "resumed": self.resumed, "mode": self.mode, "batch": self.batch,
                "steps": [c.to_list() for c in self.steps], "dropped": [c.to_list() for c in self.dropped]}

    @classmethod
    def from_dict(cls, v: Any) -> StepRun:
        if not isinstance(v, dict):
            raise ValueError(f"a step run is a map (got {type(v).__name__})")
        try:
            out = cls(str(v["run"]), str(v["parent"]), int(v["resumed"]), str(v["mode"]), int(v["batch"]),
                      [CommittedStep.from_list(c) for c in v["steps"]],
                      [CommittedStep.from_list(c) for c in v["dropped"]])
        except KeyError as e:
            raise ValueError(f"a step run has no {e.args[0]!r}") from None
        check_choice("mode", out.mode, MODES)
        return out


class Steps:
    """A job's record of committed steps over its runs, and the rules a new report must meet."""

    def __init__(self, runs: Sequence[StepRun] = ()) -> None:
        self.runs: list[StepRun] = list(runs)

    def run(self, name: str) -> StepRun | None:
        for r in reversed(self.runs):
            if r.run == name:
                return r
        return None

    def check(self, run: str, parent: str, resumed: int, mode: str, batch: int, c: CommittedStep) -> str | None:
        """Why a report cannot be recorded (None: it can). A report names its run; the run's first report
        opens it; every later one must agree with how it sizes steps and with the span its step has."""
        check_choice("mode", mode, MODES)
        check_int("batch", batch, 1)
        check_int("resumed", resumed, 0)
        check_int("step", c.step, 1)
        check_int("participants", c.participants, 1)
        if c.step <= resumed:
            return f"step {c.step} is not after the step its run resumed at ({resumed})"
        if c.stop - c.start != (batch if mode == "global" else batch * c.participants) or c.start < 0:
            return (f"step {c.step} spans [{c.start}, {c.stop}), which is not a step of {mode} batch {batch} "
                    f"with {c.participants} participants")
        if mode == "global" and c.start != (c.step - 1) * batch:
            return f"step {c.step} of global batch {batch} starts at {(c.step - 1) * batch}, not {c.start}"
        r = self.run(run)
        if r is None and parent:
            try:
                self.lineage(StepRun(run, parent, resumed, mode, batch))
            except LineageCycle:
                return f"run {run!r} resumes from run {parent!r}, which descends from {run!r}: a run cannot be its own ancestor"
        if r is not None:
            if (r.parent, r.resumed, r.mode, r.batch) != (parent, resumed, mode, batch):
                return (f"run {run!r} was opened resuming step {r.resumed} of run {r.parent!r} with {r.mode} batch "
                        f"{r.batch}; this report says step {resumed} of run {parent!r} with {mode} batch {batch}")
            seen = r.find(c.step)
            if seen is not None and seen.quorum == c.quorum and seen != c:
                return (f"step {c.step} of run {run!r} was recorded as {_shown(seen)}, and is now reported as "
                        f"{_shown(c)} by the same quorum")
        return None

    def is_new(self, run: str, c: CommittedStep) -> bool:
        """Whether a checked report changes the record: not one recorded already, nor a stale one.

        A report of step ``s`` from quorum ``q`` is stale when a step at or before ``s`` was recorded
        from a later quorum: that quorum committed it again, so the report's update is lost (reports
        of one lineage arrive in any order; their quorums do not decrease with the step).
        """
        r = self.run(run)
        if r is None:
            return True
        i = bisect.bisect_right(r.steps, c.step, key=lambda x: x.step)
        if i and (r.steps[i - 1].quorum > c.quorum or r.steps[i - 1] == c):
            return False
        return c not in r.dropped

    def record(self, run: str, parent: str, resumed: int, mode: str, batch: int, c: CommittedStep) -> bool:
        """Records a checked report; False when it changes nothing (see :meth:`is_new`). The records of
        step ``s`` and later from earlier quorums than the report's are dropped (superseded)."""
        if not self.is_new(run, c):
            return False
        r = self.run(run)
        if r is None:
            r = StepRun(run, parent, resumed, mode, batch)
            self.runs.append(r)
        lo = bisect.bisect_left(r.steps, c.step, key=lambda x: x.step)
        hi = lo
        while hi < len(r.steps) and r.steps[hi].quorum < c.quorum:
            hi += 1
        r.dropped.extend(r.steps[lo:hi])
        r.steps[lo:hi] = [c]
        return True

    def lineage(self, latest: StepRun | None = None) -> list[tuple[StepRun, int | None]]:
        """The latest run's lineage (``croupier.core.history.lineage``), oldest first, each run with the last
        step of it that is kept (the step its successor resumed at; None for the latest run, kept to its end).

        Args:
            latest: A run not yet recorded to walk from (its name stands for it where a recorded run names
                it as a parent); None for the latest recorded run.
        """
        def parent(r: StepRun) -> tuple[StepRun, int] | None:
            p = latest if latest is not None and r.parent == latest.run else self.run(r.parent) if r.parent else None
            return None if p is None else (p, r.resumed)
        return lineage(latest if latest is not None else self.runs[-1] if self.runs else None, parent)

    def kept(self, step: int) -> tuple[StepRun, CommittedStep] | None:
        """The run and record that the job's timeline keeps for `step` (from 1), None when it has none.

        The timeline is the latest run's lineage: the run itself after the step it resumed at, then
        the run whose checkpoint it resumed from, up to that step, and so on; what other runs
        committed is abandoned (a rollback, or a run whose checkpoint no later run resumed from).
        """
        for r, until in self.lineage():
            if r.resumed < step and (until is None or step <= until):
                c = r.find(step)
                return None if c is None else (r, c)
        return None

    def abandoned(self, step: int) -> list[tuple[StepRun, CommittedStep]]:
        """Every recorded version of `step` the timeline does not keep, oldest run first."""
        kept = self.kept(step)
        out = []
        for r in self.runs:
            out += [(r, c) for c in r.dropped if c.step == step]
            c = r.find(step)
            if c is not None and (kept is None or kept[0] is not r):
                out.append((r, c))
        return out
