"""A mixture's amendments as the coordinator decides them: recorded, settled in one step of a join, held by a generation."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from croupier.core import amend
from croupier.core.amend import Amendment
from croupier.core.api import JoinRequest
from croupier.core.cursor import Cursor, is_fresh
from croupier.core.errors import FailedPrecondition, InvalidArgument
from croupier.core.mixture import PARTS
from croupier.core.spec import MAX_N, Spec
from croupier.server._events import AmendmentRecorded, AmendmentsLoaded, Event, GenerationAmended
from croupier.server._jobs import Job


def numbering(j: Job) -> tuple[int, ...]:
    """The sources' sizes that number the dataset indices a skip names: as job `j`'s ranks hand them out.

    NOTE: indices are numbered as a ``ConcatDataset`` of the sources numbers them once the grows the
    current generation holds took effect: a grow recorded since is pending and renumbers nothing until
    the next generation starts, so a skip names the sample the ranks handed out at that index, whatever
    order grows and skips come in. A generation still waiting for its ranks hands out indices numbered
    by every grow recorded (it holds them all from its start).
    """
    assert j.spec.sources is not None
    gen = j.generation
    return amend.sizes_after(j.spec.sources, j.held if gen is not None and gen.start is not None else j.amendments)


def decide(j: Job, kind: str, values: Sequence[int]) -> Amendment:
    """The amendment a request records for job `j` (pending: it holds from the next generation's first position).

    Args:
        j: The job.
        kind: ``"weights"``, ``"grow"`` or ``"skip"``.
        values: A weights' parts, a grow's (source, new size), or a skip's dataset indices, numbered
            as the job's ranks hand them out (:func:`numbering`).

    Raises:
        FailedPrecondition: a job that deals no mixture, or a grow of a spec with lengths.
        InvalidArgument: values that do not make such an amendment (the message names them).
    """
    if j.spec.sources is None:
        raise FailedPrecondition(f"job {j.name!r} deals one dataset, not a mixture of sources: new weights, grown "
                                 "sources and skipped samples are changes of a mixture (sources=)")
    vals = tuple(values)
    if len(vals) > amend.MAX_SKIP:
        raise InvalidArgument(f"an amendment names at most {amend.MAX_SKIP} values (got {len(vals)})")
    try:
        if kind == "grow":
            if j.spec.lengths is not None:
                raise FailedPrecondition(f"job {j.name!r} has lengths= (token budgets or buckets): a grown source "
                                         "would need the lengths of its new samples, which a spec cannot take")
            if len(vals) != 2:
                raise ValueError(f"grow takes (source, new size) (got {list(vals)})")
            now = amend.sizes_after(j.spec.sources, j.amendments)
            if not 0 <= vals[0] < len(now):
                raise ValueError(f"source {vals[0]} is not one of the job's {len(now)} sources")
            a = Amendment("grow", (vals[0], now[vals[0]], vals[1]))
            if sum(now) - now[vals[0]] + vals[1] > MAX_N:
                raise ValueError(f"the sources would add up to more than {MAX_N} samples")
        elif kind == "skip":
            a = amend.skip_of(vals, j.spec.sources, j.amendments, numbering(j))
        else:
            a = Amendment(kind, vals)
        amend.check(j.spec.sources, j.amendments, a, PARTS)
        # NOTE: where it will hold is decided when the next generation starts; checked here from
        # where the job is now, a schedule or caps it leaves with nothing to deal are refused.
        gen = j.generation
        held(j.spec, gen.start if gen is not None else None, [*j.amendments, a], j.held)
    except ValueError as e:
        raise InvalidArgument(f"job {j.name!r}: {e}") from None
    return a


def settle_join(req: JoinRequest, job: Job | None, number: int, start: Cursor | None) -> list[Event]:
    """The amendment events of a rank's join of generation `number`, in the order they apply.

    One step of the join, after the rank is in (and, when it was the last, the generation started):

    1. the amendments its checkpoint carries that the job has no record of (its store was lost),
       recorded in the checkpoint's order after the job's own;
    2. for a mixture's first resuming rank, the checkpoint's amendments, loaded by the generation
       (every later resuming rank must carry the same);
    3. when `start` is given (this join starts the generation there), what the generation holds:
       the loaded amendments, then every other one recorded, from its first position on.

    Args:
        req: The join (its spec the job's).
        job: The job as it stands before the join (None: the join registers it).
        number: The generation the rank joins.
        start: The generation's resume point when this join starts it, else None.

    Raises:
        InvalidArgument: a checkpoint's amendments that cannot belong to the job's spec.
        FailedPrecondition: a resuming rank whose checkpoint's amendments are not the first one's, or
            amendments that leave the job with nothing to deal from `start`.
    """
    spec = job.spec if job is not None else req.spec
    recorded = list(job.amendments) if job is not None else []
    events: list[Event] = []
    if req.amendments:
        try:
            spec.amended(req.amendments)
        except ValueError as e:
            raise InvalidArgument(f"the checkpoint's amendments do not fit job {req.job!r}'s spec: {e}") from None
        adopted = amend.minus(req.amendments, recorded)
        events += [AmendmentRecorded(req.job, a.kind, a.values) for a in adopted]
        recorded += [Amendment(a.kind, a.values) for a in adopted]
    same = job is not None and job.generation is not None and job.generation.number == number
    loaded = job.loaded if same and job is not None else None
    if req.resume is not None and req.spec.sources is not None:
        if loaded is None:
            loaded = req.amendments
            events.append(AmendmentsLoaded(req.job, number, loaded))
        elif loaded != req.amendments:
            raise FailedPrecondition(
                f"rank {req.rank} joins generation {number} of job {req.job!r} with a checkpoint whose amendments "
                f"are [{'; '.join(a.describe() for a in req.amendments)}]; another rank's are "
                f"[{'; '.join(a.describe() for a in loaded)}]: every rank must load the same checkpoint")
    if start is not None:
        try:
            out = held(spec, start, recorded, loaded or ())
        except ValueError as e:
            raise FailedPrecondition(f"job {req.job!r} cannot start generation {number}: {e}") from None
        if out:
            events.append(GenerationAmended(req.job, number, out))
    return events


def frontier(spec: Spec, start: Cursor | None) -> int:
    """The first stream position past every one the resume point `start` says was consumed (0 for none)."""
    if start is None:
        return 0
    n = spec.n
    last = start.remaining[-1]
    if last[1] < n:
        return start.epoch * n + n
    # NOTE: with tail="pad_last" every pad is a copy of the epoch's last position (n - 1). Once the epoch
    # has begun, a generation whose ranks could not share what was left evenly may have dealt it as a
    # pad, by the rules of then; an amendment must not deal that position otherwise (the pad would be
    # a sample the epoch does not hold), so it holds from the next epoch.
    if spec.tail == "pad_last" and not is_fresh(spec, start):
        return start.epoch * n + n
    return start.epoch * n + last[0]


def held(spec: Spec, start: Cursor | None, records: Sequence[Amendment],
         loaded: Sequence[Amendment]) -> tuple[Amendment, ...]:
    """The amendments a generation starting at `start` deals with, each with its position.

    NOTE: the checkpoint it resumed from names the amendments (`loaded`) every position before its
    resume point was dealt with (its timeline's); every other amendment the job recorded (pending
    ones, and those that held in a timeline a rollback abandoned) holds from this generation's first
    position on, past everything consumed. So any checkpoint, from any timeline, resumes by the
    rules its positions had.

    Raises:
        ValueError: amendments that leave the job with nothing to deal from there.
    """
    if not records and not loaded:
        return ()
    at = max([frontier(spec, start), *(a.at for a in loaded if a.at is not None)])
    out = (*loaded, *(dataclasses.replace(a, at=at) for a in amend.minus(records, loaded)))
    try:
        spec.amended(out)
    except ValueError as e:
        raise ValueError(f"its amendments, held from stream position {at}, leave it with nothing to deal ({e})") from None
    return out
