"""A history's kept steps as flat index arrays, piece by piece: what an order file of the run holds, computed fast.

:meth:`croupier.core.history.History.kept_order` answers, for a range of steps, what
``[rec.kept.indices for rec in history.steps(a, b)]`` answers, without the rest of a
:class:`~croupier.core.answers.StepRecord` (ranks, micro-batches, sources, seeds, abandoned
versions) and without one Python call per step: each piece is many steps' positions laid out at
once and mapped to indices in one call of the order engine. The helpers here are pure: positions
in, positions out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import numpy as np

__all__ = ["NO_KEPT", "PIECE", "KeptSteps", "missing", "steps_per_piece", "step_major", "with_gaps"]

#: Samples a piece holds at most (a step larger than it is a piece of its own): what bounds the memory of a walk
#: over the whole run (a few arrays of it and the order engine's buffers: about 100 MB at 2**20).
PIECE = 1 << 20
#: A step's size in :attr:`KeptSteps.sizes` when no version of it is kept (every one was abandoned).
NO_KEPT = -1


@dataclasses.dataclass(frozen=True)
class KeptSteps:
    """Kept steps ``first .. first + len(sizes) - 1`` of a history's timeline, one after the other.

    Attributes:
        first: The first step (from 1).
        sizes: ``(steps,)`` samples of each step's kept version; :data:`NO_KEPT` for a step none of whose
            versions is kept.
        indices: ``(sum of the sizes >= 0,)`` the steps' dataset indices, step after step, each step's in
            rank then micro-batch order (what ``StepRecord.kept.indices`` holds).
    """

    first: int
    sizes: np.ndarray
    indices: np.ndarray

    @property
    def last(self) -> int:
        """The last step of the piece."""
        return self.first + self.sizes.size - 1


def missing(first: int, last: int) -> KeptSteps:
    """Steps `first` .. `last`, none of which has a kept version."""
    return KeptSteps(first, np.full(last - first + 1, NO_KEPT, dtype=np.int64), np.zeros(0, dtype=np.int64))


def with_gaps(a: int, b: int, pieces: Iterable[KeptSteps]) -> Iterator[KeptSteps]:
    """`pieces` (of steps within `a` .. `b`, in order), with every step from `a` to `b` that none holds as a
    step with no kept version."""
    t = a
    for p in pieces:
        if t < p.first:
            yield missing(t, p.first - 1)
        yield p
        t = p.last + 1
    if t <= b:
        yield missing(t, b)


def steps_per_piece(step_samples: int) -> int:
    """How many steps of `step_samples` samples each a piece holds (at least one)."""
    return max(1, PIECE // max(1, step_samples))


def step_major(rank: np.ndarray, step: np.ndarray, positions: np.ndarray, world: int,
               steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions laid out rank by rank (as a plan's ``step_positions`` gives them) re-laid step by step.

    Args:
        rank: ``(samples,)`` each sample's rank, ascending.
        step: ``(samples,)`` each sample's step, from 0, ascending within a rank.
        positions: ``(samples,)`` each sample's order position.
        world: Ranks.
        steps: Steps the samples belong to (``0 .. steps - 1``).

    Returns:
        ``(sizes, positions)``: ``(steps,)`` samples of each step, and the positions step after step, each
        step's in rank order and, within a rank, in their own order (micro-batch order).
    """
    n = positions.size
    if n and n % (world * steps) == 0 and _regular(rank, step, world, steps, n // (world * steps)):
        # NOTE: every rank has the same samples in every step (the usual full steps): a transpose, no sort
        per = n // (world * steps)
        out = positions.reshape(world, steps, per).transpose(1, 0, 2).reshape(-1)  # (steps, world, per) flat
        return np.full(steps, world * per, dtype=np.int64), out
    sizes = np.bincount(step, minlength=steps).astype(np.int64)
    return sizes, positions[np.argsort(step, kind="stable")]


def _regular(rank: np.ndarray, step: np.ndarray, world: int, steps: int, per: int) -> bool:
    """Whether sample ``(w * steps + s) * per + k`` is rank w's, of step s, for every w, s and k."""
    ranks = rank.reshape(world, steps * per)  # (world, steps * per)
    if not np.array_equal(ranks[:, 0], np.arange(world)) or not bool((ranks == ranks[:, :1]).all()):
        return False
    return bool((step.reshape(world, steps, per) == np.arange(steps)[None, :, None]).all())
