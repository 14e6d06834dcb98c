"""The registry of plans: every way of dealing an epoch, and each epoch's plan (:func:`plan_epoch`).

A way of dealing is a module with a class satisfying :class:`croupier.core.plan.EpochPlan` and
one :class:`PlanKind` entry in :data:`KINDS`. Everything that depends on the way of dealing
(which plan a spec gets, the defaults of the samplers' arguments, what a kind decides for the
coordinator and the samplers: the :class:`PlanKind` methods) is read here; the coordinator and
the client ask the plan itself for everything else (a plan the coordinator deals answers
through its ``dealer``). A way of dealing defined in a test is registered for the test's
duration with :func:`registered`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np

from croupier.core import spec as _spec
from croupier.core.checks import check_choice
from croupier.core.cursor import Cursor, epoch_cursor
from croupier.core.dynamic import dynamic_plan
from croupier.core.errors import FailedPrecondition
from croupier.core.order import fixed_plan
from croupier.core.plan import Dealer, EpochPlan
from croupier.core.shard_deals import shard_deals
from croupier.core.shard_layout import shard_layout
from croupier.core.spec import Spec
from croupier.core.tokens import token_plan

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class PlanKind:
    """One way of dealing an epoch.

    Attributes:
        name: The kind's name (in docs, logs and the audit log); a spec's ``dealing`` names it,
            except ``"static"``, which is ``"fixed"``, ``"tokens"`` with ``max_tokens`` or ``"shards"`` with
            ``shards``, and ``"dynamic"`` with ``shards``, which is ``"shards-dynamic"``.
        make: Builds the plan of a cursor's remainder for a world; MUST be pure (and may cache).
        coordinator_deals: The plans' ``coordinator_deals`` (the coordinator decides each batch,
            asking the plan's ``dealer``).
        fixed_batches: The plans' ``fixed_batches`` (batches of ``spec.batch_size``).
        lease_indices: The index sampler's default lease, in batches of one index.
        lease_batches: The batch sampler's default lease, in batches.
        shuffled_by: The permutation a shuffling sampler of this kind always takes (None: the usual
            default, see :meth:`permutation`).
        stepped: Its stepped variant (a job of torchft-style replica-group steps whose spec names this
            kind): an epoch's positions in the order the job's committed steps take them, a pure function
            of (spec, epoch) that MUST return a permutation of ``range(spec.n)`` (int64). None: in the
            order's own sequence, 0, 1, 2, ... (see :meth:`stepped_positions`).
    """

    name: str
    make: Callable[[Spec, Cursor, int], EpochPlan]
    coordinator_deals: bool
    fixed_batches: bool
    lease_indices: int
    lease_batches: int
    shuffled_by: str | None = None
    stepped: Callable[[Spec, int], np.ndarray] | None = None

    def __reduce__(self) -> tuple[object, tuple[str]]:
        # A sampler keeps its kind and is pickled into DataLoader workers: a kind travels by name.
        return kind_named, (self.name,)

    def permutation(self, shuffle: bool, lengths: bool, shards: bool = False) -> str:
        """The default permutation of a sampler that names none (``lengths``: it was given lengths;
        ``shards``: shard sizes, whose order every kind takes)."""
        if not shuffle:
            return "none"
        if shards:
            return "shards"
        if self.shuffled_by is not None:
            return self.shuffled_by
        # NOTE: a fixed or dynamic plan given lengths buckets by them (d9d's length bucketing);
        # token budgets read lengths as token counts and shuffle the whole epoch.
        return "bucket" if lengths and self.fixed_batches else "feistel"

    def tail(self, drop_last: bool, batches: bool) -> str:
        """The default tail of a sampler that names none (``batches``: the batch sampler, whose
        ``drop_last`` is about its own last batch, not the epoch's tail)."""
        if self.coordinator_deals:  # batches go to whoever asks: nothing to pad or drop across ranks
            return "drop" if drop_last and not batches else "uneven"
        return "drop" if drop_last and not batches else "pad"

    def lockstep(self, lockstep: bool) -> bool:
        """Whether the ranks of a sampler given `lockstep` step together: its setting where the
        coordinator deals (``False``: each rank's checkpoint commits its own progress), always where
        the plan is dealt when the generation starts (every rank's checkpoint is computed alike)."""
        return lockstep if self.coordinator_deals else True

    def item_unit(self, unit: int) -> int:
        """The positions an item of `unit` holds, as the audit log records it: 0 where batches size
        themselves (an item is one batch of its own size)."""
        return unit if self.fixed_batches else 0

    def ends_needed(self, world: int) -> int:
        """How many of a generation's `world` ranks reach an epoch's end once the epoch is over: one
        where the ranks step together through the plan dealt when the generation started, every one
        where the coordinator deals (a rank ends when nothing is left to deal while others may still
        hold batches)."""
        return world if self.coordinator_deals else 1

    def dealer_of(self, plan: EpochPlan, job: str) -> Dealer:
        """`plan`'s dealer, for the coordinator dealing `job`'s batches.

        Raises:
            FailedPrecondition: this kind's plans are dealt when their generation starts.
        """
        if plan.dealer is None:
            raise FailedPrecondition(f"job {job!r} is dealt when its generation starts ({self.name} plans): "
                                     "the coordinator deals no batch of it")
        return plan.dealer

    def either(self, computed: T, dealt: T) -> T:
        """`dealt` for a kind the coordinator deals as ranks ask, else `computed` (the ranks compute
        their plans): where a caller has a way of its own for each (the coordinator's record of a
        checkpoint, a sampler's checkpoint states), this is the one place it is picked. A difference
        a plan or a kind answers itself is a method of it instead."""
        return dealt if self.coordinator_deals else computed

    def stepped_positions(self, spec: Spec, epoch: int, a: int, b: int) -> np.ndarray:
        """The positions of `epoch`'s order at places [a, b) of the epoch as a stepped job's steps take it
        (``croupier.core.ftsteps``: stream position ``epoch * n + p`` is place ``p``), int64."""
        at = np.arange(a, b, dtype=np.int64)
        return at if self.stepped is None else self.stepped(spec, epoch)[at]

    def stepped_place(self, spec: Spec, epoch: int, position: int) -> int:
        """Inverse of :meth:`stepped_positions`: the place at which a stepped job's steps take `position` of `epoch`."""
        if self.stepped is None:
            return position
        return int(np.flatnonzero(self.stepped(spec, epoch) == position)[0])


# NOTE: fixed plans are O(world) to make and are asked for on every grant: a large cache. Token
# plans keep the windows they packed (up to a few MB each): a smaller one.
_fixed = functools.lru_cache(maxsize=256)(fixed_plan)
FIXED = PlanKind("fixed", _fixed, False, True, 65536, 256)
TOKENS = PlanKind("tokens", functools.lru_cache(maxsize=64)(token_plan), False, False, 65536, 16)
DYNAMIC = PlanKind("dynamic", functools.lru_cache(maxsize=256)(dynamic_plan), True, True, 1024, 2)
SHARDS = PlanKind("shards", functools.lru_cache(maxsize=256)(functools.partial(fixed_plan, layout=shard_layout)),
                  False, True, 65536, 256, shuffled_by="shards")
SHARD_DEALS = PlanKind("shards-dynamic", functools.lru_cache(maxsize=256)(shard_deals), True, True, 1024, 2,
                       shuffled_by="shards")
#: Every way of dealing, by name.
KINDS: dict[str, PlanKind] = {k.name: k for k in (FIXED, TOKENS, DYNAMIC, SHARDS, SHARD_DEALS)}


def kind_named(name: str) -> PlanKind:
    """The registered kind called `name`."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"no way of dealing is called {name!r} (known: {sorted(KINDS)})") from None


def kind_for(dealing: str, max_tokens: int | None = None, shards: bool = False) -> PlanKind:
    """The way of dealing of a spec's ``dealing``, ``max_tokens`` and ``shards`` settings (the one rule).

    Raises:
        ValueError: `dealing` names no registered way of dealing.
    """
    check_choice("dealing", dealing, _spec.DEALINGS)
    if dealing == "static":
        # NOTE: token budgets over a shard order are the token plan's, over the shard order's positions
        return TOKENS if max_tokens is not None else SHARDS if shards else FIXED
    return SHARD_DEALS if dealing == "dynamic" and shards else KINDS[dealing]


def kind_of(spec: Spec) -> PlanKind:
    """The way of dealing of `spec`."""
    return kind_for(spec.dealing, spec.max_tokens, spec.shards is not None)


def sized_batches(spec: Spec) -> bool:
    """Whether `spec`'s batches are of ``batch_size`` (a global batch counts them); token budgets size their own."""
    return kind_of(spec).fixed_batches


def plan_epoch(spec: Spec, start: Cursor, world: int, epoch: int) -> EpochPlan | None:
    """The plan of `epoch` for a generation of `world` ranks that resumed at `start`.

    The generation's first epoch is `start`'s remainder; every later epoch starts fresh (the one
    epoch rule, :func:`croupier.core.cursor.epoch_cursor`).

    Returns:
        The plan, or None for the epoch just before a fresh start (it is complete).

    Raises:
        OutOfRange: `epoch` is before the generation's resume point.
    """
    cursor = epoch_cursor(spec, start, world, epoch)
    return None if cursor is None else kind_of(spec).make(spec, cursor, world)


@contextlib.contextmanager
def registered(kind: PlanKind) -> Iterator[PlanKind]:
    """Registers `kind` while the ``with`` block runs: a way of dealing defined in a test.

    Specs whose ``dealing`` is ``kind.name`` are valid and get its plans until the block ends;
    then the kind and its name are gone again. Its ``make`` needs a ``cache_clear`` (wrap it in
    ``functools.lru_cache``).

    Raises:
        ValueError: `kind`'s name is taken (a registered kind's, or ``"static"``).
    """
    if kind.name in KINDS or kind.name in _spec.DEALINGS:
        raise ValueError(f"a way of dealing called {kind.name!r} is registered already (known: {sorted(KINDS)})")
    # NOTE: the spec validates its ``dealing`` against DEALINGS when it is made; the name joins
    # them here, with the kind, and leaves with it.
    KINDS[kind.name] = kind
    _spec.DEALINGS = (*_spec.DEALINGS, kind.name)
    try:
        yield kind
    finally:
        del KINDS[kind.name]
        _spec.DEALINGS = tuple(d for d in _spec.DEALINGS if d != kind.name)


def cache_clear() -> None:
    """Forgets every cached plan (tests that change an order under the engine)."""
    for kind in KINDS.values():
        kind.make.cache_clear()  # type: ignore[attr-defined]
