"""Where a job is in its data: the cursor (an epoch and the positions of its order not yet consumed).

Vocabulary:
    position  -- a place in an epoch's order, in [0, n). ``croupier.core.order.order()`` maps
                 positions to dataset indices.
    cursor    -- topology-free progress through an epoch: the epoch number and the positions
                 not yet consumed, as sorted disjoint intervals. A fresh epoch has [(0, n)].
"""

from __future__ import annotations

import dataclasses

import numpy as np

from croupier.core.checks import check_int, is_int
from croupier.core.errors import OutOfRange
from croupier.core.spec import Spec

Interval = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Cursor:
    """Where a job is in its data: an epoch and the positions of its order not yet consumed.

    Attributes:
        epoch: The epoch number, >= 0.
        remaining: Sorted, disjoint, non-empty ``(start, end)`` intervals of positions of the
            epoch's order that have not been consumed.
        base_world: For ``scope="rank"`` specs, the world size the epoch's order was split for
            (0 until a generation starts the epoch); always 0 for ``scope="global"``.
    """

    epoch: int
    remaining: tuple[Interval, ...]
    base_world: int = 0

    @property
    def left(self) -> int:
        """How many positions remain."""
        return sum(b - a for a, b in self.remaining)


def fresh(spec: Spec, epoch: int) -> Cursor:
    """The cursor at the start of `epoch`."""
    return Cursor(epoch=epoch, remaining=((0, spec.n),))


def is_fresh(spec: Spec, cursor: Cursor) -> bool:
    """True when nothing of the cursor's epoch has been consumed."""
    return cursor.remaining == ((0, spec.n),)


def epoch_agrees(spec: Spec, cursor: Cursor, epoch: int) -> bool:
    """Whether ``set_epoch(epoch)`` agrees with resuming at `cursor`: the one epoch rule.

    It does for the cursor's own epoch, and for the epoch just before a fresh start (that epoch
    is complete: its loop gets no batches and moves on). :func:`epoch_cursor` and a sampler
    joining its generation read the epochs before a resume point by it.
    """
    return epoch == cursor.epoch or (epoch == cursor.epoch - 1 and is_fresh(spec, cursor))


def epoch_cursor(spec: Spec, start: Cursor, world: int, epoch: int) -> Cursor | None:
    """The cursor of `epoch` for a generation of `world` ranks that resumed at `start`.

    The generation's first epoch is `start`'s remainder, every later one starts fresh, and the
    epoch before that agrees with `start` (:func:`epoch_agrees`) is complete.

    Returns:
        The cursor, or None for the epoch just before a fresh start (it is complete).

    Raises:
        OutOfRange: `epoch` is before the generation's resume point.
    """
    if epoch > start.epoch:
        return bind(spec, fresh(spec, epoch), world)
    if not epoch_agrees(spec, start, epoch):
        raise OutOfRange(
            f"epoch {epoch} is before this generation's resume point {show(start)}; "
            "set_epoch must not go back before the checkpoint the job resumed from"
        )
    return start if epoch == start.epoch else None


def bind(spec: Spec, cursor: Cursor, world: int) -> Cursor:
    """Fixes the epoch's layout for a generation of `world` ranks (``scope="rank"`` only)."""
    if spec.scope == "rank" and cursor.base_world == 0:
        return dataclasses.replace(cursor, base_world=world)
    return cursor


def validate_cursor(spec: Spec, cursor: Cursor) -> None:
    """Raises ValueError, naming the value, if `cursor` cannot belong to a job with `spec`."""
    check_int("cursor epoch", cursor.epoch, 0, type_error=ValueError)
    check_int("base_world", cursor.base_world, 0, type_error=ValueError)
    prev = 0
    for iv in cursor.remaining:
        if len(iv) != 2 or not all(is_int(x) for x in iv):
            raise ValueError(f"cursor intervals must be pairs of ints (got {iv!r})")
        a, b = iv
        if not (prev <= a < b <= spec.n):
            raise ValueError(
                f"cursor intervals must be sorted, disjoint, non-empty and inside [0, {spec.n}) "
                f"(got {list(cursor.remaining)!r})"
            )
        prev = b
    if not cursor.remaining:
        raise ValueError("cursor has no remaining positions; a finished epoch is the next epoch's fresh cursor")
    if spec.scope == "global" and cursor.base_world != 0:
        raise ValueError(f"base_world must be 0 for scope='global' (got base_world={cursor.base_world})")


def intervals_of(v: np.ndarray) -> list[Interval]:
    """The positions of a sorted int array as the fewest ``(a, b)`` intervals: each a maximal stretch of
    consecutive values (``[3, 4, 5, 9]`` -> ``[(3, 6), (9, 10)]``); the plans' way to turn the positions
    not yet taken into a cursor's ``remaining``."""
    if v.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(v) != 1)
    starts = np.concatenate([[v[0]], v[breaks + 1]])
    ends = np.concatenate([v[breaks], [v[-1]]]) + 1
    return list(zip(starts.tolist(), ends.tolist()))


def merge_intervals(ints: list[Interval]) -> list[Interval]:
    """`ints` sorted, with overlapping or touching intervals joined (``[(5, 7), (0, 2), (2, 3)]`` ->
    ``[(0, 3), (5, 7)]``); the plans' way to join the parts of a cursor's ``remaining``."""
    out: list[Interval] = []
    for a, b in sorted(ints):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def show(c: Cursor | None) -> str:
    """A short rendering of a cursor for error messages."""
    if c is None:
        return "None"
    rem = [list(iv) for iv in c.remaining]
    shown = str(rem) if len(rem) <= 4 else f"{str(rem[:2])[:-1]}, ..., {rem[-1]}]"
    return f"(epoch {c.epoch}, remaining {shown}, {c.left} positions)"
