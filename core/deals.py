"""The deal book: what the coordinator dealt, and what was committed, in one epoch of a plan it deals.

A plan the coordinator deals (its ``dealer`` is not None, see :class:`croupier.core.plan.Dealer`)
numbers the epoch's *global batches* 0 .. ``dealer.batches`` - 1 and hands them out as ranks ask.
The coordinator records each deal (the ``BatchesDealt`` event) and each ``own`` commit (the
``BatchesCommitted`` event) in one :class:`EpochDeals` per epoch; this module is what those
events do to it, the same for every way of dealing, so a new one adds no event and no field.

Vocabulary:
    deal     -- the global batches a rank got at one ask, as runs (first, count).
    sequence -- a rank's global batches in the order it was dealt them; a rank asks by positions
                of its sequence.
    credit   -- how many batches of its sequence a rank has trained on, as a checkpoint counts
                them (``lockstep``: every rank as many as the rank taking it; ``own``: the
                committing rank its count, every other its last commit).
"""

from __future__ import annotations

import bisect
import dataclasses

#: Runs of global batches (first, count) that the coordinator dealt to a rank, in the rank's order.
Runs = tuple[tuple[int, int], ...]

#: Epochs of one generation whose deals the coordinator answers for (older ones are left behind once a
#: later epoch's first batch is dealt, see :func:`answered`; a rank still asking for one is refused).
KEEP_EPOCHS = 2


