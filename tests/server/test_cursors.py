"""Per-rank cursors and checkpoint records on the coordinator (GetJob), and resume by step."""

from __future__ import annotations

from pathlib import Path

import pytest
from _joins import join_started
from _ranks import Ranks, on_ranks

from croupier.client import DistributedBatchSampler, DistributedSampler
from croupier.client._rpc import CoordinatorClient
from croupier.core.api import CHECKPOINT_HISTORY
from croupier.core.errors import FailedPrecondition
from croupier.core.order import Cursor
from croupier.server._coordinator import Coordinator
from croupier.server._decide import decide_join, decide_report
from croupier.server._service import Server
from croupier.server._state import State
from croupier.server._stores import open_store

N = 1000


def _samplers(address: str, world: int, incarnation: str, job: str = "cur", lease_ahead: int = 16) -> list[DistributedSampler]:
    return [DistributedSampler(N, num_replicas=world, rank=r, address=address, job=job, incarnation=incarnation,
                               lease_ahead=lease_ahead, prefetch=1) for r in range(world)]


def test_getjob_returns_each_ranks_cursor_as_its_loop_consumed(server: Server, client: CoordinatorClient) -> None:
    """With every lease a rank reports how far its loop got (never ahead of it); its state_dict() makes it exact."""
    world, lease = 3, 16
    ranks = Ranks(_samplers(server.address, world, "t1", lease_ahead=lease))
    taken = [0] * world
    for step, counts in enumerate([(100, 100, 100), (37, 80, 5)]):
        for r in range(world):
            for _ in range(counts[r]):
                assert ranks.next(r) is not None
            taken[r] += counts[r]
        st = client.status("cur")
        seen = {c.rank: c for c in st.ranks}
        assert set(seen) == set(range(world))
        for r in range(world):
            c = seen[r]
            assert (c.epoch, c.batches_in_epoch) == (0, -(-N // world))  # tail "pad": every rank gets ceil(N / W)
            # reported at the last lease the loop took: a whole lease behind at most, never ahead
            assert taken[r] - 2 * lease <= c.batches <= taken[r], (step, r, c, taken)
    states = [s.state_dict(step=7) for s in ranks.samplers[:1]]  # rank 0 only: the others lag it
    st = client.status("cur")
    assert {c.rank: c.batches for c in st.ranks}[0] == taken[0]
    assert [(c.step, c.rank, c.generation) for c in st.checkpoints] == [(7, 0, 1)]
    assert st.checkpoints[0].origin == states[0]["origin"]
    # every rank's state_dict reports exactly what its loop took
    for r in range(world):
        ranks.samplers[r].state_dict()
    assert {c.rank: c.batches for c in client.status("cur").ranks} == dict(enumerate(taken))
    ranks.close()


def test_a_batch_sampler_reports_batches(server: Server, client: CoordinatorClient) -> None:
    samplers = [DistributedBatchSampler(N, 8, num_replicas=2, rank=r, address=server.address, job="bat", incarnation="t",
                                        lease_ahead=4, prefetch=1) for r in range(2)]
    ranks = Ranks(samplers)
    for r in range(2):
        for _ in range(21):
            assert ranks.next(r) is not None
        samplers[r].state_dict()
    assert [(c.rank, c.batches, c.batches_in_epoch) for c in client.status("bat").ranks] == [(0, 21, 63), (1, 21, 63)]
    ranks.close()


def _take(samplers: list[DistributedSampler], k: int) -> list[list[int]]:
    """k indices from every rank (the ranks join together)."""
    its = [iter(s) for s in samplers]
    return on_ranks(len(samplers), lambda r: [next(its[r]) for _ in range(k)])


def test_resume_from_step_continues_exactly_with_another_world_size(server: Server, client: CoordinatorClient) -> None:
    first = _samplers(server.address, 2, "a")
    got = _take(first, 150)
    for s in first:
        s.state_dict(step=150)  # what a trainer's checkpoint hook does; the dict is not kept
    for s in first:
        s.close()
    second = _samplers(server.address, 3, "b")
    on_ranks(3, lambda r: second[r].resume_from_step(150))
    rest = on_ranks(3, lambda r: list(second[r]))
    trained = [i for part in got for i in part] + [i for part in rest for i in part]
    assert sorted(set(trained)) == list(range(N))
    assert len(trained) - N < 3  # the epoch's last step pads fewer than W indices (tail "pad")
    for s in second:
        s.close()


def test_resume_from_an_unknown_step_names_the_steps_recorded(server: Server, client: CoordinatorClient) -> None:
    first = _samplers(server.address, 1, "a")
    _take(first, 10)
    first[0].state_dict(step=10)
    first[0].close()
    late = _samplers(server.address, 1, "b")
    with pytest.raises(LookupError, match=r"no checkpoint recorded at step 11 \(steps recorded: 10;.*job="):
        late[0].resume_from_step(11)
    with pytest.raises(ValueError, match="step must be"):
        late[0].resume_from_step(-1)
    late[0].close()


def test_a_rollback_replaces_the_later_records(server: Server, client: CoordinatorClient) -> None:
    """Resumed from step 10 after checkpoints at 10 and 20: the next checkpoint (15) replaces the record of 20."""
    a = _samplers(server.address, 1, "a")
    _take(a, 10)
    a[0].state_dict(step=10)
    _take(a, 10)
    a[0].state_dict(step=20)
    a[0].close()
    assert [c.step for c in client.status("cur").checkpoints] == [10, 20]
    b = _samplers(server.address, 1, "b")
    b[0].resume_from_step(10)
    _take(b, 5)
    b[0].state_dict(step=15)
    assert [(c.step, c.generation) for c in client.status("cur").checkpoints] == [(10, 1), (15, 2)]
    b[0].close()


def _started(core: Coordinator, world: int = 2) -> int:
    from croupier.core.api import JoinRequest
    from croupier.core.spec import Spec

    spec = Spec(n=N)
    out = on_ranks(world, lambda r: join_started(core, JoinRequest("j", spec, "t", world, r), 10.0))
    return int(out[0].generation)


def test_records_are_journaled_bounded_and_survive_a_restart(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/c.db"
    core = Coordinator(open_store(url), snapshot_every=50)  # a snapshot falls inside the records
    gen = _started(core)
    for k in range(CHECKPOINT_HISTORY + 6):
        cursor = Cursor(0, ((2 * k, N),), 0)
        core.report("j", gen, 0, 0, k, (k, cursor, f"t/0/{k}"))
        core.report("j", gen, 1, 0, k, (k, cursor, f"t/0/{k}"))  # the same state from rank 1: one record
    core.report("j", gen, 1, 0, 999)
    before = core.job("j")
    assert [c.step for c in before.checkpoints] == list(range(6, CHECKPOINT_HISTORY + 6))
    assert {c.rank for c in before.checkpoints} == {0}
    with pytest.raises(FailedPrecondition, match="did not take the same number of batches"):
        core.report("j", gen, 1, 0, 5, (CHECKPOINT_HISTORY + 5, Cursor(0, ((1, N),), 0), "t/0/1"))
    core.close()
    again = Coordinator(open_store(url))
    after = again.job("j")
    assert after.checkpoints == before.checkpoints
    assert [(c.rank, c.epoch, c.batches) for c in after.ranks] == [(0, 0, CHECKPOINT_HISTORY + 5), (1, 0, 999)]
    assert again.checkpoint("j", 40)[1].cursor == Cursor(0, ((80, N),), 0)
    again.close()


def test_a_new_generation_forgets_the_old_worlds_cursors() -> None:
    from croupier.core.api import JoinRequest
    from croupier.core.spec import Spec

    state, spec = State(), Spec(n=N)
    for r in range(2):
        for ev in decide_join(state, JoinRequest("j", spec, "t1", 2, r), 0):
            state.apply(ev)
    for ev in decide_report(state, "j", 1, 0, 0, 3, 1, (3, Cursor(0, ((3, N),), 0), "t1/0/3"))[1]:
        state.apply(ev)
    assert state.jobs["j"].progress == {0: (0, 3, 1)}
    restored = State.restore(state.snapshot())
    assert restored.snapshot() == state.snapshot() and restored.jobs["j"].checkpoints == state.jobs["j"].checkpoints
    for ev in decide_join(state, JoinRequest("j", spec, "t2", 3, 0), 0):
        state.apply(ev)
    assert state.jobs["j"].progress == {} and len(state.jobs["j"].checkpoints) == 1
