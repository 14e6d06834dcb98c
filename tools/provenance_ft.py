"""`croupier provenance` for a fault-tolerant job (torchft): a committed step's samples per group, a sample's steps.

The coordinator keeps a fault-tolerant job's committed steps per run (``CommitStep``,
``croupier.core.ftsteps``); the samples are recomputed here from the spec. Steps count from 1 as
elsewhere: step ``T`` is the ``T``-th committed step, the one after which torchft's
``manager.current_step()`` reads ``T`` (its stream span is that of dealt step ``T - 1``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from croupier.core.errors import InvalidArgument, OutOfRange
from croupier.core.ftsteps import CommittedStep, StepRun, Steps, part, stream_indices, stream_runs
from croupier.core.permute import position_of
from croupier.core.spec import Spec

__all__ = ["FtVersion", "ft_index", "ft_lines", "ft_step", "ft_summary"]


@dataclasses.dataclass(frozen=True)
class FtVersion:
    """One recorded version of a committed step: the run, whether the timeline keeps it, its quorum and each
    participating group's samples (participant 0 first)."""

    step: int  # counted from 1
    run: str
    kept: bool
    quorum: int
    start: int  # stream positions [start, stop)
    stop: int
    groups: tuple[tuple[int, ...], ...]
    epochs: tuple[int, ...]  # the epochs its samples belong to

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "run": self.run, "kept": self.kept, "quorum": self.quorum, "start": self.start,
                "stop": self.stop, "epochs": list(self.epochs), "groups": [list(g) for g in self.groups]}


def _version(spec: Spec, r: StepRun, c: CommittedStep, kept: bool) -> FtVersion:
    groups = tuple(tuple(int(i) for i in stream_indices(spec, *part(c.start, c.stop, c.participants, g)))
                   for g in range(c.participants))
    epochs = tuple(e for e, _, _ in stream_runs(spec.n, c.start, c.stop))
    return FtVersion(c.step + 1, r.run, kept, c.quorum, c.start, c.stop, groups, epochs)


def last_step(record: Steps) -> int:
    """The last committed step the timeline keeps, counted from 1 (0: none)."""
    if not record.runs:
        return 0
    r = record.runs[-1]
    return r.reached if r.steps else r.resumed


def ft_step(spec: Spec, record: Steps, step: int) -> list[FtVersion]:
    """Every recorded version of committed step `step` (from 1), the kept one first.

    Raises:
        InvalidArgument: `step` < 1.
        OutOfRange: no run recorded that step (the message says how far the job got).
    """
    if step < 1:
        raise InvalidArgument(f"steps count from 1 (got step {step})")
    kept = record.kept(step - 1)
    out = [_version(spec, *kept, True)] if kept is not None else []
    out += [_version(spec, r, c, False) for r, c in record.abandoned(step - 1)]
    if not out:
        raise OutOfRange(f"no run of the job recorded committed step {step} (its timeline reaches step "
                         f"{last_step(record)})")
    return out


def ft_index(spec: Spec, record: Steps, index: int) -> list[dict[str, Any]]:
    """Where dataset index `index` was trained in the kept timeline: per epoch the step (from 1), the run, and
    which participating group of its quorum trained it.

    Raises:
        InvalidArgument: an index outside the dataset, or an order whose inverse croupier does not compute.
    """
    if not 0 <= index < spec.n:
        raise InvalidArgument(f"index {index} is not in the dataset [0, {spec.n})")
    kept = [k for s in range(last_step(record)) if (k := record.kept(s)) is not None]
    if not kept:
        return []
    out = []
    for epoch in range(kept[-1][1].stop // spec.n + 1):
        pos = position_of(spec, epoch, index)
        if pos is None:
            raise InvalidArgument(f"the job's order ({spec.permutation}) has no inverse at hand: ask by step")
        p = epoch * spec.n + pos
        for r, c in kept:
            if c.start <= p < c.stop:
                g = next(g for g in range(c.participants) if p < part(c.start, c.stop, c.participants, g)[1])
                out.append({"epoch": epoch, "step": c.step + 1, "run": r.run, "quorum": c.quorum, "group": g,
                            "position": pos})
                break
    return out


def ft_summary(job: str, record: Steps) -> dict[str, Any]:
    """The job's runs: each run's parent, resume step, sizing and steps recorded (kept or dropped)."""
    return {"job": job, "last_step": last_step(record),
            "runs": [{"run": r.run, "parent": r.parent, "resumed": r.resumed, "mode": r.mode, "batch": r.batch,
                      "steps": len(r.steps), "superseded": len(r.dropped)} for r in record.runs]}


def ft_lines(job: str, versions: list[FtVersion], shown: int, full: bool) -> list[str]:
    """A step's versions as text, the kept one first; `shown` samples per group unless `full`."""
    out = []
    for v in versions:
        state = "kept" if v.kept else "abandoned"
        out.append(f"job {job!r} step {v.step} ({state}, run {v.run!r}, quorum {v.quorum}, {len(v.groups)} groups, "
                   f"stream [{v.start}, {v.stop}), epoch {', '.join(map(str, v.epochs))}):")
        for g, idx in enumerate(v.groups):
            head = idx if full else idx[:shown]
            more = "" if len(head) == len(idx) else f" ... ({len(idx)} in all)"
            out.append(f"  group {g}: {', '.join(map(str, head))}{more}")
    return out
