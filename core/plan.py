"""The plan interface: what every way of dealing an epoch answers, and the grant it answers with.

A *plan* is how the remainder of one epoch (a cursor) is dealt to the ranks of one generation
(its world). croupier deals in several ways (fixed batches, token budgets, dynamic dealing); each
is one module holding one class that satisfies :class:`EpochPlan`, registered in
:mod:`croupier.core.plans`, which alone picks the plan of an epoch. The coordinator and the
client speak to plans only through this interface.

Vocabulary:
    step   -- one batch of one rank: step s of rank r is the rank's s-th batch of the epoch in
              this generation (counted from the generation's start in that epoch).
    grant  -- the coordinator's answer to a rank asking for steps first .. first + count - 1: how
              many it gets, and, for a plan the coordinator deals, which global batches.
    lease  -- the dataset indices of granted steps, laid end to end, and each batch's size.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from croupier.core.cursor import Cursor
    from croupier.core.spec import Spec

#: Runs of global batches (first, count) that the coordinator dealt to a rank, in the rank's order.
Runs = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Grant:
    """Consecutive steps of one rank in one epoch, as positions of the generation's plan.

    The steps are ``first .. first + batches - 1`` of the rank; the client computes their indices
    with :meth:`EpochPlan.lease` (or, for a plan the coordinator deals, from `runs`).
    """

    batches: int  # how many steps are granted
    last_size: int  # the last one's size; every other one is full (0: sizes vary, the plan knows them)
    end_of_epoch: bool
    epoch_samples: int  # the rank's indices in the epoch, when known without computing (else 0)
    #: a plan the coordinator deals: the global batches dealt, as runs (first, count) in the rank's order
    runs: Runs = ()

    def sizes(self, batch_size: int) -> list[int]:
        """The size of each granted batch (fixed-size batches)."""
        return [batch_size] * (self.batches - 1) + [self.last_size] if self.batches else []


class EpochPlan(Protocol):
    """How one epoch's remainder (`cursor`) is dealt to the `world` ranks of one generation.

    Invariants every plan MUST keep:
        * It is a pure function of ``(spec, cursor, world)``: the coordinator and every client
          compute the same plan, on any machine (the client trains on while the coordinator is
          down, and the coordinator checks the client's plan against its own).
        * Making one costs at most O(world + intervals of the cursor); nothing is O(n) until a
          method says so.
        * Steps are dealt in order: a rank's step s + 1 exists only if its step s does.
        * ``advance(j)`` is topology-free: any plan of the same spec, made from the cursor it
          returns with any world, deals exactly the positions no rank consumed.
        * A plan whose ``coordinator_deals`` is True is dealt by the coordinator as ranks ask
          (``croupier.core.dynamic``): its grants need the coordinator's deal, its ranks wait for
          the coordinator instead of computing, and its checkpoints are computed from the deals,
          so :meth:`advance` is not used for it.
    """

    @property
    def spec(self) -> Spec:
        """The job's spec."""
        ...

    @property
    def cursor(self) -> Cursor:
        """The remainder of the epoch this plan deals."""
        ...

    @property
    def world(self) -> int:
        """The generation's world size."""
        ...

    @property
    def coordinator_deals(self) -> bool:
        """True when the coordinator decides each rank's batches as it asks (see the class docstring)."""
        ...

    @property
    def fixed_batches(self) -> bool:
        """True when every batch but a rank's last has ``spec.batch_size`` indices."""
        ...

    @property
    def left(self) -> int:
        """How many positions of the epoch's order remain to deal (the cursor's)."""
        ...

    def grant(self, rank: int, first: int, count: int, dealt: tuple[Runs, bool] | None = None) -> Grant:
        """What the coordinator answers `rank` asking for steps first .. first + count - 1.

        Args:
            dealt: For a plan the coordinator deals, its deal: (runs of global batches, whether
                the epoch has nothing left after them); None for every other plan.
        """
        ...

    def lease(self, rank: int, first: int, count: int, grant: Grant | None = None) -> tuple[np.ndarray, list[int]]:
        """The indices of steps first .. first + count - 1 of `rank` (fewer at its end), laid end to
        end, and each batch's size. A plan the coordinator deals needs the `grant` (its runs)."""
        ...

    def lease_positions(self, rank: int, first: int, count: int, grant: Grant | None = None) -> np.ndarray:
        """The positions of the epoch's order that :meth:`lease` maps to its indices, in the same order
        (pads included): what a sample's source and source epoch are read from (``order.tags``)."""
        ...

    def agrees(self, grant: Grant, sizes: list[int]) -> bool:
        """Whether a lease of `sizes` computed here is what the coordinator's `grant` names."""
        ...

    def ends(self, rank: int, first: int, count: int, got: int, grant: Grant | None) -> bool:
        """Whether `rank` has no step after a lease of `got` steps asked from step `first` (`count` asked)."""
        ...

    def known_steps(self, rank: int) -> int | None:
        """The steps `rank` has in this plan if known without computing the epoch, else None."""
        ...

    def steps(self, rank: int) -> int:
        """The steps `rank` has in this plan; may compute the epoch (an estimate where it cannot be known)."""
        ...

    def samples(self, rank: int) -> int:
        """The indices `rank` gets from this plan; may compute the epoch (an estimate where it cannot be known)."""
        ...

    def known_samples(self, rank: int) -> int:
        """:meth:`samples` when it is known without computing the epoch, else 0."""
        ...

    def advance(self, steps: int) -> Cursor:
        """The cursor once every rank took min(`steps`, its steps) steps (the next epoch's fresh
        cursor when that is all of them)."""
        ...
