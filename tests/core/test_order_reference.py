"""The spdl, d9d and DGL behaviours croupier reproduces (their samplers' documented rules, restated in each test), checked against the order engine."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from _sim import batches_of as _batches

from croupier.core.order import bind, fixed_plan, fresh, order
from croupier.core.spec import Spec


def _ranks(spec: Spec, world: int, epoch: int = 0) -> list[list[int]]:
    """Every rank's indices of a fresh epoch, in order."""
    p = fixed_plan(spec, bind(spec, fresh(spec, epoch), world), world)
    return [[i for b in _batches(p, r) for i in b] for r in range(world)]




# --------------------------------------------------------------------------- spdl


def test_spdl_drop_last_distributed_round_true() -> None:
    spec = Spec(n=11, permutation="none", partition="strided", tail="drop")
    assert _ranks(spec, 4) == [[0, 4], [1, 5], [2, 6], [3, 7]]  # 8, 9, 10 are dropped


def test_spdl_drop_last_distributed_round_false() -> None:
    spec = Spec(n=11, permutation="none", partition="strided", tail="uneven")
    assert _ranks(spec, 4) == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7]]  # all indices covered


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 11, 100, 101])
def test_spdl_is_range_rank_n_world(n: int, world: int) -> None:
    # The doc's rule: range(rank, N, world_size), the last incomplete round dropped or kept.
    keep = n // world * world
    for tail, end in (("drop", keep), ("uneven", n)):
        spec = Spec(n=n, permutation="none", partition="strided", tail=tail)
        assert _ranks(spec, world) == [list(range(r, end, world)) for r in range(world)]


# --------------------------------------------------------------------------- d9d ShardedDataset


def test_d9d_shard_indexing_mode_sequential() -> None:
    spec = Spec(n=14, permutation="none", partition="strided", tail="uneven")
    assert _ranks(spec, 4) == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10], [3, 7, 11]]


def test_d9d_shard_indexing_mode_chunked() -> None:
    spec = Spec(n=14, permutation="none", partition="chunked", tail="uneven")
    assert _ranks(spec, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13]]


class _D9dSharded:
    """d9d's ``ShardedDataset`` index arithmetic (``__len__``, ``__getitem__``) as documented, over range(n)."""

    def __init__(self, n: int, total_shards: int, current_shard: int, mode: str, pad: bool) -> None:
        self.n, self.total, self.current, self.mode, self.pad = n, total_shards, current_shard, mode, pad

    def _base_index_unsafe(self, index: int) -> int:
        if self.mode == "sequential":
            return index * self.total + self.current
        ceil_len = math.ceil(self.n / self.total)
        return ceil_len * self.current + index

    def __getitem__(self, index: int) -> int:
        base = self._base_index_unsafe(index)
        return self.n - 1 if base >= self.n else base

    def __len__(self) -> int:
        ceil_len = math.ceil(self.n / self.total)
        if self.pad:
            return ceil_len
        remainder = self.n % self.total
        if self.mode == "sequential":
            full = self.n // self.total
            return full + 1 if self.current < remainder else full
        if self.current != self.total - 1 or remainder == 0:
            return ceil_len
        # NOTE: negative when the last shard starts past the end, e.g. n=5, total=4 gives
        # ceil_len=2 and 2 - (4 - 1) = -1 (Python's len() would raise), while shard 2 reads
        # [4, 4] past the end. croupier gives the shards past the end nothing (here 2, 2, 1, 0
        # items, every index once); see test_d9d_chunked_where_d9d_has_no_answer.
        return ceil_len - (self.total - remainder)

    def items(self) -> list[int]:
        return [self[i] for i in range(self.__len__())]


def _d9d_spec(n: int, mode: str, pad: bool) -> Spec:
    partition = "strided" if mode == "sequential" else "chunked"
    return Spec(n=n, permutation="none", partition=partition, tail="pad_last" if pad else "uneven")


@pytest.mark.parametrize("mode", ["sequential", "chunked"])
@pytest.mark.parametrize("pad", [False, True])
def test_d9d_sharded_dataset_matches_its_formula(mode: str, pad: bool) -> None:
    compared = 0
    for n in range(1, 80):
        for world in range(1, 12):
            shards = [_D9dSharded(n, world, r, mode, pad) for r in range(world)]
            if any(s.__len__() < 0 for s in shards):
                continue  # d9d's formula has no answer here (see _D9dSharded.__len__)
            got = _ranks(_d9d_spec(n, mode, pad), world)
            assert got == [s.items() for s in shards], f"{n=} {world=} {mode=} {pad=}"
            compared += 1
    assert compared > 600  # the skip above must stay the exception


