"""The step ledger of a job of torchft replica groups: its history's runs are step runs (``croupier.core.ftsteps``).

A variant of a job's history (``croupier.core.history``), not a model of its own: it answers the
same questions as :class:`croupier.core.ledger.Ledger` with the same answers (a step's
:class:`~croupier.core.answers.Version`s, a sample's :class:`~croupier.core.answers.Occurrence`s, the
timeline's rows), from the coordinator's record of committed steps per run. Steps count from 1; the
lineage is :meth:`croupier.core.ftsteps.Steps.lineage`.

In a version of a torchft step the "ranks" are the step's participating replica groups, in the
quorum's participant order (part ``g`` of the step's stream span is group ``g``'s), each with one
micro-batch; `world` is how many took part. A run is numbered (its `generation`) by its place in the
record, 1 for the first the coordinator learnt of, and named (its `incarnation`) by its run name.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np

from croupier.core.answers import Occurrence, StepRecord, Version
from croupier.core.checks import check_int
from croupier.core.errors import FailedPrecondition, InvalidArgument, OutOfRange
from croupier.core.ftsteps import CommittedStep, StepRun, Steps, part, stream_runs
from croupier.core.history import LineageCycle, StepRange, check_step
from croupier.core.kept import NO_KEPT, KeptSteps, steps_per_piece
from croupier.core.mixture import sample_seeds
from croupier.core.order import order, tags
from croupier.core.permute import position_of
from croupier.core.registry import kind_of
from croupier.core.spec import Spec

__all__ = ["QuorumLedger"]


class QuorumLedger(StepRange):
    """Answers a torchft job's step and sample questions from its record of committed steps.

    Args:
        job: The job's name (for messages).
        spec: The job's spec (its stream's order).
        record: Its committed steps per run. It MUST NOT change while the ledger is used.

    Raises:
        FailedPrecondition: the runs' parents make a cycle (no lineage can be drawn).
    """

    def __init__(self, job: str, spec: Spec, record: Steps) -> None:
        self.job, self.spec, self.record = job, spec, record
        self._kind = kind_of(spec)  # its stepped variant says which position each place of an epoch is
        self._number = {id(r): k + 1 for k, r in enumerate(record.runs)}
        try:
            self._lineage = record.lineage()
        except LineageCycle as e:
            name = e.run.run if isinstance(e.run, StepRun) else "?"
            raise FailedPrecondition(f"job {job!r}: its runs' parents make a cycle (back to run {name!r})") from None

    # ---------------------------------------------------------------- steps

    @property
    def last_step(self) -> int:
        """The last step the job's lineage trained (0 before its first)."""
        return self.record.runs[-1].reached if self.record.runs else 0

    @functools.cached_property
    def furthest_step(self) -> int:
        """The last step any version trained (an abandoned one may have gone past the lineage)."""
        return max([self.last_step, *(c.step for r in self.record.runs for c in (*r.steps, *r.dropped))])

    def _check_step(self, t: int) -> None:
        check_step(t)
        if not self.record.runs:
            raise FailedPrecondition(f"job {self.job!r} has no run that committed a step yet")
        if t > self.furthest_step:
            raise OutOfRange(f"step {t} is past the run: job {self.job!r} has trained {self.last_step} steps "
                             "(as far as its replica groups reported)")

    def step(self, t: int) -> StepRecord:
        """What step `t` trained: the version the lineage keeps and every abandoned one.

        Raises:
            InvalidArgument: `t` is not an int >= 1.
            OutOfRange: `t` is past the last step any run committed.
        """
        self._check_step(t)
        kept = self.record.kept(t)
        return StepRecord(t, None if kept is None else self._version(*kept, True),
                          tuple(self._version(r, c, False) for r, c in self.record.abandoned(t)))

    def _version(self, r: StepRun, c: CommittedStep, kept: bool) -> Version:
        """Step `c` of run `r` as a version: its groups' parts of the stream span, with sources and seeds."""
        n = self.spec.n
        group = np.concatenate([np.full(b - a, g, dtype=np.int64) for g in range(c.participants)
                                for a, b in [part(c.start, c.stop, c.participants, g)]])  # (samples,)
        idx, src, sep = [], [], []
        for epoch, a, b in stream_runs(n, c.start, c.stop):
            pos = self._kind.stepped_positions(self.spec, epoch, a, b)
            idx.append(order(self.spec, epoch, pos))
            s, e = tags(self.spec, epoch, pos)
            src.append(s)
            sep.append(e)
        index, source, source_epoch = np.concatenate(idx), np.concatenate(src), np.concatenate(sep)
        samples = (group, np.zeros_like(group), index, source, source_epoch,
                   sample_seeds(self.spec.seed, source, source_epoch, index))
        return Version(c.step, self._number[id(r)], r.run, c.participants, c.start // n, kept, samples,
                       quorum=c.quorum, span=(c.start, c.stop))

    def kept_order(self, a: int, b: int) -> Iterator[KeptSteps]:
        """The kept versions' indices of steps `a` .. `b`, in pieces (``croupier.core.history.History.kept_order``).

        Raises:
            InvalidArgument, OutOfRange, FailedPrecondition: as :meth:`steps` (at once, not when iterated).
        """
        self._check_range(a, b)
        return self._kept_order(a, b)

    def _kept_order(self, a: int, b: int) -> Iterator[KeptSteps]:
        spans = np.zeros((b - a + 1, 2), dtype=np.int64)  # (steps, 2): each kept step's stream [start, stop)
        kept, claimed = np.zeros(b - a + 1, dtype=bool), np.zeros(b - a + 1, dtype=bool)
        for r, until in self._lineage:  # NOTE: as Steps.kept: the first run of the lineage whose range holds a step decides
            lo, hi = max(a, r.resumed + 1), b if until is None else min(b, until)
            if lo > hi:
                continue
            free = ~claimed[lo - a:hi - a + 1]
            claimed[lo - a:hi - a + 1] = True
            i = bisect.bisect_left(r.steps, lo, key=lambda c: c.step)
            while i < len(r.steps) and r.steps[i].step <= hi:
                c = r.steps[i]
                if free[c.step - lo]:
                    spans[c.step - a], kept[c.step - a] = (c.start, c.stop), True
                i += 1
        sizes = np.where(kept, spans[:, 1] - spans[:, 0], NO_KEPT)  # (steps,)
        per = steps_per_piece(int(sizes.max(initial=1)))
        for k0 in range(0, sizes.size, per):
            yield KeptSteps(a + k0, sizes[k0:k0 + per], self._stream_indices(spans[k0:k0 + per][kept[k0:k0 + per]]))

    def _stream_indices(self, spans: np.ndarray) -> np.ndarray:
        """The indices of the stream spans `spans` ``(k, 2)``, one after the other (adjacent spans mapped at once)."""
        joined = np.flatnonzero(spans[1:, 0] != spans[:-1, 1]) + 1
        firsts, lasts = np.r_[0, joined].tolist(), np.r_[joined - 1, spans.shape[0] - 1].tolist()
        idx = [order(self.spec, epoch, self._kind.stepped_positions(self.spec, epoch, lo, hi))
               for i, j in zip(firsts, lasts) if spans.shape[0]
               for epoch, lo, hi in stream_runs(self.spec.n, int(spans[i, 0]), int(spans[j, 1]))]
        return np.concatenate(idx) if idx else np.zeros(0, dtype=np.int64)

    def ends_epoch(self, t: int) -> bool:
        """Whether kept step `t` trains its epoch's last sample (a step may run on into the next epoch)."""
        kept = self.record.kept(t)
        return kept is not None and kept[1].start // self.spec.n != kept[1].stop // self.spec.n

    # ---------------------------------------------------------------- samples

    def index(self, index: int, source: int | None = None) -> list[Occurrence]:
        """Every step at which dataset index `index` was trained, kept or abandoned, oldest epoch first; an
        occurrence's `rank` is the participating group (of its quorum) that trained it.

        Raises:
            InvalidArgument: `index` is out of the dataset, or a `source` is named (the job is not a mixture).
        """
        n = self.spec.n
        check_int("index", index, 0, n, InvalidArgument)
        if source is not None:
            raise InvalidArgument(f"source={source}: job {self.job!r} is not a mixture (it has one source, 0)")
        records = [(r, c) for r in self.record.runs for c in (*r.steps, *r.dropped)]
        if not records:
            return []
        out: list[Occurrence] = []
        for epoch in range((max(c.stop for _, c in records) + n - 1) // n):
            p = epoch * n + self._position(epoch, index)
            out.extend(self._at(p, epoch, records))
        return sorted(out)

    def _position(self, epoch: int, index: int) -> int:
        """`index`'s place in `epoch` as the steps take it: its position in the epoch's order (the order's inverse
        where at hand, else the order searched), at its kind's place."""
        pos = position_of(self.spec, epoch, index)
        if pos is None:
            pos = int(np.flatnonzero(order(self.spec, epoch, np.arange(self.spec.n, dtype=np.int64)) == index)[0])
        return self._kind.stepped_place(self.spec, epoch, pos)

    def _at(self, p: int, epoch: int, records: list[tuple[StepRun, CommittedStep]]) -> Iterator[Occurrence]:
        """The recorded versions whose span holds stream position `p` (of `epoch`), as occurrences."""
        for r, c in records:
            if c.start <= p < c.stop:
                bounds = [part(c.start, c.stop, c.participants, g)[1] for g in range(c.participants)]
                kept = self.record.kept(c.step)
                yield Occurrence(epoch, c.step, bisect.bisect_right(bounds, p), self._number[id(r)], 0,
                                 kept is not None and kept[0] is r and kept[1] == c, 0, epoch)

    # ---------------------------------------------------------------- summaries

    def timeline(self) -> list[dict[str, Any]]:
        """Each run, as :meth:`croupier.core.ledger.Ledger.timeline` lists a generation: its number and name, the most
        groups a step of it had (`world`), its first epoch, the steps it trained and up to which it is kept; and its
        sizing (`mode`, `batch`) and the records a later quorum superseded."""
        kept_to = {id(r): (r.reached if until is None else until) for r, until in self._lineage}
        out = []
        for r in self.record.runs:
            parent = self.record.run(r.parent) if r.parent else None
            out.append({"generation": self._number[id(r)], "incarnation": r.run,
                        "world": max((c.participants for c in r.steps), default=0),
                        "epoch": r.steps[0].start // self.spec.n if r.steps else None, "from_step": r.resumed,
                        "parent": None if parent is None else self._number[id(parent)], "to_step": r.reached,
                        "kept_to": kept_to.get(id(r)), "amendments": [],
                        "global_batch": r.batch if r.mode == "global" else None, "at_ms": 0,
                        "mode": r.mode, "batch": r.batch, "superseded": len(r.dropped)})
        return out

    def constant_batch(self) -> int | None:
        """The samples per step when every kept run keeps the global batch, and the same one, else None."""
        sizes = {(r.mode, r.batch) for r, _ in self._lineage}
        if len(sizes) != 1:
            return None
        mode, batch = sizes.pop()
        return batch if mode == "global" else None

    def why_batch_varies(self) -> str:
        """Why :meth:`constant_batch` is None, in words."""
        runs = [r for r, _ in self._lineage]
        if any(r.mode == "group" for r in runs):
            return ("its steps are sized per replica group (group_batch): a step takes the group batch times the "
                    "groups of its quorum")
        return "its global batch changed: " + ", ".join(f"run {r.run!r} took {r.batch} samples a step" for r in runs)
