"""Dynamic dealing: the coordinator hands the next batches to whichever rank asks, exactly once."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
from _ranks import Ranks

from croupier.client import DistributedBatchSampler
from croupier.core.deals import EpochDeals
from croupier.core.errors import InvalidArgument
from croupier.core.order import fresh
from croupier.core.registry import plan_epoch
from croupier.core.spec import Spec
from croupier.server._coordinator import Coordinator
from croupier.server._service import Server
from croupier.server._stores import open_store

N, B = 1000, 8


def _samplers(address: str, world: int, incarnation: str, job: str = "dyn", lockstep: bool = True,
              lease_ahead: int = 2) -> list[DistributedBatchSampler]:
    return [DistributedBatchSampler(N, B, num_replicas=world, rank=r, address=address, job=job, incarnation=incarnation,
                                    dealing="dynamic", lockstep=lockstep, lease_ahead=lease_ahead, prefetch=1)
            for r in range(world)]


def _drain(ranks: Ranks, speeds: list[int], rng: random.Random) -> list[list[list[int]]]:
    """Steps ranks at different speeds (rank r takes up to speeds[r] batches a round) until all run out."""
    got: list[list[list[int]]] = [[] for _ in ranks.samplers]
    live = set(range(len(ranks.samplers)))
    while live:
        for r in sorted(live):
            for _ in range(rng.randint(1, speeds[r])):
                b = ranks.next(r)
                if b is None:
                    live.discard(r)
                    break
                got[r].append(b)
    return got


def test_every_index_once_and_fast_ranks_take_more(server: Server) -> None:
    ranks = Ranks(_samplers(server.address, 3, "t1"))
    got = _drain(ranks, [1, 1, 4], random.Random(1))
    seen = Counter(i for r in got for b in r for i in b)
    assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}
    assert len(got[2]) > 2 * max(len(got[0]), len(got[1]))  # the fast rank was dealt more
    ranks.close()


def test_lockstep_checkpoint_then_resume_on_another_world(server: Server) -> None:
    """Ranks step together; a checkpoint after k steps credits every rank with k batches; resume on 2 ranks."""
    ranks = Ranks(_samplers(server.address, 3, "t1"))
    taken: list[list[int]] = []
    for _ in range(11):
        for r in range(3):
            b = ranks.next(r)
            assert b is not None
            taken.append(b)
    state = ranks.samplers[1].state_dict()
    # the other ranks' prefetched (dealt, not taken) batches are not in the checkpoint
    assert ranks.samplers[0].state_dict() == {**state, "origin": ranks.samplers[0].state_dict()["origin"]}
    ranks.close()
    new = _samplers(server.address, 2, "t2")
    for s in new:
        s.load_state_dict(state)
    ranks = Ranks(new)
    rest = _drain(ranks, [1, 3], random.Random(2))
    seen = Counter(i for b in taken for i in b) + Counter(i for r in rest for b in r for i in b)
    assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}
    ranks.close()


def test_own_commits_make_the_latest_record(server: Server) -> None:
    """Independent workers commit their own progress; a relaunch resumes from the union (resume_latest)."""
    ranks = Ranks(_samplers(server.address, 2, "t1", lockstep=False))
    done: list[list[int]] = []
    for r, k in ((0, 5), (1, 9)):
        for _ in range(k):
            b = ranks.next(r)
            assert b is not None
            done.append(b)
        ranks.samplers[r].commit()
    b = ranks.next(0)  # taken, never committed: dealt again after the relaunch
    assert b is not None
    ranks.close()
    new = _samplers(server.address, 3, "t2", lockstep=False)
    assert all(s.resume_latest() for s in new)
    ranks = Ranks(new)
    rest = _drain(ranks, [2, 1, 1], random.Random(3))
    seen = Counter(i for b in done for i in b) + Counter(i for r in rest for b in r for i in b)
    assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}
    ranks.close()


def test_a_repeated_ask_gets_the_same_batches_and_a_skip_is_refused(tmp_path: Path) -> None:
    from croupier.core.api import JoinRequest

    spec = Spec(n=N, batch_size=B, tail="uneven", dealing="dynamic")
    core = Coordinator(open_store(f"sqlite:///{tmp_path}/j.db"))
    for r in range(2):
        core.join(JoinRequest("j", spec, "t", 2, r))
    a = core.grant("j", 1, 0, 0, 0, 3)
    assert core.grant("j", 1, 0, 0, 0, 3) == a  # the answer was lost: the same batches again
    b = core.grant("j", 1, 1, 0, 0, 3)
    assert set(range(a.runs[0][0], a.runs[0][0] + 3)).isdisjoint(range(b.runs[0][0], b.runs[0][0] + 3))
    with pytest.raises(InvalidArgument, match="asks from batch 5"):
        core.grant("j", 1, 0, 0, 5, 1)
    core.close()
    # deals are journaled: a restarted coordinator goes on where it was
    core = Coordinator(open_store(f"sqlite:///{tmp_path}/j.db"))
    c = core.grant("j", 1, 0, 0, 3, 3)
    assert c.runs[0][0] == 6
    core.close()


def test_a_checkpoint_from_deals_credits_each_rank() -> None:
    spec = Spec(n=100, batch_size=10, tail="uneven", dealing="dynamic")
    p = plan_epoch(spec, fresh(spec, 0), 2, 0)
    assert p is not None and p.dealer is not None
    book = EpochDeals()
    for rank, first, count in ((0, 0, 2), (1, 2, 2), (0, 4, 1)):
        book.deal(rank, first, count)
    c = p.dealer.checkpoint(book, book.credits(0, 2, lockstep=True))
    assert c.remaining == ((40, 100),)
    c = p.dealer.checkpoint(book, book.credits(0, 3, lockstep=True))
    assert c.remaining == ((50, 100),)  # rank 0's batches 0, 1, 4; rank 1 has only 2, 3
    c = p.dealer.checkpoint(book, book.credits(1, 1, lockstep=False))
    assert c.remaining == ((0, 20), (30, 100))


def _rest_of_the_epoch(address: str, world: int, incarnation: str) -> list[list[int]]:
    new = _samplers(address, world, incarnation, lockstep=False)
    assert all(s.resume_latest() for s in new)
    assert new[0].epoch == 0
    ranks = Ranks(new)
    rest = _drain(ranks, [1] * world, random.Random(4))
    ranks.close()
    return [b for r in rest for b in r]


def test_a_commit_after_its_loop_ended_keeps_the_others_batches_in_flight(server: Server) -> None:
    """A worker that commits again once its loop ran out does not declare the epoch done for the others."""
    ranks = Ranks(_samplers(server.address, 2, "t1", lockstep=False))
    held = ranks.next(1)  # dealt to worker 1, never committed
    assert held is not None
    done: list[list[int]] = []
    while (b := ranks.next(0)) is not None:
        done.append(b)
        ranks.samplers[0].commit()
    state = ranks.samplers[0].commit()
    assert state["epoch"] == 0 and sum(b - a for a, b in state["remaining"]) >= len(held)  # and its prefetch
    ranks.close()
    seen = Counter(i for b in done + _rest_of_the_epoch(server.address, 2, "t2") for i in b)
    assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}


def test_a_worker_ahead_in_the_next_epoch_leaves_the_record_in_the_slow_workers_epoch(server: Server) -> None:
    """Commits of the next epoch while a slow worker still holds batches: the record stays where nothing is skipped."""
    ranks = Ranks(_samplers(server.address, 2, "t1", lockstep=False, lease_ahead=1))
    held = ranks.next(1)
    assert held is not None
    done: list[list[int]] = []
    while (b := ranks.next(0)) is not None:
        done.append(b)
        ranks.samplers[0].commit()
    it = iter(ranks.samplers[0])  # worker 0 goes on to epoch 1 and commits a batch of it
    next(it)
    state = ranks.samplers[0].commit()
    assert state["epoch"] == 0  # worker 1's batch of epoch 0 is not committed
    ranks.close()
    seen = Counter(i for b in done + _rest_of_the_epoch(server.address, 2, "t2") for i in b)
    assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}


def test_an_epoch_whose_previous_one_is_not_all_dealt_is_refused(tmp_path: Path) -> None:
    from croupier.core.api import JoinRequest
    from croupier.core.errors import FailedPrecondition

    spec = Spec(n=N, batch_size=B, tail="uneven", dealing="dynamic")
    core = Coordinator(open_store(f"sqlite:///{tmp_path}/j.db"))
    core.join(JoinRequest("j", spec, "t", 1, 0))
    before = core.snapshot_state()
    with pytest.raises(FailedPrecondition, match="epoch 7 of job 'j' cannot begin: epoch 6 has dealt 0"):
        core.grant("j", 1, 0, 7, 0, 1)
    with pytest.raises(FailedPrecondition, match="epoch 50"):
        core.report("j", 1, 0, 50, 0, (None, None, "o"), lockstep=False)
    assert core.snapshot_state() == before
    core.close()