def test_d9d_chunked_where_d9d_has_no_answer() -> None:
    # Where d9d's unpadded chunked __len__ is negative for the last shard (n=5, W=4: 2, 2, 2, -1
    # with shard 2 reading [4, 4] past the end), croupier deals blocks of ceil(n / W) until the
    # data runs out and leaves the shards past the end empty (2, 2, 1, 0): every index once.
    undefined = 0
    for n in range(1, 80):
        for world in range(1, 12):
            if _D9dSharded(n, world, world - 1, "chunked", False).__len__() >= 0:
                continue
            undefined += 1
            got = _ranks(_d9d_spec(n, "chunked", False), world)
            c = math.ceil(n / world)
            assert [len(g) for g in got] == [max(0, min(c, n - r * c)) for r in range(world)]
            assert [i for g in got for i in g] == list(range(n))
    assert undefined > 0
    assert _ranks(_d9d_spec(5, "chunked", False), 4) == [[0, 1], [2, 3], [4], []]


def test_d9d_padding_repeats_the_orders_last_element() -> None:
    # With a shuffle in front, "the last element" is the last of the epoch's order.
    for partition in ("strided", "chunked"):
        spec = Spec(n=10, seed=3, permutation="feistel", partition=partition, tail="pad_last")
        last = int(order(spec, 0, np.array([9]))[0])
        got = _ranks(spec, 4)
        flat = [i for g in got for i in g]
        assert [len(g) for g in got] == [3, 3, 3, 3]
        assert sorted(flat) == sorted([*range(10), last, last])


# --------------------------------------------------------------------------- DGL DistributedItemSampler


def _dgl(drop_last: bool, drop_uneven_inputs: bool, shuffle: bool = False, seed: int = 0) -> Spec:
    return Spec(
        n=15,
        seed=seed,
        permutation="feistel" if shuffle else "none",
        scope="rank" if shuffle else "global",
        partition="contiguous",
        tail="uneven",
        batch_size=2,
        drop_last_batch=drop_last,
        even_batches=drop_uneven_inputs,
    )


def _dgl_batches(spec: Spec, epoch: int = 0) -> list[list[list[int]]]:
    p = fixed_plan(spec, bind(spec, fresh(spec, epoch), 4), 4)
    return [_batches(p, r) for r in range(4)]


DGL_EXAMPLES = [
    # (drop_last, drop_uneven_inputs) -> each replica's batches, as printed in the doc.
    ((False, False), [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]], [[12, 13], [14]]]),
    ((True, False), [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]], [[12, 13]]]),
    ((False, True), [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]], [[12, 13], [14]]]),
    ((True, True), [[[0, 1]], [[4, 5]], [[8, 9]], [[12, 13]]]),
]


@pytest.mark.parametrize(("flags", "want"), DGL_EXAMPLES)
def test_dgl_deterministic_examples(flags: tuple[bool, bool], want: list[list[list[int]]]) -> None:
    assert _dgl_batches(_dgl(*flags)) == want


@pytest.mark.parametrize(("flags", "counts"), [((True, False), [2, 2, 2, 1]), ((True, True), [1, 1, 1, 1])])
def test_dgl_shuffled_examples(flags: tuple[bool, bool], counts: list[int]) -> None:
    # The doc's shuffled outputs are "one possible output"; what holds is that each replica's
    # batches come from its own part. (Its first example shows one batch for replica 2, whose
    # 4 items make two full batches; croupier gives two, as the unshuffled examples do.)
    parts = [set(range(0, 4)), set(range(4, 8)), set(range(8, 12)), set(range(12, 15))]
    orders = set()
    for seed in range(5):
        got = _dgl_batches(_dgl(*flags, shuffle=True, seed=seed))
        assert [len(g) for g in got] == counts
        for batches, part in zip(got, parts):
            assert all(len(b) == 2 and set(b) <= part for b in batches)
        orders.add(str(got))
    assert len(orders) > 1  # it does shuffle


@pytest.mark.parametrize("partition", ["contiguous", "chunked"])
@pytest.mark.parametrize("permutation", ["feistel", "window"])
def test_dgl_split_first_then_shuffle(partition: str, permutation: str) -> None:
    for n in (1, 3, 15, 100, 1001):
        for world in (1, 2, 4, 7):
            unshuffled = _ranks(Spec(n=n, permutation="none", partition=partition, tail="uneven"), world)
            shuffled = []
            for epoch in range(3):
                spec = Spec(n=n, seed=1, permutation=permutation, scope="rank", partition=partition, tail="uneven",
                            batch_size=16)
                got = _ranks(spec, world, epoch)
                assert [sorted(g) for g in got] == unshuffled, f"{n=} {world=} {epoch=}"
                shuffled.append(got)
            if n >= 100:
                assert shuffled[0] != unshuffled and shuffled[0] != shuffled[1]


