"""The order engine: which dataset indices rank r of W gets in batch j, as pure functions.

Vocabulary:
    position  -- a place in an epoch's order, in [0, n). ``order()`` maps positions to indices.
    cursor    -- topology-free progress through an epoch: the epoch number and the positions
                 not yet consumed, as sorted disjoint intervals. A fresh epoch has [(0, n)].
    virtual   -- the remaining positions of a cursor laid end to end, [0, R), then extended
                 by the tail policy to [0, T) (padding past R); partitions deal virtual
                 positions to ranks.

Everything here is O(batch) or O(world) per call, never O(n) (except the ``torch``
permutation, which is torch's own randperm), so any point of any epoch is reachable at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from croupier.core.checks import check_int
from croupier.core.cursor import (
    Cursor,
    Interval,
    bind,
    epoch_agrees,
    fresh,
    intervals_of,
    is_fresh,
    merge_intervals,
    show,
    validate_cursor,
)
from croupier.core.permute import KERNELS, mixture_order, position_of
from croupier.core.plan import ComputedPlan, Grant, Runs, StepPositions
from croupier.core.spec import Spec

if TYPE_CHECKING:
    from croupier.core.deals import EpochDeals

__all__ = ["Cursor", "FixedPlan", "Interval", "bind", "epoch_agrees", "fixed_plan", "fresh", "is_fresh", "order", "show",
           "validate_cursor"]


class Layout(Protocol):
    """A fixed plan's virtual positions [0, T) laid out over its ranks, in place of the spec's partition.

    Invariants (MUST): :meth:`virtual` is a bijection from every rank's local positions
    (``m < n_r[rank]``) onto [0, T); :meth:`owner` is its inverse; :meth:`virtual_left` is exactly the
    virtual positions of [0, R) that no rank consumed (and [T, R) when the tail drops it).
    """

    def virtual(self, rank: int, local: np.ndarray) -> np.ndarray: ...

    def virtual_all(self, ranks: np.ndarray, local: np.ndarray) -> np.ndarray: ...

    def owner(self, v: int) -> tuple[int, int]: ...

    def virtual_left(self, consumed: np.ndarray, left: int, t: int) -> list[Interval]: ...


MakeLayout = Callable[[Spec, int, int, int, np.ndarray, np.ndarray], Layout]


# --------------------------------------------------------------------------- the order


def part_bounds(spec: Spec, world: int) -> np.ndarray:
    """Boundaries of the rank parts of [0, n) that ``scope="rank"`` shuffles within; (world + 1,)."""
    if spec.scope == "global" or world == 0:
        return np.array([0, spec.n], dtype=np.int64)
    starts = _starts(spec.partition, spec.n, world)
    return np.append(starts, spec.n)


def order(spec: Spec, epoch: int, positions: np.ndarray, base_world: int = 0) -> np.ndarray:
    """Maps positions of `epoch`'s order to dataset indices.

    Args:
        spec: The job's spec.
        epoch: Epoch number, >= 0.
        positions: Integer array of positions, each in [0, spec.n).
        base_world: For ``scope="rank"``, the world size the epoch was split for.

    Returns:
        int64 array of dataset indices, same shape as `positions`.
    """
    pos = np.asarray(positions, dtype=np.int64)
    if pos.size == 0:
        return np.zeros(pos.shape, dtype=np.int64)
    if spec.sources is not None:  # a mixture: the positions of one stream over several sources
        return mixture_order(spec, epoch, pos.reshape(-1))[0].reshape(pos.shape)
    return KERNELS[spec.permutation](spec, epoch, pos, part_bounds(spec, base_world))


def tags(spec: Spec, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, source epoch) of each position of `epoch`'s order: a mixture's, or source 0 and `epoch` itself."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    if spec.sources is not None:
        _, source, source_epoch = mixture_order(spec, epoch, pos)
        return source, source_epoch
    return np.zeros(pos.shape, dtype=np.int64), np.full(pos.shape, epoch, dtype=np.int64)


# --------------------------------------------------------------------------- tails and partitions


def total(spec: Spec, left: int, world: int) -> int:
    """T: how many virtual positions the tail policy makes of `left` remaining ones for `world` ranks."""
    if spec.tail == "drop":
        return left // world * world
    if spec.tail == "uneven":
        return left
    return -(-left // world) * world  # pad, pad_last: up to the next multiple of world


def _starts(partition: str, t: int, world: int) -> np.ndarray:
    r = np.arange(world, dtype=np.int64)
    if partition == "chunked":
        c = -(-t // world)
        return np.minimum(r * c, t)
    if partition == "contiguous":
        q, m = divmod(t, world)
        return r * q + np.minimum(r, m)
    raise ValueError(f"partition {partition!r} has no contiguous parts")


def counts(spec: Spec, t: int, world: int) -> np.ndarray:
    """How many virtual positions each rank gets out of [0, t); shape (world,)."""
    r = np.arange(world, dtype=np.int64)
    if spec.partition == "strided":
        q, m = divmod(t, world)
        return q + (r < m)
    if spec.partition == "chunked":
        c = -(-t // world)
        return np.clip(t - r * c, 0, c)
    q, m = divmod(t, world)
    return q + (r < m)


def batch_counts(spec: Spec, n_r: np.ndarray) -> np.ndarray:
    """How many batches each rank gets from its n_r positions; shape (world,)."""
    b = spec.batch_size
    nb = n_r // b if spec.drop_last_batch else -(-n_r // b)
    if spec.even_batches:
        nb = np.full_like(nb, nb.min())
    return nb


@dataclasses.dataclass(frozen=True)
class FixedPlan(ComputedPlan):
    """How one epoch's remainder is dealt to `world` ranks as fixed-size batches: an
    :class:`croupier.core.plan.EpochPlan`. Cheap to make: O(world)."""

    fixed_batches = True
    portable = True

    spec: Spec
    cursor: Cursor
    world: int
    left: int  # R
    t: int  # T
    n_r: np.ndarray  # (world,) positions per rank
    nb_r: np.ndarray  # (world,) batches per rank
    cum: np.ndarray  # (k + 1,) cumulative lengths of cursor.remaining
    starts: np.ndarray  # (k,) interval starts
    #: Lays the virtual positions out over the ranks in place of the spec's partition (a shard order's
    #: reader groups, ``croupier.core.shard_layout.ShardLayout``); None: the partition's stripes or blocks.
    layout: Layout | None = None

    def virtual(self, rank: int, local: np.ndarray) -> np.ndarray:
        """Virtual positions of rank's local positions `local`."""
        if self.layout is not None:
            return self.layout.virtual(rank, local)
        v: np.ndarray = rank + local * self.world if self.spec.partition == "strided" else (
            _starts(self.spec.partition, self.t, self.world)[rank] + local
        )
        return v

    def virtual_all(self, ranks: np.ndarray, local: np.ndarray) -> np.ndarray:
        """:meth:`virtual` of many ranks at once: local position ``local[i]`` of rank ``ranks[i]``."""
        if self.layout is not None:
            return self.layout.virtual_all(ranks, local)
        if self.spec.partition == "strided":
            out: np.ndarray = ranks + local * self.world
            return out
        starts: np.ndarray = _starts(self.spec.partition, self.t, self.world)[ranks] + local
        return starts

    def owner(self, v: int) -> tuple[int, int]:
        """The inverse of :meth:`virtual`: the rank virtual position `v` is dealt to, and its local position."""
        if self.layout is not None:
            return self.layout.owner(v)
        if self.spec.partition == "strided":
            return v % self.world, v // self.world
        starts = _starts(self.spec.partition, self.t, self.world)
        rank = int(np.searchsorted(starts, v, side="right")) - 1
        return rank, v - int(starts[rank])

    def positions(self, v: np.ndarray) -> np.ndarray:
        """Order positions of virtual positions `v` (padding mapped by the tail policy)."""
        if len(self.starts) == 1 and (v.size == 0 or int(v.max()) < self.left):
            # One interval left and no padding (a fresh epoch): the order's positions are a shift.
            shifted: np.ndarray = v + int(self.starts[0]) if self.starts[0] else v
            return shifted
        real = v < self.left
        k = np.searchsorted(self.cum, v, side="right") - 1  # (len,) interval of each v
        k = np.minimum(k, len(self.starts) - 1)
        pos = self.starts[k] + (v - self.cum[k])
        if not real.all():
            if self.spec.tail == "pad_last":
                pad = np.full(v.shape, self.spec.n - 1, dtype=np.int64)
            else:  # pad: repeat from the start of the epoch's order, as torch does
                pad = (v - self.left) % self.spec.n
            pos = np.where(real, pos, pad)
        out: np.ndarray = pos
        return out

    def batch_positions(self, rank: int, j: int) -> np.ndarray | None:
        """Order positions of batch j of `rank`, or None when the rank has no batch j."""
        if j >= self.nb_r[rank]:
            return None
        b = self.spec.batch_size
        local = np.arange(j * b, min((j + 1) * b, int(self.n_r[rank])), dtype=np.int64)
        return self.positions(self.virtual(rank, local))

    def batch_indices(self, rank: int, j: int) -> np.ndarray | None:
        """Dataset indices of batch j of `rank`, or None when the rank has no batch j."""
        pos = self.batch_positions(rank, j)
        if pos is None:
            return None
        return order(self.spec, self.cursor.epoch, pos, self.cursor.base_world)

    def lease(self, rank: int, first: int, count: int, grant: Grant | None = None) -> tuple[np.ndarray, list[int]]:
        """Batches first .. first + count - 1 of `rank` (fewer at the epoch's end), laid end to end.

        One vectorised pass over all the batches, so the per-call cost of the order is paid once.

        Returns:
            The dataset indices of the batches, concatenated, and the size of each batch.
        """
        batches, last = self.share(rank, first, count)
        if not batches:
            return np.zeros(0, dtype=np.int64), []
        b = self.spec.batch_size
        sizes = [b] * (batches - 1) + [last]
        local = np.arange(first * b, first * b + (batches - 1) * b + last, dtype=np.int64)
        idx = order(self.spec, self.cursor.epoch, self.positions(self.virtual(rank, local)), self.cursor.base_world)
        return idx, sizes

    def lease_positions(self, rank: int, first: int, count: int, grant: Grant | None = None) -> np.ndarray:
        """The order positions of :meth:`lease`'s indices."""
        batches, last = self.share(rank, first, count)
        if not batches:
            return np.zeros(0, dtype=np.int64)
        b = self.spec.batch_size
        return self.positions(self.virtual(rank, np.arange(first * b, first * b + (batches - 1) * b + last,
                                                           dtype=np.int64)))

    def batch_sizes(self, rank: int, first: int, count: int) -> list[int]:
        """The sizes of batches first .. first + count - 1 of `rank` (fewer at the epoch's end)."""
        batches, last = self.share(rank, first, count)
        return [self.spec.batch_size] * (batches - 1) + [last] if batches else []

    def share(self, rank: int, first: int, count: int) -> tuple[int, int]:
        """How many of batches first .. first + count - 1 `rank` has, and the last one's size
        (every other one is full), in O(1)."""
        stop = min(first + count, int(self.nb_r[rank]))
        if stop <= first:
            return 0, 0
        b = self.spec.batch_size
        return stop - first, min(stop * b, int(self.n_r[rank])) - (stop - 1) * b

    def grant(self, rank: int, first: int, count: int, dealt: tuple[Runs, bool] | None = None) -> Grant:
        """The coordinator's answer to `rank` asking for batches first .. first + count - 1, in O(1)."""
        batches, last = self.share(rank, first, count)
        return Grant(batches, last, int(self.nb_r[rank]) <= first + batches, self.samples(rank))

    def agrees(self, grant: Grant, sizes: list[int]) -> bool:
        """Whether a lease of `sizes` is the grant's batches (the same count, the same last size)."""
        return (grant.batches, grant.last_size) == (len(sizes), sizes[-1] if sizes else 0)

    def ends(self, rank: int, first: int, count: int, got: int, grant: Grant | None) -> bool:
        """Whether `rank` has no batch from ``first + got`` on."""
        return int(self.nb_r[rank]) <= first + got

    def known_steps(self, rank: int) -> int | None:
        """`rank`'s batches: always known, in O(1)."""
        return int(self.nb_r[rank])

    def steps(self, rank: int) -> int:
        """`rank`'s batches, in O(1)."""
        return int(self.nb_r[rank])

    def known_samples(self, rank: int) -> int:
        """:meth:`samples`, always known."""
        return self.samples(rank)

    def samples(self, rank: int) -> int:
        """How many indices `rank` gets from this plan (what ``len(sampler)`` says)."""
        return int(min(int(self.nb_r[rank]) * self.spec.batch_size, int(self.n_r[rank])))

    def most_steps(self, book: EpochDeals | None) -> int:
        """The most batches of any rank, in O(world)."""
        return int(self.nb_r.max(initial=0))

    def step_positions(self, first: int, count: int, book: EpochDeals | None) -> StepPositions:
        """(rank, batch - `first`, position) of every sample of batches first .. first + count - 1 of every
        rank, from the layout at once."""
        b, w = self.spec.batch_size, self.world
        local = np.arange(first * b, (first + count) * b, dtype=np.int64)
        ranks = np.repeat(np.arange(w, dtype=np.int64), local.size)
        loc = np.tile(local, w)
        limit = np.minimum(self.nb_r * b, self.n_r)[ranks]
        keep = loc < limit
        ranks, loc = ranks[keep], loc[keep]
        return ranks, loc // b - first, self.positions(self.virtual_all(ranks, loc))

    def where(self, index: int) -> list[tuple[int, int, int]] | None:
        """Every (rank, batch, position) dealing `index` (padding repeats some), from the order's inverse
        and the layout's; None for an order without an inverse at hand."""
        pos = position_of(self.spec, self.cursor.epoch, index)
        if pos is None:
            return None
        b, left, t = self.spec.batch_size, self.left, self.t
        vs: list[int] = []
        k = int(np.searchsorted(self.starts, pos, side="right")) - 1
        if k >= 0 and pos < int(self.starts[k]) + int(self.cum[k + 1] - self.cum[k]):
            v = int(self.cum[k]) + pos - int(self.starts[k])
            if v < t:
                vs.append(v)
        if t > left:  # padding: virtual positions left .. t - 1 repeat positions
            if self.spec.tail == "pad_last":
                if pos == self.spec.n - 1:
                    vs.extend(range(left, t))
            else:
                vs.extend(range(left + pos, t, self.spec.n))
        out = []
        for v in vs:
            rank, loc = self.owner(v)
            if loc < min(int(self.nb_r[rank]) * b, int(self.n_r[rank])):
                out.append((int(rank), int(loc // b), pos))
        return out

    def padding(self, rank: int, step: int, size: int) -> np.ndarray:
        """Which of the `size` samples of `rank`'s batch `step` lie past the remainder (the tail's padding)."""
        local = step * self.spec.batch_size + np.arange(size, dtype=np.int64)  # (size,)
        pad: np.ndarray = self.virtual_all(np.full(size, rank, dtype=np.int64), local) >= self.left
        return pad

    def done(self, j: int) -> bool:
        """True when every rank has had all its batches once each has had j."""
        return bool(j >= self.nb_r.max(initial=0))

    def advance(self, j: int) -> Cursor:
        """The cursor once every rank has consumed min(j, its batch count) batches.

        NOTE: this is what makes the cursor topology-free: ranks of a lockstep job consume the
        same number of batches, so their common progress is one set of positions, and any new
        world size can deal out what is left.
        """
        if j <= 0:
            return self.cursor
        if self.done(j):
            return fresh(self.spec, self.cursor.epoch + 1)
        b = self.spec.batch_size
        consumed = np.minimum(np.minimum(j, self.nb_r) * b, self.n_r)  # (world,) local items eaten
        vleft = self._virtual_left(consumed)
        return dataclasses.replace(self.cursor, remaining=self._map(vleft))

    def _virtual_left(self, consumed: np.ndarray) -> list[Interval]:
        """Virtual intervals inside [0, R) that no rank has consumed."""
        w, r_left = self.world, self.left
        if self.layout is not None:
            return self.layout.virtual_left(consumed, r_left, self.t)
        if self.spec.partition != "strided":
            st = _starts(self.spec.partition, self.t, w)
            out = []
            for s, c, n in zip(st.tolist(), consumed.tolist(), self.n_r.tolist()):
                a, e = s + c, min(s + n, r_left)
                if a < e:
                    out.append((a, e))
            if self.t < r_left:  # tail "drop": [T, R) was dealt to no rank and is not consumed
                out.append((self.t, r_left))
            return merge_intervals(out)
        lo, hi = int(consumed.min()), int(consumed.max())
        # Rows below lo are consumed by every rank; rows from hi on by none. Only the rows in
        # between (at most batch_size + 1 of them, at the end of an epoch) need a closer look.
        v = np.arange(lo * w, min(hi * w, r_left), dtype=np.int64)
        keep = v // w >= consumed[v % w]
        out = intervals_of(v[keep])
        if hi * w < r_left:
            out.append((hi * w, r_left))
        return merge_intervals(out)

    def _map(self, vints: list[Interval]) -> tuple[Interval, ...]:
        """Order-position intervals of virtual intervals (which lie inside [0, R))."""
        out: list[Interval] = []
        cum = self.cum.tolist()
        starts = self.starts.tolist()
        for a, e in vints:
            k = int(np.searchsorted(self.cum, a, side="right")) - 1
            while a < e:
                seg_end = min(e, cum[k + 1])
                out.append((starts[k] + a - cum[k], starts[k] + seg_end - cum[k]))
                a = seg_end
                k += 1
        return tuple(merge_intervals(out))


def fixed_plan(spec: Spec, cursor: Cursor, world: int, layout: MakeLayout | None = None) -> FixedPlan:
    """How `cursor`'s remainder is dealt to `world` ranks.

    Args:
        layout: Makes the layout of the virtual positions over the ranks (in place of the spec's
            partition) from ``(spec, world, R, T, n_r, cum)``; None: the partition's.
    """
    check_int("world", world, 1)
    left = cursor.left
    t = total(spec, left, world)
    n_r = counts(spec, t, world)
    lengths = np.array([b - a for a, b in cursor.remaining], dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    starts = np.array([a for a, _ in cursor.remaining], dtype=np.int64)
    lay = None if layout is None else layout(spec, world, left, t, n_r, cum)
    return FixedPlan(spec, cursor, world, left, t, n_r, batch_counts(spec, n_r), cum, starts, lay)
