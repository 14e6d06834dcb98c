"""Leases computed ahead (the Lease RPC): the same batches as computing them when asked, and fencing first."""

from __future__ import annotations

import pytest

from croupier.client._rpc import CoordinatorClient
from croupier.core.api import JoinRequest
from croupier.core.cursor import fresh
from croupier.core.errors import Aborted
from croupier.core.registry import plan_epoch
from croupier.core.spec import Spec
from croupier.server import _lease_ahead
from croupier.server._coordinator import Coordinator
from croupier.server._deadline import Budget, WouldWait
from croupier.server._memory_store import MemoryStore
from croupier.server._service import Server

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


AT_ONCE = Budget(at_once=True)


def test_a_lease_computed_ahead_is_answered_at_once_and_any_other_is_left_to_a_thread() -> None:
    """On the event loop (``at_once``) a lease computed ahead is answered, the plan's; one that is not (a rank's
    first) raises WouldWait having changed nothing, its progress report not made; a thread then answers it."""
    core = Coordinator(MemoryStore())
    try:
        gen = _started(core, "a")
        p = plan_epoch(SPEC, fresh(SPEC, 0), WORLD, 0)
        assert p is not None
        core.lease("j", gen, 0, 0, 0, COUNT)
        assert core._leases.idle(60.0)
        got = core.lease("j", gen, 0, 0, COUNT, COUNT, progress=(0, COUNT), budget=AT_ONCE)
        assert got.indices.tolist() == p.lease(0, COUNT, COUNT)[0].tolist() and core._leases.hits == 1
        before = core.snapshot_state()
        with pytest.raises(WouldWait):
            core.lease("j", gen, 1, 0, 0, COUNT, progress=(0, 0), budget=AT_ONCE)
        assert core.snapshot_state() == before and core._leases.hits == 1
        assert core.lease("j", gen, 1, 0, 0, COUNT, progress=(0, 0)).indices.tolist() == p.lease(1, 0, COUNT)[0].tolist()
    finally:
        core.close()


def test_a_lease_the_coordinator_deals_is_never_answered_at_once() -> None:
    """Dynamic dealing journals its deal before the answer: at once, WouldWait before anything is dealt."""
    dynamic = Spec(n=64, seed=3, batch_size=2, dealing="dynamic", tail="uneven")
    core = Coordinator(MemoryStore())
    try:
        gen = {core.join(JoinRequest("d", dynamic, "a", 2, r)).generation for r in range(2)}.pop()
        before = core.snapshot_state()
        with pytest.raises(WouldWait):
            core.lease("d", gen, 0, 0, 0, 4, budget=AT_ONCE)
        assert core.snapshot_state() == before
        assert len(core.lease("d", gen, 0, 0, 0, 4).indices) == 8
        assert core.snapshot_state() != before  # the thread's call dealt
    finally:
        core.close()


def test_nothing_is_computed_ahead_while_an_answer_is_on_its_way() -> None:
    """While a lease's answer is held (``hold_leases``), the rank's next lease waits to be computed ahead; once the
    hold ends it is, and the rank's next call takes it."""
    core = Coordinator(MemoryStore())
    try:
        gen = _started(core, "a")
        release = core.hold_leases()
        core.lease("j", gen, 2, 0, 0, COUNT)
        # bounded wait for something that must not happen (unheld, this lease takes milliseconds to compute)
        assert not core._leases.idle(0.5)
        release()
        release()  # again: no-op
        assert core._leases.idle(60.0)
        core.lease("j", gen, 2, 0, COUNT, COUNT)
        assert core._leases.hits == 1
    finally:
        core.close()


def test_over_grpc_each_lease_after_a_ranks_first_is_computed_ahead_and_answered(server: Server,
                                                                                client: CoordinatorClient) -> None:
    """Through the server: the hold of each Lease call ends once it is answered, so each rank's next lease is
    computed ahead and taken by its next call (answered on the event loop), the plan's batches all along."""
    core = server.core
    gen = {core.join(JoinRequest("g", SPEC, "a", WORLD, r)).generation for r in range(WORLD)}.pop()
    p = plan_epoch(SPEC, fresh(SPEC, 0), WORLD, 0)
    assert p is not None
    for first in range(0, 3 * COUNT, COUNT):
        got = client.lease("g", gen, 1, 0, first, COUNT)
        assert got.indices.tolist() == p.lease(1, first, COUNT)[0].tolist()
        assert got.sizes == p.lease(1, first, COUNT)[1]
        assert core._leases.idle(30.0)  # never, were a hold not ended
    assert core._leases.hits == 2


def test_a_lease_writes_nothing_but_progress_that_moved() -> None:
    """The lease path journals no event of its own: without a progress report nothing changes, and a report
    that does not move the rank forward changes nothing either (answered at once or on a thread)."""
    core = Coordinator(MemoryStore())
    try:
        gen = _started(core, "a")
        before = core.snapshot_state()
        core.lease("j", gen, 0, 0, 0, COUNT)
        assert core._leases.idle(60.0)
        core.lease("j", gen, 0, 0, COUNT, COUNT, budget=AT_ONCE)
        assert core.snapshot_state() == before
        core.lease("j", gen, 0, 0, COUNT, COUNT, progress=(0, COUNT))
        moved = core.snapshot_state()
        assert moved != before
        assert core._leases.idle(60.0)
        core.lease("j", gen, 0, 0, 2 * COUNT, COUNT, progress=(0, COUNT), budget=AT_ONCE)
        core.lease("j", gen, 0, 0, 2 * COUNT, COUNT, progress=(0, COUNT))
        assert core.snapshot_state() == moved
    finally:
        core.close()
