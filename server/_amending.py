"""A mixture's amendments as the coordinator decides them: recorded, taken back from a checkpoint, held by a generation."""

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


def decide(j: Job, kind: str, values: Sequence[int]) -> Amendment:
    """The amendment a request records for job `j` (pending: it holds from the next generation's first position).

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
            a = amend.skip_of(vals, j.spec.sources, j.amendments)
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


def adopt(req: JoinRequest, job: Job | None) -> list[AmendmentRecorded]:
    """The amendments a join's checkpoint carries that the job has no record of (its store was lost):
    recorded, in the checkpoint's order, after the job's own records.

    Raises:
        InvalidArgument: amendments that cannot belong to the job's spec.
    """
    if not req.amendments:
        return []
    spec = job.spec if job else req.spec
    try:
        spec.amended(req.amendments)
    except ValueError as e:
        raise InvalidArgument(f"the checkpoint's amendments do not fit job {req.job!r}'s spec: {e}") from None
    return [AmendmentRecorded(req.job, a.kind, a.values) for a in amend.minus(req.amendments, job.amendments if job else [])]


def load(req: JoinRequest, job: Job | None, number: int, events: list[Event]) -> tuple[Amendment, ...] | None:
    """The amendments of the checkpoint generation `number`'s resuming ranks loaded (None: none resumed
    yet); a mixture's first resuming rank's are recorded into `events`, none included.

    Raises:
        FailedPrecondition: a resuming rank whose checkpoint's amendments are not the first one's
            (every rank must load the same checkpoint, whichever joins first).
    """
    loaded = job.loaded if job is not None and job.generation is not None and job.generation.number == number else None
    if req.resume is None or req.spec.sources is None:
        return loaded
    if loaded is None:
        events.append(AmendmentsLoaded(req.job, number, req.amendments))
        return req.amendments
    if loaded != req.amendments:
        raise FailedPrecondition(
            f"rank {req.rank} joins generation {number} of job {req.job!r} with a checkpoint whose amendments "
            f"are [{'; '.join(a.describe() for a in req.amendments)}]; another rank's are "
            f"[{'; '.join(a.describe() for a in loaded)}]: every rank must load the same checkpoint")
    return loaded


def start(req: JoinRequest, job: Job | None, number: int, at: Cursor, adopted: Sequence[AmendmentRecorded],
          loaded: tuple[Amendment, ...] | None) -> list[Event]:
    """The event of what generation `number`, starting at `at`, deals with (none when no amendment).

    Raises:
        FailedPrecondition: amendments that leave the job with nothing to deal from there.
    """
    records = [*(job.amendments if job is not None else []), *(Amendment(e.kind, e.values) for e in adopted)]
    try:
        out = held(job.spec if job is not None else req.spec, at, records, loaded or ())
    except ValueError as e:
        raise FailedPrecondition(f"job {req.job!r} cannot start generation {number}: {e}") from None
    return [GenerationAmended(req.job, number, out)] if out else []


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
