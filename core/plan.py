"""The plan interface: what every way of dealing an epoch answers, and the grant it answers with.

A *plan* is how the remainder of one epoch (a cursor) is dealt to the ranks of one generation
(its world). croupier deals in several ways (fixed batches, token budgets, dynamic dealing); each
is one module holding one class that satisfies :class:`EpochPlan`, registered in
:mod:`croupier.core.registry`, which alone picks the plan of an epoch. The coordinator and the
client speak to plans only through this interface, and the coordinator to a plan it deals
through its :class:`Dealer`.

Vocabulary:
    step   -- one batch of one rank: step s of rank r is the rank's s-th batch of the epoch in
              this generation (counted from the generation's start in that epoch).
    grant  -- the coordinator's answer to a rank asking for steps first .. first + count - 1: how
              many it gets, and, for a plan the coordinator deals, which global batches.
    lease  -- the dataset indices of granted steps, laid end to end, and each batch's size.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import numpy as np

from croupier.core.deals import Runs

if TYPE_CHECKING:
    from croupier.core.cursor import Cursor
    from croupier.core.deals import EpochDeals
    from croupier.core.spec import Spec

__all__ = ["ComputedPlan", "Dealer", "DealtPlan", "EpochPlan", "Grant", "Runs", "StepPositions", "lease_layout"]

#: (rank, step counted from the first asked, order position) of every sample of some steps: (samples,) each
StepPositions = tuple[np.ndarray, np.ndarray, np.ndarray]


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
          (as ``croupier.core.dynamic`` does): its :attr:`dealer` is not None (and None for every
          other plan), its grants need the coordinator's deal, its ranks wait for the coordinator
          instead of computing, and its checkpoints are computed from the deals by its dealer,
          so :meth:`advance` is not used for it.
        * Whatever differs between ways of dealing is a method here, answered by the plan's class
          (:class:`ComputedPlan` and :class:`DealtPlan` answer for the two ways the coordinator
          takes part); callers never test ``coordinator_deals``, ``dealer`` or ``fixed_batches``.
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
    def dealer(self) -> Dealer | None:
        """What the coordinator asks of this plan when it deals it (``coordinator_deals``), else None."""
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

    def coordinator_grant(self, rank: int, first: int, count: int, deal: Callable[[], tuple[Runs, bool]]) -> Grant:
        """The coordinator's answer to `rank` asking for steps first .. first + count - 1: a plan the
        coordinator deals grants the deal `deal` returns (durable once it returns), any other its own."""
        ...

    def own_grant(self, rank: int, first: int, count: int) -> Grant | None:
        """The grant a rank gives itself while the coordinator does not answer (its plan's own), or
        None where only the coordinator grants (it deals the batches: the rank waits for it)."""
        ...

    @property
    def portable(self) -> bool:
        """True when another process computes this plan's leases from the plan itself, sent once: it is
        small, keeps nothing it computed, and its grant names its batches' sizes."""
        ...

    def most_steps(self, book: EpochDeals | None) -> int:
        """The steps of the rank with the most in this plan; for a plan the coordinator deals, of those
        `book` (the epoch's deal book; None: nothing dealt) shows dealt."""
        ...

    def dealt_out(self, book: EpochDeals | None) -> bool:
        """Whether nothing of the epoch is left to deal: for a plan the coordinator deals, once `book`
        shows every global batch dealt; for any other always (its ranks' shares are the plan's)."""
        ...

    def step_positions(self, first: int, count: int, book: EpochDeals | None) -> StepPositions:
        """(rank, step - `first`, order position) of every sample of steps first .. first + count - 1 of
        every rank (those it has), in rank then step order; for a plan the coordinator deals, the
        steps `book` shows dealt."""
        ...

    def where(self, index: int) -> list[tuple[int, int, int]] | None:
        """Every (rank, step, order position) at which this plan deals dataset index `index`, when the
        order's inverse is at hand; None where finding it takes the epoch's steps (:meth:`step_positions`)."""
        ...

    def padding(self, rank: int, step: int, size: int) -> np.ndarray | None:
        """Which of the `size` samples of `rank`'s step `step` are the tail's padding, as (size,) bools;
        None where the plan has no fixed layout that says so."""
        ...


class _Leases(Protocol):
    """What :func:`lease_layout` asks of a plan: its leases (:class:`EpochPlan`)."""

    def lease(self, rank: int, first: int, count: int, grant: Grant | None = None) -> tuple[np.ndarray, list[int]]: ...

    def lease_positions(self, rank: int, first: int, count: int, grant: Grant | None = None) -> np.ndarray: ...


def lease_layout(plan: _Leases, first: int, count: int, grants: Mapping[int, Grant | None]) -> StepPositions:
    """:meth:`EpochPlan.step_positions` of the ranks `grants` names, each from its lease of steps
    first .. first + count - 1 with its grant: for a plan without a faster way. O(samples)."""
    ranks: list[np.ndarray] = []
    steps: list[np.ndarray] = []
    positions: list[np.ndarray] = []
    for rank, grant in grants.items():
        _, sizes = plan.lease(rank, first, count, grant)
        pos = plan.lease_positions(rank, first, count, grant)
        ranks.append(np.full(pos.size, rank, dtype=np.int64))
        steps.append(np.repeat(np.arange(len(sizes), dtype=np.int64), sizes))
        positions.append(pos)
    if not positions:
        none = np.zeros(0, dtype=np.int64)
        return none, none, none
    return np.concatenate(ranks), np.concatenate(steps), np.concatenate(positions)


class Dealer(Protocol):
    """The coordinator's side of a plan it deals (:attr:`EpochPlan.dealer`): one epoch's global batches.

    The coordinator keeps one :class:`croupier.core.deals.EpochDeals` per epoch, journals what
    :meth:`deal` answers as new before it answers (the ``BatchesDealt`` event), and asks
    :meth:`checkpoint` for the cursor of a checkpoint. The grant of a deal is the plan's
    (:meth:`EpochPlan.grant` with ``dealt``), and so is the lease of its runs.

    Invariants every dealer MUST keep:
        * It is a pure function of its plan's ``(spec, cursor, world)``, as the plan is: a
          coordinator that restarts asks the same questions of a plan made anew.
        * The epoch has :attr:`batches` global batches, 0 .. batches - 1; :meth:`deal` hands out
          each of them once, to whichever rank asks, and never one that `book` shows dealt.
        * :meth:`checkpoint` is topology-free: the plan of any world made from the cursor it
          returns deals exactly the positions of the global batches not credited.
    """

    @property
    def batches(self) -> int:
        """How many global batches the epoch has."""
        ...

    def deal(self, book: EpochDeals, rank: int, first: int, count: int) -> tuple[Runs, bool]:
        """What `rank` gets asking for batches first .. first + count - 1 of its sequence.

        Returns:
            The runs of global batches (first, count), and whether they are new (to be
            journaled) rather than a repeat of a deal in `book`.

        Raises:
            ValueError: `first` is past the end of the rank's sequence (it skips batches).
        """
        ...

    def checkpoint(self, book: EpochDeals, credited: dict[int, int]) -> Cursor:
        """The cursor once each rank took the first ``credited[rank]`` batches of its sequence in `book`
        (the next epoch's fresh cursor when that is every position)."""
        ...


class ComputedPlan(abc.ABC):
    """What every plan dealt when its generation starts answers alike: a base for such a plan class.

    Every rank computes the plan itself, the same on any machine: the coordinator grants the
    plan's own grant (no deal), a rank grants itself the same while the coordinator does not
    answer, and nothing is left for the coordinator to deal. A subclass (``spec``, ``cursor`` and
    ``world``, as :class:`EpochPlan`) adds its grants, leases and counts; one with a faster way
    than computing every rank's leases (the fixed plan's layout) overrides :meth:`most_steps`,
    :meth:`step_positions`, :meth:`where`, :meth:`padding` and :attr:`portable`.
    """

    world: int
    coordinator_deals = False
    dealer = None
    portable = False

    @abc.abstractmethod
    def grant(self, rank: int, first: int, count: int, dealt: tuple[Runs, bool] | None = None) -> Grant:
        """The plan's grant (:class:`EpochPlan`)."""

    @abc.abstractmethod
    def lease(self, rank: int, first: int, count: int, grant: Grant | None = None) -> tuple[np.ndarray, list[int]]:
        """The plan's lease (:class:`EpochPlan`)."""

    @abc.abstractmethod
    def lease_positions(self, rank: int, first: int, count: int, grant: Grant | None = None) -> np.ndarray:
        """The order positions of the plan's lease (:class:`EpochPlan`)."""

    @abc.abstractmethod
    def steps(self, rank: int) -> int:
        """`rank`'s steps (:class:`EpochPlan`)."""

    def coordinator_grant(self, rank: int, first: int, count: int, deal: Callable[[], tuple[Runs, bool]]) -> Grant:
        """The plan's own grant: the coordinator deals nothing (`deal` is not asked)."""
        return self.grant(rank, first, count)

    def own_grant(self, rank: int, first: int, count: int) -> Grant | None:
        """The plan's own grant, which the coordinator would answer too."""
        return self.grant(rank, first, count)

    def most_steps(self, book: EpochDeals | None) -> int:
        """The most steps of any rank, from the plan (`book` is not asked)."""
        return max((self.steps(r) for r in range(self.world)), default=0)

    def dealt_out(self, book: EpochDeals | None) -> bool:
        """Always: the ranks' shares are dealt when the generation starts."""
        return True

    def step_positions(self, first: int, count: int, book: EpochDeals | None) -> StepPositions:
        """Every rank's steps, from its leases (`book` is not asked)."""
        return lease_layout(self, first, count, dict.fromkeys(range(self.world)))

    def where(self, index: int) -> list[tuple[int, int, int]] | None:
        """None: no inverse at hand."""
        return None

    def padding(self, rank: int, step: int, size: int) -> np.ndarray | None:
        """None: no fixed layout."""
        return None


class DealtPlan(abc.ABC):
    """What every plan the coordinator deals answers alike: a base for such a plan class.

    A rank's steps are whatever global batches the coordinator deals it, so nothing about them is
    known before the deal: the counts are estimates (a rank's even share of what is left), a lease
    computed from its grant always agrees with it, and a checkpoint is the dealer's, from the deal
    book, never :meth:`advance`. A subclass (a frozen dataclass with ``spec``, ``cursor`` and
    ``world``) adds the grant, the leases and the :class:`Dealer` methods (abstract here: a plan
    without one cannot be made).
    """

    spec: Spec
    cursor: Cursor
    world: int
    coordinator_deals = True
    fixed_batches = True
    portable = False

    @property
    def dealer(self) -> DealtPlan:
        """Itself: the plan is its own dealer."""
        return self

    @property
    @abc.abstractmethod
    def batches(self) -> int:
        """How many global batches the epoch has (:class:`Dealer`)."""

    @abc.abstractmethod
    def deal(self, book: EpochDeals, rank: int, first: int, count: int) -> tuple[Runs, bool]:
        """What `rank` asking for batches first .. first + count - 1 of its sequence gets (:class:`Dealer`)."""

    @abc.abstractmethod
    def checkpoint(self, book: EpochDeals, credited: dict[int, int]) -> Cursor:
        """The cursor of a checkpoint from the deals (:class:`Dealer`)."""

    @abc.abstractmethod
    def grant(self, rank: int, first: int, count: int, dealt: tuple[Runs, bool] | None = None) -> Grant:
        """The grant of the coordinator's deal (:class:`EpochPlan`)."""

    @abc.abstractmethod
    def lease(self, rank: int, first: int, count: int, grant: Grant | None = None) -> tuple[np.ndarray, list[int]]:
        """The indices of the global batches `grant` names (:class:`EpochPlan`)."""

    @abc.abstractmethod
    def lease_positions(self, rank: int, first: int, count: int, grant: Grant | None = None) -> np.ndarray:
        """The order positions of the global batches `grant` names (:class:`EpochPlan`)."""

    @property
    def left(self) -> int:
        return self.cursor.left

    def agrees(self, grant: Grant, sizes: list[int]) -> bool:
        """Always: the lease is computed from the grant itself."""
        return True

    def ends(self, rank: int, first: int, count: int, got: int, grant: Grant | None) -> bool:
        """Whether the deal said nothing is left, or dealt nothing."""
        return grant is None or grant.end_of_epoch or got == 0

    def known_steps(self, rank: int) -> int | None:
        """None: a rank's steps are known only once the epoch is dealt out."""
        return None

    def steps(self, rank: int) -> int:
        """An estimate: `rank`'s even share of the batches left."""
        return -(-self.left // (self.world * self.spec.batch_size))

    def samples(self, rank: int) -> int:
        """An estimate: `rank`'s even share of the positions left."""
        return -(-self.left // self.world)

    def known_samples(self, rank: int) -> int:
        """0: not known."""
        return 0

    def advance(self, steps: int) -> Cursor:
        """Not defined: which batches the ranks took is the coordinator's record (the dealer's checkpoint)."""
        raise ValueError(f"a {type(self).__name__}'s checkpoint is computed by the coordinator from its deals "
                         "(its dealer's checkpoint), not by advance")

    def coordinator_grant(self, rank: int, first: int, count: int, deal: Callable[[], tuple[Runs, bool]]) -> Grant:
        """The grant of the deal `deal` returns."""
        return self.grant(rank, first, count, deal())

    def own_grant(self, rank: int, first: int, count: int) -> Grant | None:
        """None: only the coordinator grants (it deals the batches)."""
        return None

    def most_steps(self, book: EpochDeals | None) -> int:
        """The most global batches `book` shows dealt to one rank."""
        return max((book.dealt(r) for r in book.runs), default=0) if book is not None else 0

    def dealt_out(self, book: EpochDeals | None) -> bool:
        """Whether `book` shows every global batch of the epoch dealt."""
        return book is not None and book.next >= self.batches

    def step_positions(self, first: int, count: int, book: EpochDeals | None) -> StepPositions:
        """The steps `book` shows dealt, from the leases of their grants (ranks dealt none are left out)."""
        grants: dict[int, Grant | None] = {}
        for rank in range(self.world):
            runs = tuple(book.sequence(rank, first, count)) if book is not None else ()
            if runs:
                grants[rank] = self.grant(rank, first, count, (runs, False))
        return lease_layout(self, first, count, grants)

    def where(self, index: int) -> list[tuple[int, int, int]] | None:
        """None: where an index lies depends on the deals."""
        return None

    def padding(self, rank: int, step: int, size: int) -> np.ndarray | None:
        """None: no fixed layout."""
        return None