@dataclasses.dataclass
class EpochDeals:
    """What one epoch of one generation dealt: how many global batches, and each rank's sequence."""

    #: how many global batches were dealt; for a dealer that deals them in order (``answer``), the next one
    next: int = 0
    #: rank -> its sequence as runs (first global batch, count), in dealt order
    runs: dict[int, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    #: rank -> batches of its sequence it committed (``own`` checkpoints)
    committed: dict[int, int] = dataclasses.field(default_factory=dict)
    # NOTE: derived from `runs`, not state of its own (not journaled, not in snapshots): made at the first
    # :meth:`dealt_runs` and kept by :meth:`deal`, so a dealer that deals out of order finds what is dealt
    # in O(log) rather than reading every run of every rank at each deal.
    _firsts: list[int] | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _dealt: list[tuple[int, int]] = dataclasses.field(default_factory=list, init=False, repr=False, compare=False)

    def dealt(self, rank: int) -> int:
        """How many batches `rank` was dealt in this epoch."""
        return sum(c for _, c in self.runs.get(rank, ()))

    def sequence(self, rank: int, first: int, count: int) -> list[tuple[int, int]]:
        """Batches first .. first + count - 1 of `rank`'s sequence (those it has), as runs of global batches."""
        out: list[tuple[int, int]] = []
        at = 0
        for g, c in self.runs.get(rank, ()):
            lo, hi = max(first, at), min(first + count, at + c)
            if lo < hi:
                out.append((g + lo - at, hi - lo))
            at += c
            if at >= first + count:
                break
        return out

    def answer(self, batches: int, rank: int, first: int, count: int) -> tuple[Runs, bool]:
        """What a rank asking for batches first .. first + count - 1 of its sequence gets, when the
        epoch has `batches` global batches dealt in order (the next one not dealt to anyone first).

        A rank asking again for batches it was dealt (its answer was lost) gets the same ones; a
        rank asking past its sequence gets up to `count` global batches not yet dealt.

        Returns:
            The runs of global batches (first, count) answering it, and whether they are *new*
            (to be journaled as a deal) rather than a repeat.

        Raises:
            ValueError: `first` is past the end of the rank's sequence (it skips batches).
        """
        again = self.repeated(rank, first, count)
        if again is not None:
            return again, False
        n = min(count, batches - self.next)
        return ((self.next, n),) if n > 0 else (), n > 0

    def repeated(self, rank: int, first: int, count: int) -> Runs | None:
        """What a rank asking again for batches of its sequence it was dealt gets (the same ones), or None
        for an ask from the end of its sequence (a new deal).

        Raises:
            ValueError: `first` is past the end of the rank's sequence (it skips batches).
        """
        have = self.dealt(rank)
        if first > have:
            raise ValueError(f"rank {rank} asks from batch {first} of its sequence, but was dealt {have} batches")
        return tuple(self.sequence(rank, first, count)) if first < have else None

    def ended(self, batches: int, runs: Runs, new: bool) -> bool:
        """Whether a rank answered `runs` (`new`: just dealt, not recorded yet) has nothing after them, in an
        epoch of `batches`: every batch is dealt once they are."""
        return not runs or (new and self.next + sum(c for _, c in runs) >= batches)

    def deal(self, rank: int, first: int, count: int) -> None:
        """Records a deal of global batches first .. first + count - 1 to `rank` (a ``BatchesDealt`` event)."""
        if self._firsts is not None:
            self._join(first, first + count)
        runs = self.runs.setdefault(rank, [])
        if runs and runs[-1][0] + runs[-1][1] == first:
            runs[-1] = (runs[-1][0], runs[-1][1] + count)
        else:
            runs.append((first, count))
        # NOTE: a count, not the end of the latest run: a dealer may deal out of order (a shard order's
        # dealer hands each reader group whole windows), and "every batch dealt" is next == batches.
        self.next += count

    def dealt_runs(self) -> list[tuple[int, int]]:
        """Every global batch dealt, to any rank, as sorted disjoint runs [first, end), adjacent ones joined
        (as many as the stretches not dealt between them). Read-only: :meth:`deal` keeps it."""
        if self._firsts is None:
            self._firsts, self._dealt = [], []
            for a, e in sorted((g, g + c) for runs in self.runs.values() for g, c in runs):
                self._join(a, e)
        return self._dealt

    def _join(self, a: int, e: int) -> None:
        """Adds [a, e) to the dealt runs, joined to the neighbours it touches."""
        assert self._firsts is not None
        firsts, runs = self._firsts, self._dealt
        i = bisect.bisect_right(firsts, a)
        if i > 0 and runs[i - 1][1] >= a:
            i -= 1
            a = runs[i][0]
            e = max(e, runs[i][1])
            del firsts[i], runs[i]
        while i < len(runs) and runs[i][0] <= e:
            e = max(e, runs[i][1])
            del firsts[i], runs[i]
        firsts.insert(i, a)
        runs.insert(i, (a, e))

    def commit(self, rank: int, batches: int) -> None:
        """Records that `rank` committed the first `batches` batches of its sequence (a ``BatchesCommitted`` event)."""
        self.committed[rank] = max(self.committed.get(rank, 0), batches)

    def uncommitted(self) -> bool:
        """Whether a rank was dealt batches it has not committed."""
        return any(self.committed.get(r, 0) < self.dealt(r) for r in self.runs)

    def credits(self, rank: int, batches: int, lockstep: bool) -> dict[int, int]:
        """Each rank's credited batches at a checkpoint `rank` takes after `batches` batches of its sequence."""
        if lockstep:
            return {r: min(batches, self.dealt(r)) for r in self.runs}
        out = dict(self.committed)
        out[rank] = max(out.get(rank, 0), batches)
        return out

    def taken(self, credited: dict[int, int]) -> list[tuple[int, int]]:
        """The global batches the ranks are credited with, as runs (first, count), unsorted."""
        return [run for r, k in credited.items() for run in self.sequence(r, 0, k)]


def answered(deals: dict[int, EpochDeals]) -> dict[int, EpochDeals]:
    """A generation's books as its coordinator still answers for them: every epoch but those left behind
    (:data:`KEEP_EPOCHS` or more before the latest dealt) with no ``own`` commit still waiting in them.

    NOTE: a view, not a pruning: the generation's segment keeps every epoch's deals (the step ledger
    computes its steps from them), and the coordinator's decisions read this, so one book serves both.
    """
    if not deals:
        return deals
    last = max(deals)
    return {e: b for e, b in deals.items() if e > last - KEEP_EPOCHS or (b.committed and b.uncommitted())}


def kept(deals: dict[int, EpochDeals], epoch: int) -> bool:
    """Whether a generation's `deals` (as :func:`answered` shows them) can still answer for `epoch` (it was not
    left behind)."""
    return epoch in deals or not deals or epoch > max(deals) - KEEP_EPOCHS + 1
