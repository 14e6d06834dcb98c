"""Dynamic dealing of a shard order: the coordinator hands a reader group whole windows, then rows.

A spec with ``shards`` and ``dealing="dynamic"`` is dealt as :mod:`croupier.core.dynamic` deals every
order (global batch g is virtual positions [g * B, (g + 1) * B) of the generation's remaining
positions laid end to end, each dealt once, to whichever rank asks, journaled before it is
answered, and a checkpoint is the remaining positions minus the credited batches), with one
difference: *which* undealt global batches a rank gets. The contract:

Units
    The generation's global batches are cut into **units** where a window of the shard order
    (:mod:`croupier.core.shards`) begins: unit u holds the global batches from the one holding
    window u's first remaining position to the one before window u + 1's (a unit is empty, and
    dropped, where a window has nothing left). A mixture of sharded sources mixes its sources'
    windows in one stream: its units are runs of ``shard_window`` times the mean shard size
    positions. A unit is read by one reader group (``spec.reader_group`` consecutive ranks), so its
    shards are fetched by one group.

Ranges
    The units are cut into one **range** a reader group, in unit order, in proportion to the group's
    ranks (by global batches): group q's range is the units from the one holding global batch
    ``batches * q * L // W`` to the one holding ``batches * (q + 1) * L // W`` (L ranks a group, W in
    all). A group reads its range from its front, unit after unit, so the batch that straddles two of
    its windows is read by the group that reads both.

A deal (rank r of group q asking for k batches from the end of its sequence)
    1. Its group's **open front** first: where the group's last run ends, right before a batch not
       dealt yet, inside a unit or, in the group's own range, at the start of its next unit; read
       on up to the range's end (a unit's end outside its range).
    2. Then the **whole units** of its range (no batch of them dealt), lowest first, each read from
       its front.
    3. Then whole units of other ranges, **from the back** (highest first): a fast group takes whole
       windows the slow ones have not begun.
    4. Once no unit is whole, **rows**: the batches at the back of the widest run not dealt inside
       one unit (ties: the lowest), so the group reading its front is not disturbed until the two
       meet.
    A deal ends once it has k batches, or right after the epoch's last global batch (the only
    short one: a grant's batches are full but its last), or when nothing is left.

Everything a deal reads is the deal book (:class:`croupier.core.deals.EpochDeals`): a coordinator
that restarts and replays its journal deals the same, and a repeated ask gets what it got before.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools

import numpy as np

from croupier.core.checks import check_int
from croupier.core.cursor import Cursor
from croupier.core.deals import EpochDeals
from croupier.core.dynamic import DynamicPlan
from croupier.core.plan import Runs
from croupier.core.shards import ShardOrder, shard_sizes
from croupier.core.spec import Spec

__all__ = ["ShardDeals", "shard_deals", "units"]


@functools.lru_cache(maxsize=256)
def units(spec: Spec, cursor: Cursor) -> np.ndarray:
    """Each unit's first global batch, then the number of global batches; (U + 1,), strictly increasing.

    Cost: O(S / shard_window + intervals of the cursor) for a single dataset; O(U) for a mixture.
    """
    b, left = spec.batch_size, cursor.left
    total = -(-left // b)
    if spec.sources is None:
        assert spec.shards is not None  # checked by Spec
        starts = ShardOrder(spec.shards, spec.seed, spec.shard_window).window_starts(cursor.epoch)
        lo = np.array([a for a, _ in cursor.remaining], dtype=np.int64)  # (k,) the cursor's intervals
        hi = np.array([e for _, e in cursor.remaining], dtype=np.int64)
        before = np.concatenate([[0], np.cumsum(hi - lo)]).astype(np.int64)  # (k + 1,) positions left before each
        k = np.searchsorted(lo, starts, side="right") - 1  # (windows,) the interval at or before each start
        at = np.maximum(k, 0)
        # the positions left before each window's start: the intervals before its own, and its own's part
        virtual = np.where(k >= 0, before[at] + np.clip(starts - lo[at], 0, (hi - lo)[at]), 0)
    else:
        sizes = shard_sizes(spec)
        per = max(1, spec.shard_window * int(sizes.sum()) // sizes.size)  # a window of mean shards
        virtual = np.arange(0, left, per, dtype=np.int64)
    edges = np.unique(np.concatenate([virtual // b, [0, total]]))
    out: np.ndarray = edges[edges <= total]
    return out


@dataclasses.dataclass(frozen=True)
class ShardDeals(DynamicPlan):
    """A dynamic plan of a shard order: its dealer hands each reader group whole units, then rows (see the
    module). Everything but :meth:`deal` is the dynamic plan's."""

    def deal(self, book: EpochDeals, rank: int, first: int, count: int) -> tuple[Runs, bool]:
        """What `rank` gets asking for batches first .. first + count - 1 of its sequence (see the module).

        Raises:
            ValueError: `first` is past the end of the rank's sequence (it skips batches).
        """
        again = book.repeated(rank, first, count)
        if again is not None:
            return again, False
        cuts, batches = _edges(self.spec, self.cursor), self.batches
        taken = _Taking(book.dealt_runs(), cuts, batches, count)
        size = self.spec.reader_group
        q = rank // size
        home = [bisect.bisect_right(cuts, batches * min(g * size, self.world) // self.world) - 1
                for g in (q, q + 1)]  # the units of group q's range
        lo, hi = cuts[home[0]], cuts[home[1]]
        front = _open_front(book, taken, range(q * size, min(q * size + size, self.world)), (lo, hi))
        if front is not None:
            taken.front(front, hi if lo <= front < hi else taken.unit_end(front))
        while taken.need > 0 and (u := taken.whole_unit(lo, hi, lowest=True)) is not None:
            taken.front(cuts[u], hi)
        while taken.need > 0 and (u := taken.whole_unit(0, batches, lowest=False)) is not None:
            taken.front(cuts[u], cuts[u + 1])
        while taken.need > 0 and (gap := taken.widest()) is not None:
            taken.back(*gap)
        runs = taken.runs()
        return runs, bool(runs)


class _Taking:
    """One deal in the making: what is dealt (the book's and this deal's, as joined runs), what this deal
    took, and how many batches it still needs. Each question is O(log) or O(stretches not dealt)."""

    def __init__(self, dealt: list[tuple[int, int]], cuts: list[int], batches: int, count: int) -> None:
        self.dealt = list(dealt)  # sorted disjoint runs [a, e) dealt, this deal's joined in
        self.cuts = cuts
        self.batches = batches
        self.need = max(count, 0)
        self.took: list[tuple[int, int]] = []

    def _after(self, g: int) -> int:
        """How many dealt runs start at or before `g`."""
        return bisect.bisect_right(self.dealt, (g, self.batches + 1))

    def is_dealt(self, g: int) -> bool:
        """Whether global batch `g` is dealt."""
        i = self._after(g) - 1
        return i >= 0 and self.dealt[i][1] > g

    def unit_end(self, g: int) -> int:
        """The end of the unit holding global batch `g`."""
        return self.cuts[bisect.bisect_right(self.cuts, g)]

    def gaps(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The runs not dealt inside [lo, hi), in order."""
        out, at = [], lo
        for a, e in self.dealt[max(0, self._after(lo) - 1):]:
            if a >= hi:
                break
            if at < a:
                out.append((at, a))
            at = max(at, e)
        if at < hi:
            out.append((at, hi))
        return out

    def whole_unit(self, lo: int, hi: int, lowest: bool) -> int | None:
        """The lowest (else the highest) unit inside [lo, hi) none of whose batches is dealt, or None."""
        for a, e in (self.gaps(lo, hi) if lowest else reversed(self.gaps(lo, hi))):
            first = bisect.bisect_left(self.cuts, a)  # the first unit starting in the gap
            last = bisect.bisect_right(self.cuts, e) - 2  # the last unit ending in it
            if first <= last:
                return first if lowest else last
        return None

    def _take(self, a: int, e: int) -> None:
        self.took.append((a, e))
        i = bisect.bisect_right(self.dealt, (a, e))
        self.dealt.insert(i, (a, e))  # a run touching its neighbours: the questions above read it as dealt
        self.need = 0 if e >= self.batches else self.need - (e - a)  # a deal ends after the epoch's last batch

    def front(self, a: int, end: int) -> None:
        """Takes what it needs of the run not dealt at `a`, from its front (up to `end`)."""
        if self.need > 0 and not self.is_dealt(a):
            i = self._after(a)
            stop = min(end, self.dealt[i][0] if i < len(self.dealt) else end)
            self._take(a, min(stop, a + self.need))

    def back(self, a: int, e: int) -> None:
        """Takes what it needs of the run not dealt [a, e), from its back."""
        self._take(max(a, e - self.need), e)

    def widest(self) -> tuple[int, int] | None:
        """The widest run not dealt inside one unit (ties: the lowest), or None when every batch is dealt."""
        best: tuple[int, int] | None = None
        for a, e in self.gaps(0, self.batches):
            while a < e:  # cut at the units' edges
                stop = min(e, self.unit_end(a))
                if best is None or stop - a > best[1] - best[0]:
                    best = (a, stop)
                a = stop
        return best

    def runs(self) -> Runs:
        """What this deal took, in the order taken, adjacent runs joined."""
        out: list[tuple[int, int]] = []
        for a, e in self.took:
            if out and out[-1][0] + out[-1][1] == a:
                out[-1] = (out[-1][0], out[-1][1] + e - a)
            elif e > a:
                out.append((a, e - a))
        return tuple(out)


def _open_front(book: EpochDeals, taken: _Taking, group: range, home: tuple[int, int]) -> int | None:
    """The first batch not dealt of what `group` is reading from its front (a unit, or its range `home` of
    global batches), or None.

    NOTE: a group's open front is found from its ranks' last runs: the rank that took the batch before
    the front took nothing after it (a deal reading a front moves on only when nothing is left in front
    of it), and a run taken from a unit's back ends where something is dealt.
    """
    fronts = []
    for r in group:
        runs = book.runs.get(r)
        if not runs:
            continue
        x = runs[-1][0] + runs[-1][1]
        i = bisect.bisect_left(taken.cuts, x)
        inside = i == len(taken.cuts) or taken.cuts[i] != x or home[0] < x < home[1]
        if x < taken.batches and inside and not taken.is_dealt(x):
            fronts.append(x)
    return min(fronts) if fronts else None


@functools.lru_cache(maxsize=256)
def _edges(spec: Spec, cursor: Cursor) -> list[int]:
    """:func:`units` as a list (a deal bisects it)."""
    out: list[int] = units(spec, cursor).tolist()
    return out


def shard_deals(spec: Spec, cursor: Cursor, world: int) -> ShardDeals:
    """The dynamic plan of a shard order for `cursor`'s remainder and a generation of `world` ranks."""
    check_int("world", world, 1)
    return ShardDeals(spec, cursor, world)
