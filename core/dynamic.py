"""Dynamic dealing: the coordinator hands the next batches of an epoch to whichever rank asks.

Vocabulary (``spec.dealing == "dynamic"``):
    global batch -- batch g of a generation's epoch: virtual positions [g * B, (g + 1) * B) of
                    the generation's remaining positions laid end to end (the last one shorter),
                    i.e. batch g of rank 0 of the one-rank plan; B is the spec's batch_size.
    deal         -- the coordinator gives a rank the next global batches not yet given to anyone;
                    a rank's *sequence* is the global batches it was dealt, in the order it got
                    them. Deals are journaled before they are answered, so no global batch is
                    ever dealt twice, across coordinator crashes too.
    credit       -- how many batches of its sequence a rank has trained on, as a checkpoint
                    counts them. The positions of a checkpoint are the generation's remaining
                    positions minus every rank's credited batches: small (the batches in flight
                    make a few intervals) and topology-free, so any world size resumes them.

The coordinator records the deals and commits in its deal book (``croupier.core.deals``, the same
for every plan it deals) and asks this plan, its own dealer, for the rest.

Two meanings of a checkpoint, chosen by the rank that takes it:
    lockstep -- (data-parallel training) ranks step together, so at a checkpoint every rank has
                trained on as many batches as the rank taking it: each is credited with that
                count, capped by what it was dealt (a rank that ran out, as under DDP's ``Join``,
                trained on all it was dealt).
    own      -- (independent workers: inference, preprocessing) each rank commits its own
                progress; a checkpoint credits the committing rank with its count and every
                other rank with its last commit. The job's latest record is then the union of
                all commits, and a restarted job resumes from it.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from croupier.core.checks import check_int
from croupier.core.cursor import Cursor, fresh, merge_intervals, validate_cursor
from croupier.core.deals import EpochDeals
from croupier.core.order import FixedPlan, fixed_plan
from croupier.core.plan import DealtPlan, Grant, Runs
from croupier.core.spec import Spec


def _lease(p: FixedPlan, runs: Runs) -> tuple[np.ndarray, list[int]]:
    """The dataset indices of the global batches in `runs`, laid end to end, and each batch's size."""
    parts: list[np.ndarray] = []
    sizes: list[int] = []
    for g, c in runs:
        idx, s = p.lease(0, g, c)
        parts.append(idx)
        sizes += s
    return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)), sizes


@dataclasses.dataclass(frozen=True)
class DynamicPlan(DealtPlan):
    """An :class:`croupier.core.plan.EpochPlan` the coordinator deals: a rank's steps are the
    global batches dealt to it as it asks (see the module).

    It is its own :class:`croupier.core.plan.Dealer`. Its grants need the coordinator's deal, its
    leases the grant's runs, and its checkpoints are computed from the coordinator's deals
    (:meth:`checkpoint`), never by :meth:`advance`. ``steps`` and ``samples`` are estimates: a
    rank's even share of what is left.
    """

    spec: Spec
    cursor: Cursor
    world: int

    @property
    def global_plan(self) -> FixedPlan:
        """The one-rank plan whose batches are the epoch's global batches."""
        return _global_plan(self.spec, self.cursor)

    # ---------------------------------------------------------------- the coordinator's side (Dealer)

    @property
    def batches(self) -> int:
        """How many global batches the epoch has."""
        return int(self.global_plan.nb_r[0])

    def deal(self, book: EpochDeals, rank: int, first: int, count: int) -> tuple[Runs, bool]:
        """The next global batches not dealt yet, in order (see :meth:`EpochDeals.answer`)."""
        return book.answer(self.batches, rank, first, count)

    def checkpoint(self, book: EpochDeals, credited: dict[int, int]) -> Cursor:
        """The epoch's remaining positions minus the global batches each rank is credited with."""
        b, left = self.spec.batch_size, self.left
        taken = merge_intervals([(g * b, min((g + c) * b, left)) for g, c in book.taken(credited)])
        gaps: list[tuple[int, int]] = []
        at = 0
        for a, e in taken:
            if at < a:
                gaps.append((at, a))
            at = max(at, e)
        if at < left:
            gaps.append((at, left))
        if not gaps:
            return fresh(self.spec, self.cursor.epoch + 1)
        out = dataclasses.replace(self.cursor, remaining=self.global_plan._map(gaps))
        validate_cursor(self.spec, out)
        return out

    # ---------------------------------------------------------------- the ranks' side (EpochPlan)


    def grant(self, rank: int, first: int, count: int, dealt: tuple[Runs, bool] | None = None) -> Grant:
        """The grant of the coordinator's deal `dealt` (runs, whether nothing is left after them)."""
        if dealt is None:
            raise ValueError("a dynamic plan grants what the coordinator dealt: pass dealt=(runs, end)")
        runs, end = dealt
        if not runs:
            return Grant(0, 0, end, 0)
        last = self.global_plan.share(0, runs[-1][0] + runs[-1][1] - 1, 1)[1]
        return Grant(sum(c for _, c in runs), last, end, 0, tuple(runs))

    def lease(self, rank: int, first: int, count: int, grant: Grant | None = None) -> tuple[np.ndarray, list[int]]:
        """The indices of the global batches `grant` names."""
        if grant is None:
            raise ValueError("a dynamic plan's batches are the coordinator's to deal: a lease needs its grant")
        return _lease(self.global_plan, grant.runs)

    def lease_positions(self, rank: int, first: int, count: int, grant: Grant | None = None) -> np.ndarray:
        """The order positions of the global batches `grant` names."""
        if grant is None:
            raise ValueError("a dynamic plan's batches are the coordinator's to deal: a lease needs its grant")
        parts = [self.global_plan.lease_positions(0, g, c) for g, c in grant.runs]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)









def dynamic_plan(spec: Spec, cursor: Cursor, world: int) -> DynamicPlan:
    """The dynamic plan of `cursor`'s remainder for a generation of `world` ranks."""
    check_int("world", world, 1)
    return DynamicPlan(spec, cursor, world)


@functools.lru_cache(maxsize=256)
def _global_plan(spec: Spec, cursor: Cursor) -> FixedPlan:
    return fixed_plan(spec, cursor, 1)
