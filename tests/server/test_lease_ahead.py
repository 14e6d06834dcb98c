"""Leases computed ahead (the Lease RPC): the same batches as computing them when asked, and fencing first."""

from __future__ import annotations

import pytest

from croupier.core.api import JoinRequest
from croupier.core.cursor import fresh
from croupier.core.errors import Aborted
from croupier.core.registry import plan_epoch
from croupier.core.spec import Spec
from croupier.server import _lease_ahead
from croupier.server._coordinator import Coordinator
from croupier.server._memory_store import MemoryStore

SPEC = Spec(n=1_003, seed=7, batch_size=4)
WORLD = 3
COUNT = 10  # batches a lease


def _started(core: Coordinator, incarnation: str) -> int:
    """Joins every rank of job "j" as `incarnation`; the generation started."""
    gens = {core.join(JoinRequest("j", SPEC, incarnation, WORLD, r)).generation for r in range(WORLD)}
    assert len(gens) == 1
    return gens.pop()


@pytest.mark.parametrize("settle", [True, False])
def test_leases_computed_ahead_are_the_plans_leases(settle: bool) -> None:
    """Whether a lease was computed ahead (`settle`: each asked once the one computed ahead is ready) or
    races its computation ahead, it is the plan's; the ranks ask in turn, so one rank's lease computed
    ahead is there when another asks for the same batches."""
    core = Coordinator(MemoryStore())
    try:
        gen = _started(core, "a")
        for epoch in (0, 1):
            p = plan_epoch(SPEC, fresh(SPEC, epoch), WORLD, epoch)
            assert p is not None
            hits, asked = core._leases.hits, 0
            for first in range(0, max(p.steps(r) for r in range(WORLD)), COUNT):
                for rank in range(WORLD):
                    if first >= p.steps(rank):
                        continue
                    if settle:
                        assert core._leases.idle(60.0)
                    lease = core.lease("j", gen, rank, epoch, first, COUNT)
                    assert lease.indices.tolist() == p.lease(rank, first, COUNT)[0].tolist(), (epoch, rank, first)
                    assert lease.end_of_epoch == (first + COUNT >= p.steps(rank))
                    asked += 1
            if settle:  # every lease after a rank's first was ready when asked
                assert core._leases.hits - hits == asked - WORLD
    finally:
        core.close()


def test_a_lease_computed_ahead_is_still_fenced() -> None:
    """A rank of a replaced generation is refused, though its next lease was computed before the replacement."""
    core = Coordinator(MemoryStore())
    try:
        old = _started(core, "a")
        core.lease("j", old, 1, 0, 0, COUNT)
        assert core._leases.idle(60.0)
        _started(core, "b")
        with pytest.raises(Aborted):
            core.lease("j", old, 1, 0, COUNT, COUNT)
        assert core._leases.hits == 0
    finally:
        core.close()


def test_beyond_the_budget_the_oldest_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for one lease ahead, the ranks' earlier ones are dropped and computed when asked, unchanged."""
    monkeypatch.setattr(_lease_ahead, "BUDGET_BYTES", COUNT * SPEC.batch_size * 8)  # one lease of int64
    core = Coordinator(MemoryStore())
    try:
        gen = _started(core, "a")
        p = plan_epoch(SPEC, fresh(SPEC, 0), WORLD, 0)
        assert p is not None
        for rank in range(WORLD):  # each rank's second lease is computed ahead; only the last one is kept
            core.lease("j", gen, rank, 0, 0, COUNT)
            assert core._leases.idle(60.0)
        for rank in reversed(range(WORLD)):  # the kept one first: nothing computed ahead since can drop it
            got = core.lease("j", gen, rank, 0, COUNT, COUNT)
            assert got.indices.tolist() == p.lease(rank, COUNT, COUNT)[0].tolist()
        assert core._leases.hits == 1
    finally:
        core.close()
