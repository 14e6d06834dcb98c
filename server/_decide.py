"""The coordinator's decisions: pure functions of the state and a request that return the events it implies.

Each ``decide_*`` checks a request against the state and returns the events it implies, with every
value already decided (the generation's number, the resume point, the time, the batches dealt):
``decide_join`` returns its events, ``decide_report`` and ``decide_deal`` the value their caller
answers with beside them. A decision changes nothing (it only reads the :class:`State`) and raises a
domain error for a bad request; ``State.apply`` (``croupier.server._state``) then makes each event
part of the state, one handler per event.

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
from typing import NamedTuple

from croupier.core.amend import Amendment
from croupier.core.api import MAX_COUNT, MAX_NAME, JoinRequest, validate_join
from croupier.core.checks import check_int, check_name
from croupier.core.cursor import Cursor, bind, fresh, show, validate_cursor
from croupier.core.deals import KEEP_EPOCHS, EpochDeals, kept
from croupier.core.errors import Aborted, FailedPrecondition, InvalidArgument
from croupier.core.ftsteps import CommittedStep
from croupier.core.ledger import Ledger
from croupier.core.plan import Dealer, Runs
from croupier.core.registry import kind_of, plan_epoch, sized_batches
from croupier.core.schedule import Schedule
from croupier.core.spec import Spec
from croupier.server import _amendments, _ftsteps
from croupier.server._events import (
    AmendmentRecorded,
    BatchesCommitted,
    BatchesDealt,
    CheckpointRecorded,
    EpochCut,
    Event,
    GenerationOpened,
    GenerationStarted,
    JobRegistered,
    ProgressReported,
    RankJoined,
)
from croupier.server._jobs import Agreement, Generation, Job
from croupier.server._state import State


def decide_join(state: State, req: JoinRequest, at_ms: int) -> list[Event]:
    """The events a join implies at time `at_ms`; [] when it repeats one already applied (idempotent).

    Raises:
        InvalidArgument: a malformed request.
        FailedPrecondition: another spec than the job's, another world size than the
            generation's, or a resume point / epoch that disagrees with another rank's.
        Aborted: the incarnation belongs to a generation that a newer one replaced.
    """
    validate_join(req)
    events: list[Event] = []
    job = state.jobs.get(req.job)
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
    number, world, joined, agreed, resumed, schedule = _generation_of(job, req, at_ms, events)
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
        events.append(GenerationStarted(req.job, number, start, step, parent, sched, at_ms))
    # NOTE: a mixture's amendments are settled in this one step (those the checkpoint carries,
    # loaded, held from the start); a repeated join above has nothing of them left to settle.
    return events + _amendments.settle_join(req, job, number, start)


class _Joining(NamedTuple):
    """The generation a join joins, as it stands before the join."""

    number: int
    world: int
    joined: dict[int, tuple[Cursor | None, int | None]]
    agreed: Agreement
    #: what the first rank that resumed said of its checkpoint (rank, step, parent generation)
    resumed: tuple[int, int | None, int | None] | None
    #: the first rank's step schedule (rank, schedule)
    schedule: tuple[int, tuple[int, ...] | None] | None


def _generation_of(job: Job | None, req: JoinRequest, at_ms: int, events: list[Event]) -> _Joining:
    """The generation a join joins; a new one's GenerationOpened is added to `events`.

    Raises:
        FailedPrecondition: the join's world size is not its generation's.
        Aborted: the incarnation belongs to a generation that a newer one replaced.
    """
    gen = job.generation if job else None
    if gen is not None and req.incarnation == gen.incarnation:
        if req.world != gen.world:
            raise FailedPrecondition(
                f"generation {gen.number} of job {req.job!r} has world size {gen.world}; "
                f"rank {req.rank} says world size {req.world}"
            )
        return _Joining(gen.number, gen.world, gen.joined, gen.agreement, gen.resumed, gen.schedule)
    if job is not None and req.incarnation in job.incarnations:
        current = gen.number if gen else 0
        raise Aborted(
            f"incarnation {req.incarnation!r} belongs to an older generation of job {req.job!r}; "
            f"generation {current} replaced it (this process is a zombie of a previous incarnation)"
        )
    number = next_number(job, req, at_ms)
    events.append(GenerationOpened(req.job, number, req.world, req.incarnation))
    return _Joining(number, req.world, {}, Agreement(), None, None)


#: A generation number per microsecond: the first generation of a job that arrives at a store with a
#: checkpoint is numbered from its time in microseconds (see :func:`next_number`).
NUMBERS_PER_MS = 1000


def next_number(job: Job | None, req: JoinRequest, at_ms: int) -> int:
    """The number of the generation that `req` opens at `at_ms`: one past the job's current generation
    and past the generation that took the checkpoint the rank loaded; and, for a job this store does not
    hold that resumes from a checkpoint (its store was lost, or it moved), at least ``at_ms *
    NUMBERS_PER_MS``.

    NOTE: generation numbers are how a checkpoint state names its parent (``resume_generation``) and how
    a zombie is fenced, so no two generations of a job may share one, across stores too. Within a store
    they count up. A store that never saw the job knows of its earlier stores only the checkpoint the
    rank loaded, whose generation may not be their last (a rollback to an older state): so it numbers
    from the time instead, in microseconds, above every number an earlier store gave as long as that
    store opened fewer generations than microseconds went by (one takes a journal append and a join of
    every rank) and the clock did not go back. The number is decided here, in the event, so a replay of
    the journal gives the same.
    """
    gen = job.generation if job else None
    number = max(gen.number if gen else 0, req.resume_generation or 0) + 1
    if job is None and req.resume is not None:
        number = max(number, at_ms * NUMBERS_PER_MS)
    return number


def decide_amend(state: State, job: str, kind: str, values: Sequence[int]) -> tuple[Amendment, list[Event]]:
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
    state.current(job)
    a = _amendments.decide(state.jobs[job], kind, values)
    return a, [AmendmentRecorded(job, a.kind, a.values)]


def decide_step(state: State, job: str, spec: Spec, run: str, parent: str, resumed: int, mode: str, batch: int,
                step: CommittedStep) -> tuple[bool, list[Event]]:
    """Whether a fault-tolerant job's committed step is new, and its events (``croupier.server._ftsteps``)."""
    check_name("job name", job, MAX_NAME, InvalidArgument)
    return _ftsteps.decide_commit(state.jobs, job, spec, run, parent, resumed, mode, batch, step)


