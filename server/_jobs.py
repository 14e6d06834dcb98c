"""A job as the coordinator's state holds it (Job, Generation), and the form a snapshot writes it in.

A snapshot (:meth:`~croupier.server._state.State.snapshot`) is ``{"version", "order", "jobs"}``
with one map per job, made by :func:`snapshot_job` and read back by :func:`restore_job`, whose
values are written and read with the journal's own codecs (``croupier.server._events``).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping
from typing import Any

from croupier.core.amend import Amendment, minus
from croupier.core.api import CheckpointRecord, JoinRequest
from croupier.core.cursor import Cursor, epoch_agrees, show
from croupier.core.deals import EpochDeals, answered
from croupier.core.errors import FailedPrecondition
from croupier.core.ftsteps import StepRun, Steps
from croupier.core.ledger import Segment
from croupier.core.schedule import Schedule
from croupier.core.spec import Spec
from croupier.server._events import (
    AMENDMENTS,
    CURSOR,
    INT,
    OPT_AMENDMENTS,
    OPT_CURSOR,
    OPT_INT,
    OPT_INTS,
    SPEC,
    STR,
    FormatError,
    as_list,
    as_map,
    cursor_to,
)
from croupier.server._ledger import segment_from

#: How many of the ranks a generation waits for a join's answer names (the count is always given).
WAITING_SHOWN = 16


@dataclasses.dataclass
class Agreement:
    """What the ranks joined so far say, in O(1) space: the first resume point and the rank that sent it
    (every rank's must equal it), and each distinct set_epoch hint with the first rank that sent it."""

    resume: tuple[int, Cursor] | None = None
    hints: dict[int, int] = dataclasses.field(default_factory=dict)  # epoch -> first rank

    def add(self, rank: int, resume: Cursor | None, epoch: int | None) -> None:
        if resume is not None and self.resume is None:
            self.resume = (rank, resume)
        if epoch is not None:
            self.hints.setdefault(epoch, rank)

    def check(self, req: JoinRequest, number: int) -> None:
        """Refuses a join to generation `number` whose resume point or epoch contradicts a rank already joined."""
        where = f"generation {number} of job {req.job!r}"
        if req.resume is not None and req.epoch is not None and not epoch_agrees(req.spec, req.resume, req.epoch):
            raise FailedPrecondition(
                f"rank {req.rank} resumes {where} from {show(req.resume)}, which contradicts its own set_epoch({req.epoch})"
            )
        if req.resume is not None:
            if self.resume is not None and self.resume[1] != req.resume:
                r, c = self.resume
                raise FailedPrecondition(
                    f"rank {req.rank} resumes {where} from {show(req.resume)}, but rank {r} resumes "
                    f"from {show(c)}: every rank must load the same checkpoint"
                )
            for e, r in self.hints.items():
                if not epoch_agrees(req.spec, req.resume, e):
                    raise FailedPrecondition(
                        f"rank {req.rank} resumes {where} from {show(req.resume)}, which contradicts "
                        f"set_epoch({e}) on rank {r}"
                    )
        if req.epoch is not None:
            if self.resume is not None:
                r, c = self.resume
                if not epoch_agrees(req.spec, c, req.epoch):
                    raise FailedPrecondition(
                        f"set_epoch({req.epoch}) on rank {req.rank} contradicts the checkpoint rank {r} "
                        f"resumes {where} from: {show(c)}"
                    )
            elif req.resume is None:
                for e, r in self.hints.items():
                    if e != req.epoch:
                        raise FailedPrecondition(
                            f"set_epoch({req.epoch}) on rank {req.rank} disagrees with set_epoch({e}) on rank {r} in {where}"
                        )


@dataclasses.dataclass
class Generation:
    """One incarnation of a job's world.

    NOTE: a join must not cost O(world): a world of 16,384 ranks joins in one storm. The ranks not
    joined yet (sorted) and what the joined ones agree on are kept beside ``joined``, made from it
    on first use (a snapshot holds ``joined`` only) and kept up to date by :meth:`add`.
    """

    number: int
    world: int
    incarnation: str
    joined: dict[int, tuple[Cursor | None, int | None]] = dataclasses.field(default_factory=dict)
    start: Cursor | None = None
    #: what the first rank that resumed says of its checkpoint (rank, step, parent generation), and the
    #: first rank's step schedule (rank, schedule): every other rank must say the same
    resumed: tuple[int, int | None, int | None] | None = None
    schedule: tuple[int, tuple[int, ...] | None] | None = None
    _missing: list[int] | None = dataclasses.field(default=None, repr=False, compare=False)
    _agreement: Agreement | None = dataclasses.field(default=None, repr=False, compare=False)

    def add(self, rank: int, resume: Cursor | None, epoch: int | None) -> None:
        """Rank `rank` joined with its resume point and set_epoch hint."""
        self.joined[rank] = (resume, epoch)
        if self._missing is not None:
            i = bisect.bisect_left(self._missing, rank)
            if i < len(self._missing) and self._missing[i] == rank:
                del self._missing[i]
        if self._agreement is not None:
            self._agreement.add(rank, resume, epoch)

    @property
    def agreement(self) -> Agreement:
        if self._agreement is None:
            self._agreement = Agreement()
            for r, (c, e) in self.joined.items():
                self._agreement.add(r, c, e)
        return self._agreement

    def waiting(self) -> int:
        """How many ranks have not joined yet (0 once started)."""
        return 0 if self.start is not None else self.world - len(self.joined)

    def waiting_for(self) -> tuple[int, ...]:
        """The first ranks not joined yet, at most WAITING_SHOWN of them (none once started)."""
        if self.start is not None:
            return ()
        if self._missing is None:
            self._missing = [r for r in range(self.world) if r not in self.joined]
        return tuple(self._missing[:WAITING_SHOWN])


@dataclasses.dataclass
class Job:
    """A job: its spec, its current generation, every incarnation that ever opened one, its checkpoint
    records, a mixture's amendments, and its history (the ledger's segments, or a fault-tolerant job's
    step runs).

    NOTE: what a generation did has one owner, its segment (``croupier.core.segments.Segment``): the
    ranks' last reports, what the coordinator dealt and they committed, the amendments it holds. The
    job reads its current generation's through :attr:`segment` (``progress``, ``deals``, ``held``) and
    keeps no copy: a copy was written beside each of them once, and the two could disagree after a
    replay. The segment, not the job, owns them because it outlives its generation (the step ledger
    reads every generation's), while the job's view is of the current one alone. The checkpoint
    records are the job's: they outlive a generation's replacement, and a rollback prunes them.
    """

    name: str
    spec: Spec
    generation: Generation | None = None
    incarnations: list[str] = dataclasses.field(default_factory=list)
    #: the checkpoints the job took, oldest first, at most CHECKPOINT_HISTORY
    checkpoints: list[CheckpointRecord] = dataclasses.field(default_factory=list)
    #: a mixture's amendments in the order recorded (``at`` None: each generation holds them from a position)
    amendments: list[Amendment] = dataclasses.field(default_factory=list)
    #: the amendments of the checkpoint the current generation's ranks joined with (None: none yet)
    loaded: tuple[Amendment, ...] | None = None
    #: the step ledger: one segment per generation that started, oldest first (``croupier.server._ledger``)
    ledger: list[Segment] = dataclasses.field(default_factory=list)
    #: a fault-tolerant job's committed steps, per run (``croupier.core.ftsteps``)
    steps: Steps = dataclasses.field(default_factory=Steps)

    @property
    def segment(self) -> Segment | None:
        """The current generation's segment, once it started (None before: it has done nothing yet)."""
        g = self.generation
        if g is None or g.start is None or not self.ledger or self.ledger[-1].generation != g.number:
            return None
        return self.ledger[-1]

    @property
    def progress(self) -> Mapping[int, tuple[int, int, int]]:
        """rank -> (epoch, batches, at_ms): the current generation's ranks, as last reported."""
        seg = self.segment
        return {} if seg is None else seg.ranks

    @property
    def deals(self) -> dict[int, EpochDeals]:
        """A plan the coordinator deals: epoch -> what the current generation dealt in it, for the epochs the
        coordinator still answers for (``croupier.core.deals.answered``)."""
        seg = self.segment
        return {} if seg is None else answered(seg.deals)

    @property
    def held(self) -> tuple[Amendment, ...]:
        """The amendments the current generation deals with, each with its position (set when it starts)."""
        seg = self.segment
        return () if seg is None else seg.amendments

    @property
    def dealing_spec(self) -> Spec:
        """The spec the current generation's orders are computed from: the job's, under the amendments it holds."""
        return self.spec.amended(self.held) if self.held else self.spec

    @property
    def pending(self) -> tuple[Amendment, ...]:
        """The amendments recorded that the current generation does not hold (the next one will)."""
        return tuple(minus(self.amendments, self.held))


def snapshot_job(j: Job) -> dict[str, Any]:
    """One job as a snapshot of the current format writes it (a plain, msgpack-able map).

    NOTE: the incarnations are stored under the keys ``"tokens"`` (the job's) and ``"token"`` (its
    generation's), their names when the snapshot format was set: a rename of the fields must not
    change the snapshots on disk, so the keys stay.
    """
    g = j.generation
    gd = None
    if g is not None:
        gd = {
            "number": g.number,
            "world": g.world,
            "token": g.incarnation,
            "joined": [[r, cursor_to(c), e] for r, (c, e) in sorted(g.joined.items())],
            "start": cursor_to(g.start),
            "steps": [None if g.resumed is None else list(g.resumed),
                      None if g.schedule is None else [g.schedule[0], OPT_INTS.encode(g.schedule[1])]],
        }
    return {
        "name": j.name, "spec": SPEC.encode(j.spec), "generation": gd, "tokens": list(j.incarnations),
        "progress": [[r, e, b, t] for r, (e, b, t) in sorted(j.progress.items())],
        "checkpoints": [[c.step, cursor_to(c.cursor), c.origin, c.generation, c.rank, c.recorded_ms,
                         AMENDMENTS.encode(c.amendments), c.items] for c in j.checkpoints],
        "deals": [[e, b.next, [[r, [list(x) for x in runs]] for r, runs in sorted(b.runs.items())],
                   [[r, k] for r, k in sorted(b.committed.items())]] for e, b in sorted(j.deals.items())],
        "amendments": AMENDMENTS.encode(tuple(j.amendments)), "held": AMENDMENTS.encode(j.held),
        "loaded": OPT_AMENDMENTS.encode(j.loaded), "ledger": [seg.to_dict() for seg in j.ledger],
        "steps": [r.to_dict() for r in j.steps.runs],
    }


def restore_job(what: str, v: Any, version: int) -> Job:
    """One job of a snapshot of format `version`, read back (a version 2 job has no progress and
    no checkpoints, a version 3 job no deals, a version 4 job no amendments, its checkpoint
    records none either, a version 5 job no ledger, its checkpoint records no items).

    Raises:
        FormatError: `v` is not what :func:`snapshot_job` (of that version) writes; the message
            starts with `what` and names the field.
    """
    later = ((["progress", "checkpoints"] if version >= 3 else []) + (["deals"] if version >= 4 else [])
             + (["amendments", "held", "loaded"] if version >= 5 else []) + (["ledger"] if version >= 6 else [])
             + (["steps"] if version >= 7 else []))
    jd = as_map(what, v, ["name", "spec", "generation", "tokens", *later])
    name = STR.decode(f"{what} name", jd["name"])
    incarnations = [STR.decode(f"{what} token {k}", t) for k, t in enumerate(as_list(f"{what} tokens", jd["tokens"]))]
    job = Job(name, SPEC.decode(f"{what} spec", jd["spec"]), None, incarnations)
    progress: dict[int, tuple[int, int, int]] = {}
    for k, entry in enumerate(as_list(f"{what} progress", jd.get("progress", []))):
        r, e, b, t = (INT.decode(f"{what} progress entry {k}", x) for x in as_list(f"{what} progress entry {k}", entry, 4))
        progress[r] = (e, b, t)
    for k, entry in enumerate(as_list(f"{what} checkpoints", jd.get("checkpoints", []))):
        w = f"{what} checkpoint {k}"
        items = None
        if version >= 6:
            step, cursor, origin, gen, rank, t, held, items = as_list(
                f"{w} ([step, cursor, origin, generation, rank, ms, amendments, items])", entry, 8)
        elif version >= 5:
            step, cursor, origin, gen, rank, t, held = as_list(
                f"{w} ([step, cursor, origin, generation, rank, ms, amendments])", entry, 7)
        else:
            (step, cursor, origin, gen, rank, t), held = as_list(
                f"{w} ([step, cursor, origin, generation, rank, ms])", entry, 6), []
        job.checkpoints.append(CheckpointRecord(
            OPT_INT.decode(f"{w} step", step), CURSOR.decode(f"{w} cursor", cursor), STR.decode(f"{w} origin", origin),
            INT.decode(f"{w} generation", gen), INT.decode(f"{w} rank", rank), INT.decode(f"{w} time", t),
            AMENDMENTS.decode(f"{w} amendments", held), OPT_INT.decode(f"{w} items", items)))
    deals = dict(_restore_deals(f"{what} deals {k}", entry)
                 for k, entry in enumerate(as_list(f"{what} deals", jd.get("deals", []))))
    job.amendments = list(AMENDMENTS.decode(f"{what} amendments", jd.get("amendments", [])))
    holding = AMENDMENTS.decode(f"{what} held", jd.get("held", []))
    job.loaded = OPT_AMENDMENTS.decode(f"{what} loaded", jd.get("loaded"))
    job.ledger = [segment_from(f"{what} ledger segment {k}", v)
                  for k, v in enumerate(as_list(f"{what} ledger", jd.get("ledger", [])))]
    job.steps = Steps([_step_run(f"{what} step run {k}", v)
                       for k, v in enumerate(as_list(f"{what} steps", jd.get("steps", [])))])
    if jd["generation"] is not None:
        job.generation = _restore_generation(f"{what} ({name!r}) generation", jd["generation"], version)
    _current_from(what, job, progress, deals, holding)
    return job


def _current_from(what: str, job: Job, progress: dict[int, tuple[int, int, int]], deals: dict[int, EpochDeals],
                  held: tuple[Amendment, ...]) -> None:
    """A snapshot's current generation's facts (its job's ``progress``, ``deals`` and ``held``), read into the
    generation's segment, their one owner.

    A generation that started before the ledger existed (a snapshot of format 5 or older, or a state
    restored from one) has no segment: it gets one here from the generation (its step unknown when a rank
    resumed it, as that format did not record it). The segment's own deals and amendments, where it has
    them, are the same facts as the job's; the job's add the ranks' ``own`` commits.

    Raises:
        FormatError: facts of a generation that did not start.
    """
    g = job.generation
    if g is not None and g.start is not None and job.segment is None:
        resumed = any(c is not None for c, _ in g.joined.values())
        step, parent = (g.resumed[1], g.resumed[2]) if g.resumed is not None else (None if resumed else 0, None)
        sched = None if g.schedule is None else g.schedule[1]
        job.ledger.append(Segment(g.number, g.incarnation, g.world, g.start, step, parent,
                                  Schedule() if sched is None else Schedule.from_list(sched), held))
    seg = job.segment
    if seg is None:
        if progress or deals or held:
            raise FormatError(f"{what}: progress, deals or held amendments of a generation that did not start")
        return
    seg.ranks.update(progress)
    for e, book in deals.items():
        mine = seg.deals.setdefault(e, EpochDeals())
        if not mine.runs:
            for r, runs in book.runs.items():
                for first, count in runs:
                    mine.deal(r, first, count)
        for r, k in book.committed.items():
            mine.commit(r, k)


def _step_run(what: str, v: Any) -> StepRun:
    try:
        return StepRun.from_dict(v)
    except (ValueError, TypeError) as e:
        raise FormatError(f"{what}: {e}") from None


def _restore_deals(w: str, entry: Any) -> tuple[int, EpochDeals]:
    """One epoch's ``[epoch, next, runs, committed]`` of a snapshot's deals."""
    epoch, nxt, runs, committed = as_list(f"{w} ([epoch, next, runs, committed])", entry, 4)
    book = EpochDeals(INT.decode(f"{w} next", nxt))
    for rr in as_list(f"{w} runs", runs):
        r, rl = as_list(f"{w} rank runs", rr, 2)
        book.runs[INT.decode(f"{w} rank", r)] = [
            (INT.decode(f"{w} run", x[0]), INT.decode(f"{w} run", x[1]))
            for x in (as_list(f"{w} run", y, 2) for y in as_list(f"{w} runs of {r}", rl))]
    for cc in as_list(f"{w} committed", committed):
        r, b = as_list(f"{w} committed entry", cc, 2)
        book.committed[INT.decode(f"{w} rank", r)] = INT.decode(f"{w} batches", b)
    return INT.decode(f"{w} epoch", epoch), book


def _restore_generation(where: str, v: Any, version: int) -> Generation:
    """A snapshot's generation map, read back."""
    g = as_map(where, v, ["number", "world", "token", "joined", "start", *(["steps"] if version >= 6 else [])])
    joined: dict[int, tuple[Cursor | None, int | None]] = {}
    for k, entry in enumerate(as_list(f"{where} joined", g["joined"])):
        rank, resume, epoch = as_list(f"{where} joined entry {k} ([rank, resume, epoch])", entry, 3)
        joined[INT.decode(f"{where} joined rank", rank)] = (
            OPT_CURSOR.decode(f"{where} rank {rank} resume", resume),
            OPT_INT.decode(f"{where} rank {rank} epoch", epoch),
        )
    out = Generation(
        INT.decode(f"{where} number", g["number"]),
        INT.decode(f"{where} world", g["world"]),
        STR.decode(f"{where} token", g["token"]),
        joined,
        OPT_CURSOR.decode(f"{where} start", g["start"]),
    )
    resumed, schedule = as_list(f"{where} steps", g.get("steps", [None, None]), 2)
    if resumed is not None:
        r, step, parent = as_list(f"{where} steps resumed", resumed, 3)
        out.resumed = (INT.decode(f"{where} steps rank", r), OPT_INT.decode(f"{where} steps step", step),
                       OPT_INT.decode(f"{where} steps parent", parent))
    if schedule is not None:
        r, sched = as_list(f"{where} steps schedule", schedule, 2)
        out.schedule = (INT.decode(f"{where} schedule rank", r), OPT_INTS.decode(f"{where} schedule", sched))
    return out
