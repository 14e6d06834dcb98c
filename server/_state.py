"""The coordinator's state machine: jobs, generations, progress, checkpoints and deals, changed only through apply(event).

Deciding and applying are separate: the decisions (``croupier.server._decide``) read the state and
return events with every value already decided; :meth:`State.apply` makes one event part of the
state through that event's one handler (:data:`HANDLERS`), and never fails on an event a decision
made of the same state. Replaying the journal of events over the last snapshot therefore rebuilds
the exact state. The events and their codec are in ``croupier.server._events``, a job's records and
their snapshot form in ``croupier.server._jobs``.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from croupier.core.amend import Amendment
from croupier.core.api import CHECKPOINT_HISTORY, MAX_COUNT, MAX_NAME, CheckpointRecord, JoinResult
from croupier.core.checks import check_int, check_name
from croupier.core.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound
from croupier.core.ftsteps import CommittedStep
from croupier.core.ledger import Segment
from croupier.core.schedule import Schedule
from croupier.core.spec import ORDER_VERSION
from croupier.server._events import (
    FORMAT_VERSION,
    AmendmentRecorded,
    AmendmentsLoaded,
    BatchesCommitted,
    BatchesDealt,
    CheckpointRecorded,
    EpochCut,
    Event,
    FormatError,
    GenerationAmended,
    GenerationOpened,
    GenerationStarted,
    JobRegistered,
    ProgressReported,
    RankJoined,
    StepCommitted,
    as_list,
    as_map,
    check_version,
)
from croupier.server._jobs import Generation, Job, restore_job, snapshot_job

# --------------------------------------------------------------------------- state


class State:
    """Every job the coordinator holds. Change it only through :meth:`apply`."""

    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}

    # ---------------------------------------------------------------- queries

    def checkpoint(self, job: str, step: int | None) -> CheckpointRecord:
        """The job's record of training step `step`, or its latest record for None.

        Raises:
            NotFound: an unknown job, or no record of that step (the message lists the steps recorded).
        """
        self.current(job)
        records = self.jobs[job].checkpoints
        if step is None:
            if not records:
                raise NotFound(f"job {job!r} has recorded no checkpoint")
            return records[-1]
        check_int("step", step, 0, MAX_COUNT, InvalidArgument)
        for c in reversed(records):
            if c.step == step:
                return c
        steps = [c.step for c in records if c.step is not None]
        shown = ", ".join(map(str, steps[-16:])) or "none"
        raise NotFound(
            f"job {job!r} has no checkpoint recorded at step {step} (steps recorded: {shown}; the coordinator "
            f"keeps the last {CHECKPOINT_HISTORY})"
        )

    # ---------------------------------------------------------------- application

    def apply(self, ev: Event) -> None:
        """Makes one event part of the state, through its handler in :data:`HANDLERS`."""
        handle = HANDLERS.get(type(ev))
        if handle is None:  # pragma: no cover - the Event union is closed (HANDLERS is checked at import)
            raise TypeError(f"not an event: {ev!r}")
        handle(self, ev)

    def _segment(self, job: str, number: int) -> Segment:
        """The segment of generation `number`, which MUST be the job's current one and started: the one owner of
        what it did (``croupier.server._jobs.Job``)."""
        self._generation(job, number)
        seg = self.jobs[job].segment
        if seg is None:
            raise RuntimeError(f"event for generation {number} of job {job!r} before it started does not follow the journal")
        return seg

    def _generation(self, job: str, number: int) -> Generation:
        gen = self.jobs[job].generation
        if gen is None or gen.number != number:
            raise RuntimeError(f"event for generation {number} of job {job!r} does not follow the journal")
        return gen

    def join_result(self, job: str, rank: int) -> JoinResult:
        """Where `rank` of `job`'s current generation stands (after its join was applied)."""
        gen = self.current(job)
        j = self.jobs[job]
        return JoinResult(gen.number, gen.world, gen.start, gen.waiting_for(), j.held, j.spec, gen.waiting())

    def current(self, job: str) -> Generation:
        """The job's current generation. Raises NotFound for an unknown job."""
        check_name("job name", job, MAX_NAME, InvalidArgument)
        j = self.jobs.get(job)
        if j is None or j.generation is None:
            raise NotFound(f"job {job!r} is not known to this coordinator (a rank must join it first)")
        return j.generation

    def generation(self, job: str, generation: int) -> Generation:
        """The job's generation `generation`, which MUST be the current one and started.

        Raises:
            NotFound: unknown job, or a generation newer than the current one.
            Aborted: an older generation (fenced).
            FailedPrecondition: the generation is still waiting for ranks to join.
        """
        gen = self.current(job)
        check_int("generation", generation, 1, MAX_COUNT, InvalidArgument)
        if generation < gen.number:
            raise Aborted(
                f"generation {generation} of job {job!r} was replaced by generation {gen.number}; "
                "this rank has been fenced off"
            )
        if generation > gen.number:
            raise NotFound(f"job {job!r} has no generation {generation} (the current one is {gen.number})")
        if gen.start is None:
            raise FailedPrecondition(
                f"generation {generation} of job {job!r} is waiting for ranks {list(gen.waiting_for())} to join"
            )
        return gen

    # ---------------------------------------------------------------- snapshots

    def snapshot(self) -> dict[str, Any]:
        """The whole state as a plain (msgpack-able) dict, with the format ``version`` (see croupier.server._jobs)."""
        return {"version": FORMAT_VERSION, "order": ORDER_VERSION, "jobs": [snapshot_job(j) for j in self.jobs.values()]}

    @classmethod
    def restore(cls, snap: Any, events: Sequence[Event] = ()) -> State:
        """A state from a snapshot and the events journaled after it.

        Args:
            snap: What :meth:`snapshot` returned (e.g. read back by msgpack), or None for the
                empty state.
            events: The events journaled after the snapshot, in order.

        Returns:
            The state.

        Raises:
            FormatError: If ``snap`` is not a snapshot :meth:`snapshot` would have written: no or
                another format version, a missing or unknown field, a field of the wrong type,
                or a job twice.
        """
        s = cls()
        if snap is not None:
            if not isinstance(snap, Mapping):
                raise FormatError(f"a snapshot must be a map (got {type(snap).__name__})")
            if "version" not in snap:
                raise FormatError(f"the snapshot has no format version (fields: [{', '.join(sorted(map(repr, snap)))}])")
            check_version("snapshot", snap)
            body = as_map("the snapshot", snap, ["version", "order", "jobs"])
            for i, jd in enumerate(as_list("snapshot jobs", body["jobs"])):
                job = restore_job(f"snapshot job {i}", jd, body["version"])
                if job.name in s.jobs:
                    raise FormatError(f"snapshot job {i}: job {job.name!r} appears twice")
                s.jobs[job.name] = job
        for ev in events:
            s.apply(ev)
        return s