def test_dgl_buffer_size_shuffles_within_windows_of_the_part() -> None:
    for n, world, buffer_size in ((15, 4, 2), (100, 3, 7), (1001, 4, 64), (1001, 7, 1000)):
        spec = Spec(n=n, seed=2, permutation="window", scope="rank", partition="contiguous", tail="uneven",
                    buffer_size=buffer_size)
        unshuffled = _ranks(Spec(n=n, permutation="none", partition="contiguous", tail="uneven"), world)
        moved = False
        for got, part in zip(_ranks(spec, world), unshuffled):
            for k in range(0, len(part), buffer_size):
                window = part[k : k + buffer_size]
                assert sorted(got[k : k + buffer_size]) == window, f"{n=} {world=} {buffer_size=} {k=}"
                moved |= got[k : k + buffer_size] != window
        assert moved


# --------------------------------------------------------------------------- d9d BufferSortedDataset


def _d9d_buffer_sorted(keys: list[int], buffer_size: int, pack_size: int, seed: int) -> list[list[tuple[int, ...]]]:
    """d9d's five steps, window by window: the packs of each window in its (shuffled) order."""
    rng = random.Random(seed ^ 0x105E7)
    n = len(keys)
    out = []
    for start in range(0, n, buffer_size):
        base_idx = list(range(start, min(start + buffer_size, n)))  # 1. a range of buffer_size
        local = sorted(range(len(base_idx)), key=lambda i: keys[base_idx[i]])  # 2. sort by key
        packs = [local[i : i + pack_size] for i in range(0, len(local), pack_size)]  # 3. packs
        rng.shuffle(packs)  # 4. shuffle the packs
        out.append([tuple(base_idx[i] for i in pack) for pack in packs])  # 5. flatten (per pack here)
    return out


@pytest.mark.parametrize("seed", [0, 42])
def test_d9d_bucketing_makes_the_same_packs(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cases = 0
    for n in (1, 2, 5, 17, 64, 100, 257):
        for buffer_size in (1, 3, 10, 32, 100, 300):
            for pack_size in (1, 2, 4, 7):
                keys = rng.integers(0, 6, size=n).tolist()  # few distinct keys: ties must break by index
                want = _d9d_buffer_sorted(keys, buffer_size, pack_size, seed)
                spec = Spec.with_lengths(keys, seed=seed, buffer_size=buffer_size, pack_size=pack_size)
                for epoch in (0, 1):
                    got = order(spec, epoch, np.arange(n)).tolist()
                    ctx = f"{n=} {buffer_size=} {pack_size=} {epoch=}"
                    for w, packs in enumerate(want):
                        window = got[w * buffer_size : (w + 1) * buffer_size]
                        assert sorted(window) == sorted(i for p in packs for i in p), ctx
                        where = {i: k for k, i in enumerate(window)}
                        # Each of d9d's packs is a contiguous run, in d9d's within-pack order.
                        for pack in packs:
                            k = where[pack[0]]
                            assert tuple(window[k : k + len(pack)]) == pack, ctx
                cases += 1
    assert cases > 100


def test_bucketing_is_random_access_and_reseeded_per_window() -> None:
    keys = np.random.default_rng(1).integers(0, 50, size=1000)
    spec = Spec.with_lengths(keys, seed=7, buffer_size=100, pack_size=4)
    full = order(spec, 3, np.arange(1000))
    # Any window on its own, without computing the ones before it, gives the same indices.
    for w in (9, 0, 5):
        assert np.array_equal(order(spec, 3, np.arange(w * 100, w * 100 + 100)), full[w * 100 : w * 100 + 100])
    # Packs are reshuffled from epoch to epoch, and every index is served once.
    assert not np.array_equal(order(spec, 4, np.arange(1000)), full)
    assert sorted(full.tolist()) == list(range(1000))
    # Within a pack, keys are sorted (the point of bucketing).
    for w in range(10):
        window = full[w * 100 : w * 100 + 100]
        for k in range(0, 100, 4):
            pack_keys = keys[window[k : k + 4]]
            assert np.all(np.diff(pack_keys) >= 0)
