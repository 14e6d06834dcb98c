"""What a sampler shows of itself: its batch sampler's index view, its generation and incarnation."""

from __future__ import annotations

import itertools

from croupier.client import DistributedBatchSampler
from croupier.server import Server

N = 300
LENGTHS = [1 + (i * 37) % 50 for i in range(N)]


def _tokens(server: Server, job: str, world: int = 1, rank: int = 0, incarnation: str = "t1") -> DistributedBatchSampler:
    return DistributedBatchSampler(N, lengths=LENGTHS, max_tokens=200, num_replicas=world, rank=rank, seed=3,
                                   address=server.address, job=job, incarnation=incarnation)


def test_the_index_view_of_token_budget_batches_counts_this_rank_indices(server: Server) -> None:
    for rank in (0, 1):  # before the join: the plan's share, without a coordinator asked
        bs = _tokens(server, f"view{rank}", world=2, rank=rank)
        assert len(bs.sampler) == bs._epoch_plan(0).samples(rank) > 0  # type: ignore[union-attr]
    bs = _tokens(server, "view")
    assert len(bs.sampler) == N
    assert sum(len(b) for b in bs) == N, "the epoch's batches hold as many indices as the view says"
    bs.close()


def test_the_index_view_after_a_resume_inside_an_epoch_counts_the_indices_taken_before(server: Server) -> None:
    bs = _tokens(server, "resumed")
    taken = sum(len(b) for b in itertools.islice(iter(bs), 4))
    state = bs.state_dict()
    bs.close()
    again = _tokens(server, "resumed", incarnation="t2")  # the restarted process: a new incarnation
    again.load_state_dict(state)
    assert len(again.sampler) == N, "before the join"
    rest = sum(len(b) for b in again)
    assert taken + rest == N and len(again.sampler) == N, "after the join"
    again.close()


def test_the_generation_and_incarnation_are_read_only_and_named_once_joined(server: Server) -> None:
    bs = _tokens(server, "named")
    assert (bs.generation, bs.incarnation) == (0, "")
    next(iter(bs))
    assert bs.generation >= 1 and bs.incarnation == "t1"
    assert bs.state_dict()["origin"].split("/")[0] == bs.incarnation
    for name in ("generation", "incarnation"):
        try:
            setattr(bs, name, 5)
        except AttributeError:
            continue
        raise AssertionError(f"{name} is assignable")
    bs.close()


def test_what_both_samplers_share_is_documented() -> None:
    from croupier.client._base import SamplerBase

    assert SamplerBase.__doc__ is not None and "Counting" in SamplerBase.__doc__, "the docstring must be the class's first statement"
    for name in ("state_dict", "load_state_dict", "resume_latest", "resume_from_step", "commit", "set_weights", "grow",
                 "skip", "generation", "incarnation"):
        assert getattr(DistributedBatchSampler, name).__doc__, name
