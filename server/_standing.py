"""Where a job's ranks stand (epoch, progress, slowest rank, batches behind), as one pure function.

The metrics, the status page and ``croupier status`` all show it. Beside it, what a state read
from a store says a job's current generation was dealt and committed (:func:`generation_deals`).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING

from croupier.core.api import JobStatus, RankCursor

if TYPE_CHECKING:
    from croupier.server._state import State

#: Jobs with a world up to this many ranks get per-rank series and list every rank on the status
#: page; larger jobs only their ranks' min, median and max (and the status page their slowest ranks).
PER_RANK_MAX_WORLD = 256


@dataclasses.dataclass(frozen=True)
class RankView:
    """One rank of a job's current generation, as it last reported.

    Attributes:
        rank: The rank.
        epoch: The epoch it last reported.
        batches: Batches of `epoch` its loop had taken.
        batches_in_epoch: Its batches in `epoch` (its share of the generation's plan).
        progress: ``batches / batches_in_epoch`` in [0, 1] (1 for a share of no batches).
        lag: Batches it is behind the job's furthest rank (see :func:`lag`).
        reported_ms: When it reported, Unix milliseconds on the coordinator's clock.
    """

    rank: int
    epoch: int
    batches: int
    batches_in_epoch: int
    progress: float
    lag: int
    reported_ms: int


@dataclasses.dataclass(frozen=True)
class JobView:
    """One job at a glance.

    Attributes:
        name: The job's name.
        generation: Its current generation.
        world: That generation's world size.
        started: Every rank of the generation joined (the generation serves batches).
        waiting_for: Ranks the generation still waits for.
        epoch: The job's epoch: the highest any rank of the generation reported (None before
            any report).
        done: Batches of `epoch` taken by the ranks in it (0 before any report).
        total: Batches those ranks have in `epoch` (0 before any report).
        progress: The fraction of `epoch` done by the ranks in it, ``done / total`` in [0, 1] (0
            before any report).
        reported: Ranks that have reported.
        ranks: The ranks that reported, by rank; for a world above :data:`PER_RANK_MAX_WORLD`
            only the :data:`PER_RANK_MAX_WORLD` slowest.
        lag: (min, median, max) of the reported ranks' lags, or None before any report.
        slowest: The rank with the fewest batches in the lowest epoch reported (the lowest such
            rank), or None before any report.
        report_ms: (oldest, median, latest) of the reported ranks' last reports, Unix
            milliseconds, or None before any report.
        last_ms: The latest report or checkpoint record, Unix milliseconds, or None.
    """

    name: str
    generation: int
    world: int
    started: bool
    waiting_for: int
    epoch: int | None
    done: int
    total: int
    progress: float
    reported: int
    ranks: tuple[RankView, ...]
    lag: tuple[int, float, int] | None
    slowest: RankView | None
    report_ms: tuple[int, float, int] | None
    last_ms: int | None


def _fraction(done: int, total: int) -> float:
    return 1.0 if total <= 0 else min(1.0, done / total)


def lag(c: RankCursor, lead: RankCursor) -> int:
    """Batches rank `c` is behind `lead`, the rank furthest ahead (highest epoch, then batches).

    In the same epoch, the difference of their batches; from an earlier epoch, what `c` has left
    of its epoch, its share of every epoch in between, and the batches `lead` took of its epoch.
    The epochs in between count as `c`'s share of its own epoch: exact for fixed batches once `c`
    is past the generation's first epoch (a resumed first epoch is shorter), an estimate for
    token budgets (each epoch packs its own number of batches) and dynamic dealing (where the
    share is what the rank was dealt so far). ``croupier status`` counts its "batches behind"
    the same way.
    """
    if c.epoch == lead.epoch:
        return max(0, lead.batches - c.batches)
    return (c.batches_in_epoch - c.batches) + (lead.epoch - c.epoch - 1) * c.batches_in_epoch + lead.batches


def job_view(name: str, status: JobStatus) -> JobView:
    """Summarises `status`: the job's epoch, its progress through it, and each rank's :func:`lag`."""
    cursors: tuple[RankCursor, ...] = status.ranks
    world = status.result.world
    epoch = max((c.epoch for c in cursors), default=None)
    current = [c for c in cursors if c.epoch == epoch]
    done, total = sum(c.batches for c in current), sum(c.batches_in_epoch for c in current)
    lead = max(cursors, key=lambda c: (c.epoch, c.batches, -c.rank), default=None)
    ranks = () if lead is None else tuple(
        RankView(c.rank, c.epoch, c.batches, c.batches_in_epoch, _fraction(c.batches, c.batches_in_epoch), lag(c, lead),
                 c.reported_ms) for c in cursors)
    slowest = min(ranks, key=lambda r: (r.epoch, r.batches, r.rank), default=None)
    shown = ranks
    if world > PER_RANK_MAX_WORLD:
        shown = tuple(sorted(sorted(ranks, key=lambda r: (r.epoch, r.batches, r.rank))[:PER_RANK_MAX_WORLD],
                             key=lambda r: r.rank))
    lags = [r.lag for r in ranks]
    times = [c.reported_ms for c in cursors]
    activity = times + [c.recorded_ms for c in status.checkpoints]
    return JobView(
        name=name, generation=status.result.generation, world=world, started=status.result.start is not None,
        waiting_for=status.result.waiting_count, epoch=epoch, done=done, total=total,
        progress=min(1.0, done / total) if total else 0.0,
        reported=len(ranks), ranks=shown,
        lag=(min(lags), float(statistics.median(lags)), max(lags)) if lags else None,
        slowest=slowest, report_ms=(min(times), float(statistics.median(times)), max(times)) if times else None,
        last_ms=max(activity, default=None),
    )


def view_json(v: JobView, now_ms: int) -> dict[str, object]:
    """`v` as the status page's JSON (``/api/jobs``), with ages in seconds as of `now_ms`."""

    def age(ms: int | None) -> float | None:
        return None if ms is None else max(0.0, (now_ms - ms) / 1000.0)

    return {
        "name": v.name, "generation": v.generation, "world": v.world, "started": v.started, "waiting_for": v.waiting_for,
        "epoch": v.epoch, "progress": v.progress, "reported": v.reported,
        "lag": None if v.lag is None else {"min": v.lag[0], "median": v.lag[1], "max": v.lag[2]},
        "slowest": None if v.slowest is None else {"rank": v.slowest.rank, "lag": v.slowest.lag},
        "last_activity_age_s": age(v.last_ms),
        "ranks": [{"rank": r.rank, "epoch": r.epoch, "batches": r.batches, "batches_in_epoch": r.batches_in_epoch,
                   "progress": r.progress, "lag": r.lag, "report_age_s": age(r.reported_ms)} for r in v.ranks],
    }


