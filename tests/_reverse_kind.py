"""A toy fourth way of dealing, defined here only: the coordinator deals the epoch's full batches from the back.

It proves docs/architecture.md's "A new way of dealing touches" list for a plan the coordinator
deals: this module (the plan, its dealer, its registry entry) and :func:`registered` are all it
needs; the coordinator, its events, its snapshots and the samplers serve it unchanged. The plan
contract tests (tests/core/test_plans.py) and the state machine (tests/server) run it.

Global batches are those of dynamic dealing (the one-rank plan's batches of the epoch's remainder,
the last one shorter); the coordinator hands out *units* 0, 1, ... in order, as its deal book
records them, and unit u is global batch ``batches - 2 - u`` for every unit but the last, which
is the short batch (so every batch a rank gets is full but the epoch's last). A checkpoint is the
epoch's remaining positions minus those of the credited units' batches, computed from positions
alone: nothing of the fixed plan's internals.

Its stepped variant (:func:`reverse_steps`, the entry's ``stepped``): a job of torchft-style replica-group
steps whose spec names the kind (``StepLoader(..., dealing="reverse")``) takes each epoch's positions the
same way, the spec's batches of ``batch_size`` from the back and the last (short) one last, so that a step of the
global batch trains one whole batch of them. The loaders, the coordinator's record of committed steps and
the job's history (``croupier.core.quorum_ledger``) take it from the entry alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import numpy as np

from croupier.core.checks import check_int
from croupier.core.cursor import Cursor, fresh, intervals_of, validate_cursor
from croupier.core.deals import EpochDeals
from croupier.core.order import FixedPlan, fixed_plan
from croupier.core.plan import DealtPlan, Grant, Runs
from croupier.core.registry import PlanKind, registered
from croupier.core.spec import Spec

#: The kind's name, and the spec's ``dealing`` that selects it.
NAME = "reverse"


@dataclasses.dataclass(frozen=True)
class ReversePlan(DealtPlan):
    """An EpochPlan the coordinator deals, and its own Dealer: full batches from the back, the short one last."""

    spec: Spec
    cursor: Cursor
    world: int

    @property
    def _global(self) -> FixedPlan:
        return fixed_plan(self.spec, self.cursor, 1)

    def _batch(self, unit: int) -> int:
        """The global batch of `unit`."""
        return unit if unit == self.batches - 1 else self.batches - 2 - unit

    def _units(self, runs: Runs) -> list[int]:
        return [u for first, count in runs for u in range(first, first + count)]

    # ---------------------------------------------------------------- Dealer

    @property
    def batches(self) -> int:
        return int(self._global.nb_r[0])

    def deal(self, book: EpochDeals, rank: int, first: int, count: int) -> tuple[Runs, bool]:
        return book.answer(self.batches, rank, first, count)

    def checkpoint(self, book: EpochDeals, credited: dict[int, int]) -> Cursor:
        g = self._global
        every = g.lease_positions(0, 0, self.batches)
        taken = [g.lease_positions(0, self._batch(u), 1) for u in self._units(tuple(book.taken(credited)))]
        rest = np.setdiff1d(every, np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64))
        if rest.size == 0:
            return fresh(self.spec, self.cursor.epoch + 1)
        out = dataclasses.replace(self.cursor, remaining=tuple(intervals_of(rest)))
        validate_cursor(self.spec, out)
        return out

    # ---------------------------------------------------------------- EpochPlan

    def grant(self, rank: int, first: int, count: int, dealt: tuple[Runs, bool] | None = None) -> Grant:
        if dealt is None:
            raise ValueError("a reverse plan grants what the coordinator dealt: pass dealt=(runs, end)")
        runs, end = dealt
        units = self._units(runs)
        if not units:
            return Grant(0, 0, end, 0)
        return Grant(len(units), self._global.share(0, self._batch(units[-1]), 1)[1], end, 0, tuple(runs))

    def lease(self, rank: int, first: int, count: int, grant: Grant | None = None) -> tuple[np.ndarray, list[int]]:
        if grant is None:
            raise ValueError("a reverse plan's batches are the coordinator's to deal: a lease needs its grant")
        parts, sizes = [np.zeros(0, dtype=np.int64)], []
        for u in self._units(grant.runs):
            idx, s = self._global.lease(0, self._batch(u), 1)
            parts.append(idx)
            sizes += s
        return np.concatenate(parts), sizes

    def lease_positions(self, rank: int, first: int, count: int, grant: Grant | None = None) -> np.ndarray:
        if grant is None:
            raise ValueError("a reverse plan's batches are the coordinator's to deal: a lease needs its grant")
        parts = [self._global.lease_positions(0, self._batch(u), 1) for u in self._units(grant.runs)]
        return np.concatenate([np.zeros(0, dtype=np.int64), *parts])









@functools.lru_cache(maxsize=64)
def reverse_plan(spec: Spec, cursor: Cursor, world: int) -> ReversePlan:
    check_int("world", world, 1)
    if spec.tail != "uneven" or spec.even_batches or spec.drop_last_batch:
        raise ValueError(f"dealing={NAME!r} deals every position to whoever asks: it needs tail='uneven', "
                         f"even_batches=False, drop_last_batch=False (got {spec.describe()})")
    return ReversePlan(spec, cursor, world)


@functools.lru_cache(maxsize=64)
def reverse_steps(spec: Spec, epoch: int) -> np.ndarray:
    """The stepped variant: `epoch`'s positions as the steps take them, in batches of ``batch_size``: every batch
    but the last from the back, then the last (the short one, if one is), as :class:`ReversePlan` deals them."""
    starts = np.arange(0, spec.n, spec.batch_size, dtype=np.int64)  # (batches,)
    if len(starts) > 1:
        starts = np.concatenate([starts[-2::-1], starts[-1:]])
    out = np.concatenate([np.arange(a, min(a + spec.batch_size, spec.n), dtype=np.int64) for a in starts])
    out.flags.writeable = False  # cached: shared by every caller
    return out


#: Its registry entry: the coordinator deals it; batches of ``batch_size``; small leases, as dynamic dealing's;
#: its stepped variant's order.
REVERSE = PlanKind(NAME, reverse_plan, coordinator_deals=True, fixed_batches=True, lease_indices=1024, lease_batches=2,
                   stepped=reverse_steps)


@contextlib.contextmanager
def reverse_registered() -> Iterator[PlanKind]:
    """The toy kind, registered while the block runs."""
    with registered(REVERSE) as kind:
        yield kind
