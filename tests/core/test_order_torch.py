"""The ``torch`` and ``none`` orders match the installed torch ``DistributedSampler`` element for element."""

from __future__ import annotations

from typing import cast

import numpy as np
import pytest
from _budget import quick
from _sim import batches_of as _batches
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

from croupier.core.order import fixed_plan, fresh
from croupier.core.spec import Spec

SIZES = [*range(1, 38), 1000, *(() if quick() else (1001,))]  # make check (quick) leaves out 1001: seconds
WORLDS = range(1, 9)
SEEDS = (0, 7, 2**40 + 3)
EPOCHS = (0, 1, 6)


def _spec(n: int, seed: int, shuffle: bool, drop_last: bool, batch_size: int = 1) -> Spec:
    return Spec(
        n=n,
        seed=seed,
        permutation="torch" if shuffle else "none",
        partition="strided",
        tail="drop" if drop_last else "pad",
        batch_size=batch_size,
    )




def _torch(
    n: int, world: int, rank: int, shuffle: bool, drop_last: bool, seed: int, epoch: int
) -> DistributedSampler[int]:
    dataset = cast("Dataset[int]", range(n))  # the sampler only needs len()
    s: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    s.set_epoch(epoch)
    return s


@pytest.mark.parametrize("n", SIZES)
def test_batch_size_one_matches_torch(n: int) -> None:
    for shuffle in (True, False):
        for drop_last in (True, False):
            for seed in SEEDS if shuffle else (0,):
                for epoch in EPOCHS if shuffle else (0,):
                    spec = _spec(n, seed, shuffle, drop_last)
                    for world in WORLDS:
                        p = fixed_plan(spec, fresh(spec, epoch), world)
                        for rank in range(world):
                            ref = _torch(n, world, rank, shuffle, drop_last, seed, epoch)
                            want = list(ref)
                            got = _batches(p, rank)
                            ctx = f"{n=} {world=} {rank=} {shuffle=} {drop_last=} {seed=} {epoch=}"
                            assert all(len(b) == 1 for b in got), ctx
                            assert [b[0] for b in got] == want, ctx
                            assert p.samples(rank) == len(ref) == len(want), ctx


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 13, 17, 31, 37, 1000, 1001])
@pytest.mark.parametrize("batch_size", [2, 3, 8, 64])
def test_batches_concatenate_to_torch(n: int, batch_size: int) -> None:
    for shuffle in (True, False):
        for drop_last in (True, False):
            for seed, epoch in ((0, 0), (7, 3)) if shuffle else ((0, 0),):
                spec = _spec(n, seed, shuffle, drop_last, batch_size)
                for world in WORLDS:
                    p = fixed_plan(spec, fresh(spec, epoch), world)
                    for rank in range(world):
                        ref = _torch(n, world, rank, shuffle, drop_last, seed, epoch)
                        got = _batches(p, rank)
                        ctx = f"{n=} {batch_size=} {world=} {rank=} {shuffle=} {drop_last=} {seed=} {epoch=}"
                        assert [len(b) for b in got[:-1]] == [batch_size] * (len(got) - 1), ctx
                        assert [i for b in got for i in b] == list(ref), ctx
                        assert p.samples(rank) == len(ref), ctx


def test_epochs_follow_set_epoch() -> None:
    # The epoch lives in the cursor; torch's lives in set_epoch. Same epoch, same order; and
    # the orders of two epochs differ (so the test above cannot pass by ignoring the epoch).
    spec = _spec(50, 3, True, False)
    orders = []
    for epoch in range(4):
        got = [i for b in _batches(fixed_plan(spec, fresh(spec, epoch), 1), 0) for i in b]
        assert got == list(_torch(50, 1, 0, True, False, 3, epoch))
        orders.append(tuple(got))
    assert len(set(orders)) == 4


def test_len_before_iteration_matches_torch() -> None:
    # len(sampler) is known before any index is drawn; the plan's count must not need one.
    for n in (1, 5, 11, 1001):
        for world in WORLDS:
            for drop_last in (True, False):
                spec = _spec(n, 0, True, drop_last)
                p = fixed_plan(spec, fresh(spec, 0), world)
                want = [len(_torch(n, world, r, True, drop_last, 0, 0)) for r in range(world)]
                assert [p.samples(r) for r in range(world)] == want
                assert np.array_equal(p.nb_r, want)