# --------------------------------------------------------------------------- helpers



def _record(records: list[CheckpointRecord], new: CheckpointRecord) -> list[CheckpointRecord]:
    """The job's checkpoint history after `new`.

    A record at step s from a newer generation replaces every record of an older generation at
    step s or later: the job rolled back to a checkpoint before them (or resized from one), and
    their steps now name other states (the trainer overwrites those checkpoints too). Then the
    oldest go until CHECKPOINT_HISTORY are left.
    """
    kept = records
    if new.step is not None:
        kept = [c for c in records if c.step is None or c.step < new.step or c.generation >= new.generation]
    return [*kept, new][-CHECKPOINT_HISTORY:]


# --------------------------------------------------------------------------- the handlers: one per event


def _job_registered(s: State, ev: JobRegistered) -> None:
    s.jobs[ev.job] = Job(ev.job, ev.spec)


def _generation_opened(s: State, ev: GenerationOpened) -> None:
    job = s.jobs[ev.job]
    replaced = job.segment
    if replaced is not None:
        replaced.ranks = {}  # the replaced world's ranks: the new generation's reports start afresh
    job.generation = Generation(ev.generation, ev.world, ev.incarnation)
    job.incarnations.append(ev.incarnation)
    job.loaded = None


def _rank_joined(s: State, ev: RankJoined) -> None:
    gen = s._generation(ev.job, ev.generation)
    gen.add(ev.rank, ev.resume, ev.epoch)
    if ev.resume is not None and gen.resumed is None:
        gen.resumed = (ev.rank, ev.step, ev.parent)
    if gen.schedule is None:
        gen.schedule = (ev.rank, ev.schedule)