def decide_report(state: State, job: str, generation: int, rank: int, epoch: int, batches: int, at_ms: int,
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
    gen = state.generation(job, generation)
    assert gen.start is not None
    check_int("rank", rank, 0, gen.world, InvalidArgument)
    check_int("epoch", epoch, gen.start.epoch, MAX_COUNT, InvalidArgument)
    check_int("batches", batches, 0, MAX_COUNT, InvalidArgument)
    j = state.jobs[job]
    events: list[Event] = []
    last = j.progress.get(rank)
    # NOTE: a rank's loop only goes forward within a generation; a report behind the last one
    # is an older one that arrived late (a lease request sent before a state_dict's report).
    if last is None or last[:2] < (epoch, batches):
        events.append(ProgressReported(job, generation, rank, epoch, batches, at_ms))
    if checkpoint is not None:
        step, named, origin = checkpoint
        # the rank names its checkpoint's cursor, or, for a plan the coordinator deals, the coordinator computes it
        taken = kind_of(j.spec).either(computed=_named_cursor, dealt=_dealt_cursor)
        cursor, more, own = taken(state, job, generation, rank, epoch, batches, named, lockstep)
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
            events += _epoch_cut(state, job, generation, epoch, batches, step)
            events.append(CheckpointRecorded(job, generation, rank, step, cursor, origin, at_ms, items))
        return cursor, events
    return None, events


def _epoch_cut(state: State, job: str, generation: int, epoch: int, batches: int, step: int | None) -> list[Event]:
    """The epoch cut a checkpoint at trainer step `step`, `batches` micro-batches into `epoch`, shows (one
    ``EpochCut``, or none): its step says the trainer moved on from the epoch before sooner than that epoch's
    end (``croupier.core.ledger.Ledger.cut_by``).

    NOTE: for plans the ranks compute, whose ranks take an epoch's steps together, so a rank's count is the
    steps' micro-batches. A plan the coordinator deals has each rank count its own sequence, which says
    nothing of the steps; its epoch ends where its deals do (a trainer that moves on is dealt no more), and
    the ledger reads its steps from the deal book. Token budgets are left out too: placing the checkpoint
    would pack every earlier epoch of the generation again (O(N) each) while the coordinator's calls wait.
    """
    j = state.jobs[job]
    if not kind_of(j.spec).either(computed=sized_batches(j.spec), dealt=False):
        return []
    seg = j.segment
    # NOTE: the first checkpoint of the generation in an epoch shows a cut before it; a later one in the same
    # epoch shows nothing new, and computing the generation's epochs again at every checkpoint would cost
    # each one the plans of every epoch before (a token budget's packing among them).
    if step is None or seg is None or any(c.generation == generation and c.cursor.epoch >= epoch for c in j.checkpoints):
        return []
    cut = Ledger(job, j.spec, [seg]).cut_by(seg, epoch, batches, step)
    return [] if cut is None else [EpochCut(job, generation, cut[0], cut[1])]


def _named_cursor(state: State, job: str, generation: int, rank: int, epoch: int, batches: int, cursor: Cursor | None,
                   lockstep: bool) -> tuple[Cursor, list[Event], bool]:
    """The cursor a rank's checkpoint names, for a plan its ranks compute: (cursor, no events, not `own`)."""
    if cursor is None:
        raise InvalidArgument("a reported checkpoint needs its cursor")
    return cursor, [], False


def _dealt_cursor(state: State, job: str, generation: int, rank: int, epoch: int, batches: int, cursor: Cursor | None,
                  lockstep: bool) -> tuple[Cursor, list[Event], bool]:
    """The cursor of a rank's checkpoint of a plan the coordinator deals, its events, and whether it is the
    rank's `own` commit: computed from the deals when the rank names none, else the epoch's start it names."""
    spec = state.jobs[job].spec
    if cursor is None:
        cursor, events = _checkpoint_from_deals(state, job, generation, rank, epoch, batches, lockstep)
        return cursor, events, not lockstep
    if cursor.remaining != ((0, spec.n),):
        raise InvalidArgument(f"job {job!r} is dealt by its coordinator: its checkpoints' cursors are the coordinator's "
                              f"to compute (a rank may name only an epoch's start, got {show(cursor)}); report "
                              "the rank's progress without one")
    _reachable(state, job, state.generation(job, generation), cursor.epoch)  # its epoch before: all dealt
    return cursor, [], False


def _checkpoint_from_deals(state: State, job: str, generation: int, rank: int, epoch: int, batches: int,
                        lockstep: bool) -> tuple[Cursor, list[Event]]:
    """The cursor of a checkpoint `rank` takes after `batches` batches of its sequence in `epoch`."""
    j = state.jobs[job]
    gen = state.generation(job, generation)
    d = _dealer(state, job, gen, epoch)
    if d is None:  # the epoch just before the generation's fresh start: complete
        assert gen.start is not None
        return gen.start, []
    _reachable(state, job, gen, epoch)
    book = _deals(state, job, epoch)
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
            de = _dealer(state, job, gen, e) if e < epoch else None
            if de is None:
                break
            if earlier.uncommitted():
                return de.checkpoint(earlier, dict(earlier.committed)), events
    return d.checkpoint(book, book.credits(rank, batches, lockstep)), events


def _dealer(state: State, job: str, gen: Generation, epoch: int) -> Dealer | None:
    """The dealer of `epoch`'s plan in `gen` (None for the epoch just before a fresh start: complete).

    Raises:
        OutOfRange: an epoch before the generation's resume point (``plan_epoch``).
        FailedPrecondition: the job's plans are not the coordinator's to deal.
    """
    assert gen.start is not None
    p = plan_epoch(state.jobs[job].dealing_spec, gen.start, gen.world, epoch)
    return None if p is None else kind_of(p.spec).dealer_of(p, job)


def _reachable(state: State, job: str, gen: Generation, epoch: int) -> None:
    """Refuses an epoch a rank of `gen` cannot be in: before its start, or after an epoch whose
    batches were not all dealt yet (a rank goes on to epoch e + 1 only once e has nothing left)."""
    assert gen.start is not None
    if epoch <= gen.start.epoch:
        return
    before = state.jobs[job].deals.get(epoch - 1)
    d = _dealer(state, job, gen, epoch - 1)
    if d is not None and (before is None or before.next < d.batches):
        done = 0 if before is None else before.next
        raise FailedPrecondition(
            f"epoch {epoch} of job {job!r} cannot begin: epoch {epoch - 1} has dealt {done} of its "
            f"{d.batches} batches (a rank reaches the next epoch once nothing is left to deal)"
        )


def _deals(state: State, job: str, epoch: int) -> EpochDeals:
    """The deals of `epoch` in the job's current generation (empty if none yet)."""
    deals = state.jobs[job].deals
    if not kept(deals, epoch):
        raise FailedPrecondition(f"epoch {epoch} of job {job!r} is over: it was left behind once epoch "
                                 f"{max(deals)} began (the coordinator deals in the last {KEEP_EPOCHS})")
    return deals.get(epoch) or EpochDeals()


def decide_deal(state: State, job: str, generation: int, rank: int, epoch: int, first: int,
                count: int) -> tuple[tuple[Runs, bool], list[Event]]:
    """A plan the coordinator deals: what `rank` gets when it asks for batches first .. first +
    count - 1 of its sequence in `epoch`: (the runs of global batches, whether the epoch has no
    batch after them for anyone), and the events of a new deal (none for a repeated ask).

    Raises:
        FailedPrecondition: the job's plans are not the coordinator's to deal, or the epoch
            cannot be dealt yet (or any more).
        OutOfRange: an epoch before the generation's resume point.
    """
    gen = state.generation(job, generation)
    check_int("rank", rank, 0, gen.world, InvalidArgument)
    check_int("epoch", epoch, 0, MAX_COUNT, InvalidArgument)
    d = _dealer(state, job, gen, epoch)
    if d is None:
        return ((), True), []
    _reachable(state, job, gen, epoch)
    book = _deals(state, job, epoch)
    try:
        runs, new = d.deal(book, rank, first, count)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None
    events: list[Event] = [BatchesDealt(job, generation, rank, epoch, g, c) for g, c in runs] if new else []
    return (runs, book.ended(d.batches, runs, new)), events


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


