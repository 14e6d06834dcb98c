"""The coordinator's state machine: jobs, generations, progress, checkpoints and deals, changed only through apply(event).

Deciding and applying are separate. Each ``decide_*`` checks a request against the state and
returns the events it implies, with every value already decided (the generation number, the
resume point, the time, the batches dealt): ``decide_join`` returns its events, ``decide_report``
and ``decide_deal`` the value their caller answers with beside them. A decision changes nothing
and raises a domain error for a bad request. ``apply`` makes one event part of the state and
never fails on an event a decision made of the same state. Replaying the journal of events over
the last snapshot therefore rebuilds the exact state. The events and their codec are in
``croupier.server._events``, a job's records and their snapshot form in ``croupier.server._jobs``.

Serving a plan whose steps are fixed is not an event: batch j of rank r in epoch e of generation
g is a pure function of the generation's resume point and world size (see
``croupier.core.registry``), so a repeated request returns the same batch and a coordinator
restart changes nothing a client sees. A plan the coordinator deals (dynamic dealing) has the
coordinator decide what each rank gets, so every deal is an event (``BatchesDealt``): a repeated
ask gets the deal on record, before and after a restart. What differs between such plans is
asked of the epoch's plan (its ``dealer``, ``croupier.core.plan.Dealer``); what the deals and
commits record is the deal book's (``croupier.core.deals``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from croupier.core.amend import Amendment
from croupier.core.api import (
    CHECKPOINT_HISTORY,
    MAX_COUNT,
    MAX_NAME,
    CheckpointRecord,
    JoinRequest,
    JoinResult,
    validate_join,
)
from croupier.core.checks import check_int, check_name
from croupier.core.cursor import Cursor, bind, fresh, show, validate_cursor
from croupier.core.deals import KEEP_EPOCHS, EpochDeals, dealt, kept
from croupier.core.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound
from croupier.core.ftsteps import CommittedStep
from croupier.core.ledger import Segment
from croupier.core.plan import Dealer, Runs
from croupier.core.registry import kind_of, plan_epoch
from croupier.core.schedule import Schedule
from croupier.core.spec import ORDER_VERSION, Spec
from croupier.server import _amendments, _ftsteps
from croupier.server._events import (
    FORMAT_VERSION,
    AmendmentRecorded,
    AmendmentsLoaded,
    BatchesCommitted,
    BatchesDealt,
    CheckpointRecorded,
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
from croupier.server._jobs import Agreement, Generation, Job, restore_job, snapshot_job

# --------------------------------------------------------------------------- state


class State:
    """Every job the coordinator holds. Change it only through :meth:`apply`."""

    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}

    # ---------------------------------------------------------------- decisions

    def decide_join(self, req: JoinRequest) -> list[Event]:
        """The events a join implies; [] when it repeats one already applied (idempotent).

        Raises:
            InvalidArgument: a malformed request.
            FailedPrecondition: another spec than the job's, another world size than the
                generation's, or a resume point / epoch that disagrees with another rank's.
            Aborted: the incarnation belongs to a generation that a newer one replaced.
        """
        validate_join(req)
        events: list[Event] = []
        job = self.jobs.get(req.job)
        if job is None:
            events.append(JobRegistered(req.job, req.spec))
        elif job.steps.runs:
            raise FailedPrecondition(f"job {req.job!r} is a fault-tolerant job (its steps are reported, not dealt to "
                                     "joining ranks); a sampler must join a job of another name")
        elif req.spec not in job.spec.as_grown(job.amendments):
            raise FailedPrecondition(
                f"job {req.job!r} was registered with spec ({job.spec.describe()}); this rank sent a "
                f"different spec ({req.spec.describe()})"
            )
        elif req.spec != job.spec:  # a rank's sources as grown: the job's spec is what it deals
            req = dataclasses.replace(req, spec=job.spec)
        gen = job.generation if job else None
        resumed, schedule = None, None
        if gen is not None and req.incarnation == gen.incarnation:
            if req.world != gen.world:
                raise FailedPrecondition(
                    f"generation {gen.number} of job {req.job!r} has world size {gen.world}; "
                    f"rank {req.rank} says world size {req.world}"
                )
            number, world, joined, agreed = gen.number, gen.world, gen.joined, gen.agreement
            resumed, schedule = gen.resumed, gen.schedule
        elif job is not None and req.incarnation in job.incarnations:
            current = gen.number if gen else 0
            raise Aborted(
                f"incarnation {req.incarnation!r} belongs to an older generation of job {req.job!r}; "
                f"generation {current} replaced it (this process is a zombie of a previous incarnation)"
            )
        else:
            number, world, joined, agreed = (gen.number if gen else 0) + 1, req.world, {}, Agreement()
            events.append(GenerationOpened(req.job, number, req.world, req.incarnation))

        mine = (req.resume, req.epoch)
        if req.rank in joined:
            if joined[req.rank] != mine:
                raise FailedPrecondition(
                    f"rank {req.rank} already joined generation {number} of job {req.job!r} with "
                    f"resume={show(joined[req.rank][0])}, epoch={joined[req.rank][1]}; now it sends "
                    f"resume={show(req.resume)}, epoch={req.epoch}"
                )
            return events
        agreed.check(req, number)
        sched = None if req.schedule == Schedule() else tuple(req.schedule.to_list())
        _check_steps(req, number, resumed, schedule, sched)
        if req.resume is not None and resumed is None:
            resumed = (req.rank, req.resume_step, req.resume_generation)
        events.append(RankJoined(req.job, number, req.rank, req.resume, req.epoch,
                                 req.resume_step, req.resume_generation, sched))
        start = None
        if len(joined) + 1 == world:
            start = _decide_start(req.spec, {**joined, req.rank: mine}, world)
            if resumed is not None:
                step, parent = resumed[1], resumed[2]
            else:  # no rank loaded a checkpoint: a timeline of its own begins, at step 0 (whatever its epoch)
                step, parent = 0, None
            events.append(GenerationStarted(req.job, number, start, step, parent, sched))
        # NOTE: a mixture's amendments are settled in this one step (those the checkpoint carries,
        # loaded, held from the start); a repeated join above has nothing of them left to settle.
        return events + _amendments.settle_join(req, job, number, start)

    def decide_amend(self, job: str, kind: str, values: Sequence[int]) -> tuple[Amendment, list[Event]]:
        """The amendment a request records (pending: it holds from the next generation's first
        position) and its event (``croupier.server._amendments.decide``).

        Args:
            job: The job's name.
            kind: ``"weights"`` (`values`: each source's parts), ``"grow"`` (source, new size) or
                ``"skip"`` (dataset indices, numbered as the job's ranks hand them out: by the
                sources' sizes under the amendments the current generation holds).

        Raises:
            NotFound: an unknown job.
            FailedPrecondition: a job that deals no mixture, or a grow of a spec with lengths.
            InvalidArgument: values that do not make such an amendment (the message names them).
        """
        self.current(job)
        a = _amendments.decide(self.jobs[job], kind, values)
        return a, [AmendmentRecorded(job, a.kind, a.values)]

    def decide_step(self, job: str, spec: Spec, run: str, parent: str, resumed: int, mode: str, batch: int,
                    step: CommittedStep) -> tuple[bool, list[Event]]:
        """Whether a fault-tolerant job's committed step is new, and its events (``croupier.server._ftsteps``)."""
        check_name("job name", job, MAX_NAME, InvalidArgument)
        return _ftsteps.decide_commit(self.jobs, job, spec, run, parent, resumed, mode, batch, step)

    def decide_report(self, job: str, generation: int, rank: int, epoch: int, batches: int, at_ms: int,
                      checkpoint: tuple[int | None, Cursor | None, str] | None = None,
                      lockstep: bool = True, items: int | None = None) -> tuple[Cursor | None, list[Event]]:
        """The checkpoint's cursor and the events of a rank's report: its progress (when it changed),
        a checkpoint (when new) and, for dynamic dealing without lockstep, the batches the rank
        committed (when more than before).

        Args:
            checkpoint: (step, cursor, origin) of a checkpoint state the rank took, or None. For
                a job with dynamic dealing the cursor is None: the coordinator computes it from
                its deals (the epoch's ``Dealer``), `lockstep` choosing the checkpoint's meaning.
            items: The checkpoint's items of its epoch (what the rank's ``len()`` counted), if named.

        Returns:
            The checkpoint's cursor (the one computed, for dynamic dealing; None without a
            checkpoint), and the events.

        Raises:
            InvalidArgument: a malformed report (a rank outside the world, an epoch before the
                generation's, a cursor that is not one of the job's).
            Aborted, NotFound, FailedPrecondition: as :meth:`generation` (fencing first).
            FailedPrecondition: the generation already recorded `step` with another cursor
                (its ranks are not in lockstep).
        """
        gen = self.generation(job, generation)
        assert gen.start is not None
        check_int("rank", rank, 0, gen.world, InvalidArgument)
        check_int("epoch", epoch, gen.start.epoch, MAX_COUNT, InvalidArgument)
        check_int("batches", batches, 0, MAX_COUNT, InvalidArgument)
        j = self.jobs[job]
        events: list[Event] = []
        last = j.progress.get(rank)
        # NOTE: a rank's loop only goes forward within a generation; a report behind the last one
        # is an older one that arrived late (a lease request sent before a state_dict's report).
        if last is None or last[:2] < (epoch, batches):
            events.append(ProgressReported(job, generation, rank, epoch, batches, at_ms))
        if checkpoint is not None:
            step, named, origin = checkpoint
            # the rank names its checkpoint's cursor, or, for a plan the coordinator deals, the coordinator computes it
            taken = kind_of(j.spec).either(computed=self._named_cursor, dealt=self._dealt_cursor)
            cursor, more, own = taken(job, generation, rank, epoch, batches, named, lockstep)
            events += more
            if step is not None:
                check_int("step", step, 0, MAX_COUNT, InvalidArgument)
            if items is not None:
                check_int("items", items, 0, MAX_COUNT, InvalidArgument)
            if not isinstance(origin, str) or len(origin) > 4 * MAX_NAME:
                raise InvalidArgument(f"origin must be a string of at most {4 * MAX_NAME} characters (got {origin!r})")
            try:
                validate_cursor(j.spec, cursor)
            except ValueError as e:
                raise InvalidArgument(f"checkpoint cursor: {e}") from None
            same = [c for c in j.checkpoints if c.generation == generation and c.step == step
                    and (step is not None or c.cursor == cursor) and not own]
            if same and same[0].cursor != cursor:
                raise FailedPrecondition(
                    f"generation {generation} of job {job!r} recorded step {step} at {show(same[0].cursor)} "
                    f"(rank {same[0].rank}); rank {rank} reports {show(cursor)} for it: the ranks did not "
                    "take the same number of batches before this checkpoint"
                )
            if not same:
                events.append(CheckpointRecorded(job, generation, rank, step, cursor, origin, at_ms, items))
            return cursor, events
        return None, events

    @staticmethod
    def _named_cursor(job: str, generation: int, rank: int, epoch: int, batches: int, cursor: Cursor | None,
                      lockstep: bool) -> tuple[Cursor, list[Event], bool]:
        """The cursor a rank's checkpoint names, for a plan its ranks compute: (cursor, no events, not `own`)."""
        if cursor is None:
            raise InvalidArgument("a reported checkpoint needs its cursor")
        return cursor, [], False

    def _dealt_cursor(self, job: str, generation: int, rank: int, epoch: int, batches: int, cursor: Cursor | None,
                      lockstep: bool) -> tuple[Cursor, list[Event], bool]:
        """The cursor of a rank's checkpoint of a plan the coordinator deals, its events, and whether it is the
        rank's `own` commit: computed from the deals when the rank names none, else the epoch's start it names."""
        spec = self.jobs[job].spec
        if cursor is None:
            cursor, events = self._checkpoint_from_deals(job, generation, rank, epoch, batches, lockstep)
            return cursor, events, not lockstep
        if cursor.remaining != ((0, spec.n),):
            raise InvalidArgument(f"job {job!r} is dealt by its coordinator: its checkpoints' cursors are the coordinator's "
                                  f"to compute (a rank may name only an epoch's start, got {show(cursor)}); report "
                                  "the rank's progress without one")
        self._reachable(job, self.generation(job, generation), cursor.epoch)  # its epoch before: all dealt
        return cursor, [], False

    def _checkpoint_from_deals(self, job: str, generation: int, rank: int, epoch: int, batches: int,
                            lockstep: bool) -> tuple[Cursor, list[Event]]:
        """The cursor of a checkpoint `rank` takes after `batches` batches of its sequence in `epoch`."""
        j = self.jobs[job]
        gen = self.generation(job, generation)
        d = self._dealer(job, gen, epoch)
        if d is None:  # the epoch just before the generation's fresh start: complete
            assert gen.start is not None
            return gen.start, []
        self._reachable(job, gen, epoch)
        book = self._deals(job, epoch)
        # NOTE: a lockstep count may exceed what the rank was dealt: a rank that ran out (DDP's
        # Join) names the trainer's step in the epoch, crediting the others with their batches.
        if not lockstep and batches > book.dealt(rank):
            raise InvalidArgument(f"rank {rank} reports {batches} batches of epoch {epoch}, but was dealt "
                                  f"{book.dealt(rank)} in it")
        events: list[Event] = []
        if not lockstep and batches > book.committed.get(rank, 0):
            events.append(BatchesCommitted(job, generation, rank, epoch, batches))
        if not lockstep:
            # NOTE: a cursor names one epoch. While an earlier epoch still has batches dealt and not
            # committed (a slow worker), the job's record stays in that epoch: this commit is kept
            # (BatchesCommitted), but a relaunch redoes the later epoch's work; it never skips any.
            for e in sorted(j.deals):
                earlier = j.deals[e]
                de = self._dealer(job, gen, e) if e < epoch else None
                if de is None:
                    break
                if earlier.uncommitted():
                    return de.checkpoint(earlier, dict(earlier.committed)), events
        return d.checkpoint(book, book.credits(rank, batches, lockstep)), events

    def _dealer(self, job: str, gen: Generation, epoch: int) -> Dealer | None:
        """The dealer of `epoch`'s plan in `gen` (None for the epoch just before a fresh start: complete).

        Raises:
            OutOfRange: an epoch before the generation's resume point (``plan_epoch``).
            FailedPrecondition: the job's plans are not the coordinator's to deal.
        """
        assert gen.start is not None
        p = plan_epoch(self.jobs[job].dealing_spec, gen.start, gen.world, epoch)
        return None if p is None else kind_of(p.spec).dealer_of(p, job)

    def _reachable(self, job: str, gen: Generation, epoch: int) -> None:
        """Refuses an epoch a rank of `gen` cannot be in: before its start, or after an epoch whose
        batches were not all dealt yet (a rank goes on to epoch e + 1 only once e has nothing left)."""
        assert gen.start is not None
        if epoch <= gen.start.epoch:
            return
        before = self.jobs[job].deals.get(epoch - 1)
        d = self._dealer(job, gen, epoch - 1)
        if d is not None and (before is None or before.next < d.batches):
            done = 0 if before is None else before.next
            raise FailedPrecondition(
                f"epoch {epoch} of job {job!r} cannot begin: epoch {epoch - 1} has dealt {done} of its "
                f"{d.batches} batches (a rank reaches the next epoch once nothing is left to deal)"
            )

    def _deals(self, job: str, epoch: int) -> EpochDeals:
        """The deals of `epoch` in the job's current generation (empty if none yet)."""
        deals = self.jobs[job].deals
        if not kept(deals, epoch):
            raise FailedPrecondition(f"epoch {epoch} of job {job!r} is over: its deals were dropped once epoch "
                                     f"{max(deals)} began (the coordinator keeps the last {KEEP_EPOCHS})")
        return deals.get(epoch) or EpochDeals()

    def decide_deal(self, job: str, generation: int, rank: int, epoch: int, first: int,
                    count: int) -> tuple[tuple[Runs, bool], list[Event]]:
        """A plan the coordinator deals: what `rank` gets when it asks for batches first .. first +
        count - 1 of its sequence in `epoch`: (the runs of global batches, whether the epoch has no
        batch after them for anyone), and the events of a new deal (none for a repeated ask).

        Raises:
            FailedPrecondition: the job's plans are not the coordinator's to deal, or the epoch
                cannot be dealt yet (or any more).
            OutOfRange: an epoch before the generation's resume point.
        """
        gen = self.generation(job, generation)
        check_int("rank", rank, 0, gen.world, InvalidArgument)
        check_int("epoch", epoch, 0, MAX_COUNT, InvalidArgument)
        d = self._dealer(job, gen, epoch)
        if d is None:
            return ((), True), []
        self._reachable(job, gen, epoch)
        book = self._deals(job, epoch)
        try:
            runs, new = d.deal(book, rank, first, count)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        events: list[Event] = [BatchesDealt(job, generation, rank, epoch, g, c) for g, c in runs] if new else []
        return (runs, book.ended(d.batches, runs, new)), events

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
        """Makes one event part of the state."""
        if isinstance(ev, JobRegistered):
            self.jobs[ev.job] = Job(ev.job, ev.spec)
        elif isinstance(ev, GenerationOpened):
            job = self.jobs[ev.job]
            job.generation = Generation(ev.generation, ev.world, ev.incarnation)
            job.incarnations.append(ev.incarnation)
            job.progress = {}  # the replaced world's ranks
            job.deals = {}
            job.held, job.loaded = (), None
        elif isinstance(ev, RankJoined):
            gen = self._generation(ev.job, ev.generation)
            gen.add(ev.rank, ev.resume, ev.epoch)
            if ev.resume is not None and gen.resumed is None:
                gen.resumed = (ev.rank, ev.step, ev.parent)
            if gen.schedule is None:
                gen.schedule = (ev.rank, ev.schedule)
        elif isinstance(ev, GenerationStarted):
            gen = self._generation(ev.job, ev.generation)
            gen.start = ev.start
            schedule = Schedule() if ev.schedule is None else Schedule.from_list(ev.schedule)
            self.jobs[ev.job].ledger.append(Segment(gen.number, gen.incarnation, gen.world, ev.start, ev.step, ev.parent,
                                                    schedule))
        elif isinstance(ev, ProgressReported):
            self._generation(ev.job, ev.generation)
            self.jobs[ev.job].progress[ev.rank] = (ev.epoch, ev.batches, ev.at_ms)
            self._segment(ev.job, ev.generation).report(ev.epoch, ev.batches)
        elif isinstance(ev, CheckpointRecorded):
            self._generation(ev.job, ev.generation)
            job = self.jobs[ev.job]
            job.checkpoints = _record(job.checkpoints, CheckpointRecord(
                ev.step, ev.cursor, ev.origin, ev.generation, ev.rank, ev.at_ms, job.held, ev.items))
            self._segment(ev.job, ev.generation).checkpoint(ev.step)
        elif isinstance(ev, BatchesDealt):
            self._generation(ev.job, ev.generation)
            dealt(self.jobs[ev.job].deals, ev.epoch, ev.rank, ev.first, ev.count)
            self._segment(ev.job, ev.generation).deal(ev.epoch, ev.rank, ev.first, ev.count)
        elif isinstance(ev, StepCommitted):
            self.jobs[ev.job].steps.record(ev.run, ev.parent, ev.resumed, ev.mode, ev.batch, CommittedStep(
                ev.step, ev.start, ev.stop, ev.quorum, ev.participants))
        elif isinstance(ev, AmendmentRecorded):
            self.jobs[ev.job].amendments.append(Amendment(ev.kind, ev.values))
        elif isinstance(ev, AmendmentsLoaded):
            self._generation(ev.job, ev.generation)
            self.jobs[ev.job].loaded = ev.amendments
        elif isinstance(ev, GenerationAmended):
            self._generation(ev.job, ev.generation)
            self.jobs[ev.job].held = ev.amendments
            self._segment(ev.job, ev.generation).amendments = ev.amendments
        elif isinstance(ev, BatchesCommitted):
            self._generation(ev.job, ev.generation)
            self.jobs[ev.job].deals.setdefault(ev.epoch, EpochDeals()).commit(ev.rank, ev.batches)
        else:  # pragma: no cover - the Event union is closed
            raise TypeError(f"not an event: {ev!r}")

    def _segment(self, job: str, number: int) -> Segment:
        """The ledger's segment of generation `number` (which started), or a detached one for a generation
        the ledger does not hold (a snapshot written before the ledger existed): it is not kept."""
        ledger = self.jobs[job].ledger
        if ledger and ledger[-1].generation == number:
            return ledger[-1]
        gen = self._generation(job, number)
        return Segment(number, gen.incarnation, gen.world, gen.start or Cursor(0, ()), None, None)

    def _generation(self, job: str, number: int) -> Generation:
        gen = self.jobs[job].generation
        if gen is None or gen.number != number:
            raise RuntimeError(f"event for generation {number} of job {job!r} does not follow the journal")
        return gen

    # ---------------------------------------------------------------- queries

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


def _decide_start(spec: Spec, joined: Mapping[int, tuple[Cursor | None, int | None]], world: int) -> Cursor:
    """The resume point of a generation whose ranks have all joined (they agree; checked on join)."""
    for c, _ in joined.values():
        if c is not None:
            return bind(spec, c, world)
    epochs = [e for _, e in joined.values() if e is not None]
    return bind(spec, fresh(spec, epochs[0] if epochs else 0), world)


def _check_steps(req: JoinRequest, number: int, resumed: tuple[int, int | None, int | None] | None,
                 schedule: tuple[int, tuple[int, ...] | None] | None, sched: tuple[int, ...] | None) -> None:
    """Refuses a join whose checkpoint's step or step schedule contradicts a rank already joined."""
    where = f"generation {number} of job {req.job!r}"
    if req.resume is not None and resumed is not None and (req.resume_step, req.resume_generation) != resumed[1:]:
        raise FailedPrecondition(
            f"rank {req.rank} resumes {where} from a checkpoint of step {req.resume_step} taken by generation "
            f"{req.resume_generation}, but rank {resumed[0]} from one of step {resumed[1]} taken by generation "
            f"{resumed[2]}: every rank must load the same checkpoint")
    if schedule is not None and schedule[1] != sched:
        raise FailedPrecondition(
            f"rank {req.rank} joins {where} with the step schedule {_show_schedule(sched)}, but rank {schedule[0]} "
            f"with {_show_schedule(schedule[1])}: every rank must count steps alike")
    try:
        req.schedule.check(req.spec, req.world)
    except FailedPrecondition as e:
        raise FailedPrecondition(f"rank {req.rank} joins {where} of {req.world} ranks: {e}") from None


def _show_schedule(s: tuple[int, ...] | None) -> str:
    return "(one micro-batch per step)" if s is None else f"global_batch={s[0]}, rampup={s[1:] if s[1] else None}"


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
