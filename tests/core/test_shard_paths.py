"""The shard order's fast paths (one position in plain Python, a batch in few numpy calls, the cycle-walk's
scalar tail, reader groups made when first asked about) give exactly what the order's definition gives."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from croupier.core import feistel
from croupier.core.cursor import Cursor
from croupier.core.registry import plan_epoch
from croupier.core.shard_layout import ShardLayout, shard_layout
from croupier.core.shards import _SHARD_TAG, _WINDOW_TAG, ShardOrder
from croupier.core.spec import Spec


def _bijection(n: int, keys: np.ndarray) -> np.ndarray:
    """permute(0 .. n - 1) from the inverse alone (``unpermute``, whose walk has no scalar tail)."""
    return np.argsort(feistel.unpermute(np.arange(n, dtype=np.int64), n, keys))


def _reference(sizes: list[int], seed: int, window: int, epoch: int) -> np.ndarray:
    """The whole epoch of a shard order from its definition, in O(n): the shards in a keyed order, windows
    of `window` of them, each window's samples in a keyed order."""
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    slots = _bijection(len(sizes), feistel.round_keys(feistel.derive_key(seed, epoch, _SHARD_TAG)))  # slot -> shard
    out = []
    for w, a in enumerate(range(0, len(sizes), window)):
        rows = np.concatenate([np.arange(offsets[s], offsets[s + 1]) for s in slots[a:a + window]])
        keys = feistel.round_keys(feistel.derive_key(seed, epoch, w, _WINDOW_TAG))
        out.append(rows[_bijection(rows.size, keys)])
    return np.concatenate(out)


orders = st.tuples(st.lists(st.integers(1, 40), min_size=1, max_size=50), st.integers(0, 2**32 - 1),
                   st.integers(1, 9), st.integers(0, 1000))


@settings(max_examples=60, deadline=None)
@given(orders)
def test_every_path_of_the_order_is_its_definition(case: tuple[list[int], int, int, int]) -> None:
    sizes, seed, window, epoch = case
    order = ShardOrder(np.array(sizes, dtype="<i8").tobytes(), seed, window)
    want = _reference(sizes, seed, window, epoch)
    n = want.size
    assert np.array_equal(order.indices(epoch, np.arange(n)), want)  # the batch path, all at once
    assert [order.index(epoch, p) for p in range(n)] == want.tolist()  # one position, plain Python
    assert [int(order.indices(epoch, np.array([p]))[0]) for p in range(n)] == want.tolist()
    for a in range(0, n, 7):  # batches of 7 (the scalar path) and of 23 (numpy, then the walk's scalar tail)
        assert np.array_equal(order.indices(epoch, np.arange(a, min(n, a + 7))), want[a:a + 7])
        assert np.array_equal(order.indices(epoch, np.arange(a, min(n, a + 23))), want[a:a + 23])
    assert np.array_equal(order.positions(epoch, want), np.arange(n))


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 2**40), st.integers(0, 2**63), st.data())
def test_the_walks_scalar_tail_is_the_same_bijection(n: int, key: int, data: st.DataObject) -> None:
    size = data.draw(st.integers(feistel.SMALL + 1, 80), label="size")
    pos = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=size, max_size=size)), dtype=np.int64)
    keys = np.stack([feistel.round_keys(key + i) for i in range(size)], axis=1)  # (ROUNDS, size): a key each
    got = feistel.permute(pos, n, keys)
    assert np.array_equal(feistel.unpermute(got, n, keys), pos)
    shared = feistel.round_keys(key)
    assert np.array_equal(feistel.unpermute(feistel.permute(pos, n, shared), n, shared), pos)


def test_a_dataset_past_two_to_the_32_keeps_every_path_exact() -> None:
    sizes = [2**31 + 5, 7, 2**31 - 3, 2**30, 11]  # > 2**32 samples: the epoch's table is int64
    order = ShardOrder(np.array(sizes, dtype="<i8").tobytes(), 5, 2)
    n = sum(sizes)
    pos = np.concatenate([np.random.default_rng(0).integers(0, n, 200), [0, n - 1, 2**32, 2**31 + 5]])
    got = order.indices(3, pos)
    assert [order.index(3, int(p)) for p in pos] == got.tolist()
    assert got.min() >= 0 and got.max() < n
    assert np.array_equal(order.positions(3, got), pos)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=40), st.integers(1, 4), st.sampled_from([1, 2, 5]),
       st.integers(1, 12), st.integers(0, 3))
def test_a_group_made_alone_is_the_group_made_with_the_others(sizes: list[int], group: int, lanes: int, world: int,
                                                              stop: int) -> None:
    spec = Spec.with_shards(sizes, batch_size=3, seed=1, reader_group=group, lanes=lanes, shard_window=2)
    first = plan_epoch(spec, Cursor(0, ((0, spec.n),)), world + 1, 0)
    assert first is not None
    cursor = first.advance(stop)  # a resume from a cursor of many intervals, when `stop` > 0
    plan = plan_epoch(spec, cursor, world, cursor.epoch)
    assert plan is not None

    def layout() -> ShardLayout:  # a layout none of whose groups is made yet
        return shard_layout(spec, world, plan.left, plan.t, plan.n_r, plan.cum)

    every = layout()
    for rank in range(world):
        local = np.arange(int(plan.n_r[rank]), dtype=np.int64)
        alone = layout().virtual(rank, local)  # its own group only
        assert np.array_equal(alone, every.virtual(rank, local))
        assert [every.owner(int(v)) for v in alone] == [(rank, m) for m in range(local.size)]
    assert sorted(np.concatenate([every.virtual(r, np.arange(int(plan.n_r[r]))) for r in range(world)])) == list(
        range(plan.t))
