"""The chaos run's fault schedule: which fault comes next, at which step, and when one due past the job's end comes early.

The first faults are one of each kind the run's mode has (in a random order), so that even a short run has
them all; the rest are drawn by weight. A fault is due a random number of steps on (the work left spread
over the faults left); one due after the end of the job comes just before the end instead, so that the run
injects every fault it was asked for; unless it is the last one, it becomes a preemption that rolls back to
an older checkpoint, which leaves room for the rest. Every choice is drawn from the run's ``random.Random``,
in the same order for the same progress, so that a seed replays the same choices.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

from croupier.harness import _dc_replicas, _faults

KINDS = ("rank", "coordinator", "preempt")
WEIGHTS = (0.35, 0.25, 0.40)
#: The replicated mode's faults, with a database control and without one.
REPLICATED_KINDS = ("rank", "replica", "database", "preempt")
REPLICATED_WEIGHTS = (0.25, 0.25, 0.15, 0.35)
NO_DATABASE_KINDS = ("rank", "replica", "preempt")
NO_DATABASE_WEIGHTS = (0.30, 0.30, 0.40)
#: ``--datacenter``: the single coordinator's faults and those of harness/_faults.py (pauses, clock jumps, full disk,
#: partitions, a slow link).
DATACENTER_KINDS = (*KINDS, *_faults.KINDS)
DATACENTER_WEIGHTS = (0.10, 0.09, 0.12, 0.15, 0.12, 0.12, 0.12, 0.10, 0.08)
#: ``--datacenter --replicas K``: the replicated mode's faults and those of harness/_dc_replicas.py.
REPLICATED_DATACENTER_KINDS = (*REPLICATED_KINDS, *_dc_replicas.KINDS)
REPLICATED_DATACENTER_WEIGHTS = (0.08, 0.10, 0.08, 0.12, 0.10, 0.08, 0.12, 0.12, 0.10, 0.10)
#: Faults the job trains through (the others end the launch).
ONLINE = frozenset({"coordinator", "replica", "database", *_faults.KINDS, *_dc_replicas.KINDS})
END_MARGIN = 0.5  # seconds of training before the end of the job: the last moment to inject a fault still due
PACE_WINDOW_S = 1.0  # replicated mode: seconds of a launch's steps seen before its pace is measured
GUESSED_PACE = 0.1  # seconds a step: the pace of a launch until one is measured


def kinds_of(replicated: bool, database: bool, datacenter: bool) -> tuple[tuple[str, ...], tuple[float, ...],
                                                                            tuple[str, ...]]:
    """The faults of a run's mode: the kinds drawn, their weights, and the first faults (one of each kind,
    the database restarted with either shutdown mode where the run restarts it)."""
    if datacenter and replicated:  # a short run still restarts the database with either shutdown mode
        return REPLICATED_DATACENTER_KINDS, REPLICATED_DATACENTER_WEIGHTS, (*REPLICATED_DATACENTER_KINDS, "database")
    if datacenter:
        return DATACENTER_KINDS, DATACENTER_WEIGHTS, DATACENTER_KINDS
    if not replicated:
        return KINDS, WEIGHTS, KINDS
    if database:
        return REPLICATED_KINDS, REPLICATED_WEIGHTS, (*REPLICATED_KINDS, "database")
    return NO_DATABASE_KINDS, NO_DATABASE_WEIGHTS, NO_DATABASE_KINDS


@dataclasses.dataclass(frozen=True)
class Due:
    """A fault to inject now."""

    kind: str
    #: It came early, the job near its end, and is not the last one asked: a preemption that resumes from an
    #: older checkpoint.
    rollback: bool


@dataclasses.dataclass(frozen=True)
class JobShape:
    """What the schedule needs to know of the job: its size, and the steps of its launches."""

    epochs: int
    n: int  # samples an epoch
    batch: int  # samples a worker takes a step
    ckpt_every: int  # steps between checkpoints


class FaultSchedule:
    """The next fault of a chaos run and the step it is due at, launch after launch (see the module).

    Args:
        faults: The faults the run is asked to inject.
        job: The job's shape.
        rng: The run's random choices (drawn here in the order a seed replays).
        replicated: Replicas on a shared store instead of one coordinator.
        database: Whether the run can restart the database (``database`` faults).
        datacenter: Whether the data-center faults are on.
    """

    def __init__(self, faults: int, job: JobShape, rng: random.Random, replicated: bool = False,
                 database: bool = False, datacenter: bool = False) -> None:
        self.faults, self.job, self.rng = faults, job, rng
        self.kinds, self.weights, first = kinds_of(replicated, database, datacenter)
        self.first_kinds = rng.sample(first, len(first))
        # NOTE: a pace measured over the first step or two of a launch is noise (a status read late, the
        # next one at once) that can find the end near and turn a fault the job trains through into a
        # preemption; the replicated mode, whose short run must restart the database twice, waits
        # for a second of steps. The single-coordinator mode keeps its pacing as it was.
        self.pace_window = PACE_WINDOW_S if replicated else 0.0
        self.time_left = math.inf  # seconds of the job left (less END_MARGIN), as last estimated by due()
        self.target: tuple[str, int] | None = None  # (kind, step) of the next fault
        self._first: tuple[float, int] | None = None  # (time, step) of the launch's first status: its pace

    def new_launch(self) -> None:
        """Forgets the launch before: its fault drawn and not injected, its pace."""
        self.target, self._first = None, None

    def due(self, s: dict[str, Any], now: float, injected: int, restart_s: float) -> Due | None:
        """The fault to inject now, if one is due (or the job is near its end with one drawn).

        Args:
            s: The status of the furthest live rank (epoch, step, ``k`` of ``of`` steps of the epoch, world).
            now: The time of `s` (``time.monotonic()``).
            injected: The faults injected so far.
            restart_s: The longest restart seen so far: a fault the job trains through needs that long
                before the end to leave room for the next fault.
        """
        if self._first is None:
            self._first = (now, s["step"])
        if self.target is None and injected < self.faults:
            kind = (self.first_kinds[injected] if injected < len(self.first_kinds)
                    else self.rng.choices(self.kinds, self.weights)[0])
            self.target = (kind, s["step"] + self._gap(kind, s, injected))
        near_end = self._near_end(s, now, restart_s)
        if self.target is None or not (s["step"] >= self.target[1] or near_end):
            return None
        kind, at = self.target
        self.target = None
        early = s["step"] < at or (near_end and kind in ONLINE)
        rollback = early and injected + 1 < self.faults
        if rollback:
            if kind != "preempt" and injected < len(self.first_kinds):
                # A first fault of its kind that became a rollback comes next, once the rollback has made
                # room: a short run still has one of each kind.
                self.first_kinds.insert(injected + 1, kind)
            kind = "preempt"
        return Due(kind, rollback)

    def _near_end(self, s: dict[str, Any], now: float, restart_s: float) -> bool:
        """Whether the job's end is so near that the fault drawn must come now (and the time left, kept)."""
        assert self._first is not None
        first_at, first_step = self._first
        # NOTE: the ranks train on while the coordinator restarts (and the watch waits for it), so a
        # coordinator kill needs that long before the end to leave room for the next fault. So do a replica
        # kill and a database restart.
        measured = s["step"] > first_step and now - first_at >= self.pace_window
        pace = (now - first_at) / (s["step"] - first_step) if measured else GUESSED_PACE  # s/step
        allowance = restart_s if self.target is not None and self.target[0] in ONLINE else 0.0
        steps_left = (s["of"] - s["k"]) + (self.job.epochs - 1 - s["epoch"]) * math.ceil(
            self.job.n / (int(s["world"]) * self.job.batch))
        self.time_left = steps_left * pace - END_MARGIN  # a fault the job trains through ends before it
        return steps_left * pace <= END_MARGIN + allowance

    def _progress(self, s: dict[str, Any]) -> int:
        """An estimate of the samples the job has trained (epochs before this one, and this one's part)."""
        left = (s["of"] - s["k"]) * s["world"] * self.job.batch
        return int(s["epoch"]) * self.job.n + max(0, self.job.n - int(left))

    def _gap(self, kind: str, s: dict[str, Any], injected: int) -> int:
        """Steps from now to the next fault: the remaining work spread over the remaining faults, at random."""
        remaining = max(0, self.job.epochs * self.job.n - self._progress(s))
        per_fault = remaining / (self.faults - injected + 1)
        # NOTE: below the mean on average: the job also moves on while the orchestrator looks and while
        # the coordinator restarts.
        steps = math.ceil(per_fault * self.rng.uniform(0.2, 1.0) / (int(s["world"]) * self.job.batch))
        # A relaunch needs a checkpoint past the one it resumed from to make progress.
        return max(steps, 1 if kind in ONLINE else self.job.ckpt_every + 1)