@dataclasses.dataclass(frozen=True)
class GenerationDeals:
    """What a job's current generation was dealt and committed in one epoch of a plan the coordinator
    deals (dynamic dealing), as a state holds it: a copy, read-only.

    Attributes:
        incarnation: The generation's incarnation.
        generation: Its number.
        world: Its world size.
        dealt: Rank -> batches the coordinator dealt it in the epoch (ranks dealt none are absent).
        committed: Rank -> batches of its sequence it committed in the epoch (ranks that committed
            none are absent).
    """

    incarnation: str
    generation: int
    world: int
    dealt: dict[int, int]
    committed: dict[int, int]


def generation_deals(state: State, job: str, epoch: int) -> GenerationDeals | None:
    """What `job`'s current generation was dealt and committed in `epoch`, read from `state` (a state
    recovered or read from a store, e.g. :func:`croupier.server.read_journal`'s snapshot).

    The public way for tools to read deals out of a state: the state is not changed, and the
    answer shares nothing with it.

    Returns:
        None when the state holds no such job or the job has no generation yet; else the
        generation with its deals (empty when it was dealt nothing in `epoch`, or its plan is not
        one the coordinator deals).
    """
    j = state.jobs.get(job)
    if j is None or j.generation is None:
        return None
    g = j.generation
    book = j.deals.get(epoch)
    dealt = {r: book.dealt(r) for r in sorted(book.runs)} if book is not None else {}
    committed = dict(sorted(book.committed.items())) if book is not None else {}
    return GenerationDeals(g.incarnation, g.number, g.world, dealt, committed)