def _generation_started(s: State, ev: GenerationStarted) -> None:
    gen = s._generation(ev.job, ev.generation)
    gen.start = ev.start
    schedule = Schedule() if ev.schedule is None else Schedule.from_list(ev.schedule)
    # NOTE: a journal of format 7 or older did not record the time (at_ms None): 0, "not known".
    s.jobs[ev.job].ledger.append(Segment(gen.number, gen.incarnation, gen.world, ev.start, ev.step, ev.parent,
                                         schedule, at_ms=ev.at_ms or 0))


# NOTE: each handler below writes its event's facts once: a generation's into its segment (progress,
# deals, commits, held amendments), the job's into the job (its checkpoint records, its amendments).


def _progress_reported(s: State, ev: ProgressReported) -> None:
    s._segment(ev.job, ev.generation).reported(ev.rank, ev.epoch, ev.batches, ev.at_ms)


def _checkpoint_recorded(s: State, ev: CheckpointRecorded) -> None:
    seg = s._segment(ev.job, ev.generation)
    job = s.jobs[ev.job]
    job.checkpoints = _record(job.checkpoints, CheckpointRecord(
        ev.step, ev.cursor, ev.origin, ev.generation, ev.rank, ev.at_ms, seg.amendments, ev.items))
    seg.checkpoint(ev.step)


def _batches_dealt(s: State, ev: BatchesDealt) -> None:
    s._segment(ev.job, ev.generation).deal(ev.epoch, ev.rank, ev.first, ev.count)


def _batches_committed(s: State, ev: BatchesCommitted) -> None:
    s._segment(ev.job, ev.generation).commit(ev.epoch, ev.rank, ev.batches)


def _step_committed(s: State, ev: StepCommitted) -> None:
    s.jobs[ev.job].steps.record(ev.run, ev.parent, ev.resumed, ev.mode, ev.batch, CommittedStep.from_list(
        [ev.step, ev.start, ev.stop, ev.quorum, ev.participants]))  # the journal's form


def _amendment_recorded(s: State, ev: AmendmentRecorded) -> None:
    s.jobs[ev.job].amendments.append(Amendment(ev.kind, ev.values))


def _amendments_loaded(s: State, ev: AmendmentsLoaded) -> None:
    s._generation(ev.job, ev.generation)
    s.jobs[ev.job].loaded = ev.amendments


def _generation_amended(s: State, ev: GenerationAmended) -> None:
    s._segment(ev.job, ev.generation).amendments = ev.amendments


def _epoch_cut(s: State, ev: EpochCut) -> None:
    s._segment(ev.job, ev.generation).cut(ev.epoch, ev.micro)


#: Each event's one handler: how :meth:`State.apply` makes it part of the state.
HANDLERS: Mapping[type, Callable[[State, Any], None]] = {
    JobRegistered: _job_registered, GenerationOpened: _generation_opened, RankJoined: _rank_joined,
    GenerationStarted: _generation_started, ProgressReported: _progress_reported,
    CheckpointRecorded: _checkpoint_recorded, BatchesDealt: _batches_dealt, BatchesCommitted: _batches_committed,
    StepCommitted: _step_committed, AmendmentRecorded: _amendment_recorded, AmendmentsLoaded: _amendments_loaded,
    GenerationAmended: _generation_amended, EpochCut: _epoch_cut,
}
if set(HANDLERS) != set(typing.get_args(Event)):  # pragma: no cover - caught at import by every test
    raise TypeError(f"State.apply must have one handler per event (missing: "
                    f"{sorted(t.__name__ for t in set(typing.get_args(Event)) - set(HANDLERS))})")
