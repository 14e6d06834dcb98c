"""Properties of the order engine: bijective orders, partitions that cover what the tail says, resizable cursors."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from _budget import examples, quick
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from croupier.core import feistel as _feistel
from croupier.core.order import Cursor, FixedPlan, bind, fixed_plan, fresh, order, part_bounds
from croupier.core.spec import PARTITIONS, TAILS, Spec

PROPS = settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])

# The shuffling kinds that work at any N (torch and bucket hold O(N) state and are tested up to 2**16).
SCALABLE = ("none", "feistel", "window", "feistel-rank", "window-rank")
KINDS = (*SCALABLE, "torch", "bucket")


def _spec(kind: str, n: int, seed: int = 0, buffer_size: int | None = None, **kw: Any) -> Spec:
    """A spec of permutation `kind`; the `-rank` kinds split into contiguous parts first (DGL)."""
    if kind == "bucket":
        rng = np.random.default_rng(n)
        lengths = rng.integers(0, max(2, n // 4), size=n)
        return Spec.with_lengths(lengths, seed=seed, buffer_size=buffer_size or n, pack_size=3, **kw)
    if kind.endswith("-rank"):
        kw = {"partition": "contiguous", **kw}
        return Spec(n=n, seed=seed, permutation=kind[: -len("-rank")], scope="rank", buffer_size=buffer_size, **kw)
    return Spec(n=n, seed=seed, permutation=kind, buffer_size=buffer_size, **kw)


def _order(spec: Spec, epoch: int, positions: np.ndarray, world: int = 3) -> np.ndarray:
    """The epoch's order at `positions`; `scope="rank"` specs are split for `world` ranks."""
    base = world if spec.scope == "rank" else 0
    return order(spec, epoch, positions, base)


# --------------------------------------------------------------------------- bijections


# make check (quick) stops at 1000 (31, 32, 33 stand beside a power of two there); make test also takes the sizes
# around 2**12 (seconds each) and 2**16.
EXHAUSTIVE_N = [1, 2, 3, 4, 5, 7, 8, 9, 31, 32, 33, 1000, *(() if quick() else (4095, 4096, 4097, 2**16 - 1, 2**16))]


@pytest.mark.parametrize("n", EXHAUSTIVE_N)
@pytest.mark.parametrize("kind", KINDS)
def test_every_permutation_is_a_bijection_exhaustively(kind: str, n: int) -> None:
    for epoch in (0, 1):
        # A window per index is the extreme case, but costs a Feistel key per index: small n only.
        for buffer_size in (None, max(1, n // 7), 1 if n <= 4096 else 61):
            spec = _spec(kind, n, seed=11, buffer_size=buffer_size)
            got = _order(spec, epoch, np.arange(n))
            assert np.array_equal(np.sort(got), np.arange(n)), f"{kind=} {n=} {epoch=} {buffer_size=}"


@given(
    n=st.integers(1, 2**16),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**63 - 1),
    epoch=st.integers(0, 2**20),
    windows=st.integers(1, 64),
    world=st.integers(1, 9),
)
@PROPS
def test_every_permutation_is_a_bijection(kind: str, n: int, seed: int, epoch: int, windows: int, world: int) -> None:
    buffer_size = -(-n // windows)
    spec = _spec(kind, n, seed=seed % 2**31 if kind == "torch" else seed, buffer_size=buffer_size)
    got = _order(spec, epoch, np.arange(n), world)
    assert np.array_equal(np.sort(got), np.arange(n))


def _sample_positions(n: int, rng: np.random.Generator, scattered: int) -> np.ndarray:
    """Distinct positions of [0, n): both ends, a consecutive run, and `scattered` random ones."""
    m = min(n, 4096)
    start = int(rng.integers(0, n - m + 1))
    parts = [np.array([0, n - 1]), np.arange(start, start + m), rng.integers(0, n, size=scattered)]
    return np.unique(np.concatenate(parts))


LARGE_N = [2**k + d for k in range(2, 41) for d in (-1, 0, 1)]


@pytest.mark.parametrize("n", LARGE_N)
def test_large_orders_are_injective_on_samples(n: int) -> None:
    rng = np.random.default_rng(n)
    for kind in SCALABLE:
        for buffer_size in (None, 1 + n // 5, 1000):
            # Each small window a sample touches costs a key derivation: fewer scattered samples there.
            pos = _sample_positions(n, rng, 4096 if buffer_size != 1000 else 256)
            spec = _spec(kind, n, seed=int(rng.integers(0, 2**63)), buffer_size=buffer_size)
            world = 7
            got = _order(spec, 3, pos, world)
            ctx = f"{kind=} {n=} {buffer_size=}"
            assert got.dtype == np.int64, ctx
            assert got.min() >= 0 and got.max() < n, ctx
            assert np.unique(got).size == pos.size, ctx
            # Shuffles stay inside their window: a rank's part (scope="rank") and buffer_size.
            bounds = part_bounds(spec, world if spec.scope == "rank" else 0)
            part = np.searchsorted(bounds, pos, side="right")
            assert np.array_equal(np.searchsorted(bounds, got, side="right"), part), ctx
            if kind.startswith("window") and buffer_size is not None:
                start = bounds[part - 1]
                assert np.array_equal((got - start) // buffer_size, (pos - start) // buffer_size), ctx


@given(
    bits=st.integers(1, 62),
    delta=st.integers(-1, 1),
    key=st.integers(0, 2**64 - 1),
    data=st.data(),
)
@PROPS
def test_feistel_permute_is_injective_on_large_domains(bits: int, delta: int, key: int, data: st.DataObject) -> None:
    n = min(2**62, max(1, 2**bits + delta))
    pos = np.unique(np.asarray(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=300)), dtype=np.int64))
    keys = _feistel.round_keys(key)
    got = _feistel.permute(pos, n, keys)
    assert got.dtype == np.int64 and got.shape == pos.shape
    assert got.min() >= 0 and got.max() < n
    assert np.unique(got).size == pos.size
    # Per-element keys (ROUNDS, len) that are all the same key give the same answer.
    per_elem = np.repeat(keys[:, None], pos.size, axis=1)
    assert np.array_equal(_feistel.permute(pos, n, per_elem), got)


def test_feistel_permute_is_a_bijection_near_powers_of_two() -> None:
    for k in range(1, 17):
        for n in (2**k - 1, 2**k, 2**k + 1):
            for key in (0, 1, 2**64 - 1, 0x9E3779B97F4A7C15):
                got = _feistel.permute(np.arange(n), n, _feistel.round_keys(key))
                assert np.array_equal(np.sort(got), np.arange(n)), f"{n=} {key=}"


# --------------------------------------------------------------------------- determinism


@given(
    n=st.integers(8, 5000),
    kind=st.sampled_from(("feistel", "torch", "window")),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 1000),
)
@settings(PROPS, derandomize=True)  # a true collision (about 1 in n!) must not make CI flaky
def test_different_epochs_give_different_orders(kind: str, n: int, seed: int, epoch: int) -> None:
    spec = _spec(kind, n, seed=seed, buffer_size=None if kind != "window" else max(8, n // 3))
    a = _order(spec, epoch, np.arange(n))
    b = _order(spec, epoch + 1, np.arange(n))
    assert not np.array_equal(a, b)


@given(
    n=st.integers(1, 3000),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 1000),
    windows=st.integers(1, 20),
    data=st.data(),
)
@PROPS
def test_same_inputs_give_the_same_output(kind: str, n: int, seed: int, epoch: int, windows: int, data: st.DataObject) -> None:
    buffer_size = -(-n // windows)
    full = _order(_spec(kind, n, seed, buffer_size), epoch, np.arange(n))
    # A fresh but equal spec, positions in any order, with repeats: the same map.
    pos = np.asarray(data.draw(st.lists(st.integers(0, n - 1), max_size=200)), dtype=np.int64)
    again = _order(_spec(kind, n, seed, buffer_size), epoch, pos)
    assert np.array_equal(again, full[pos])
    assert np.array_equal(_order(_spec(kind, n, seed, buffer_size), epoch, np.arange(n)), full)


def test_seeds_change_the_order() -> None:
    for kind in ("feistel", "torch", "window", "feistel-rank", "bucket"):
        a = _order(_spec(kind, 500, seed=1, buffer_size=100), 0, np.arange(500))
        b = _order(_spec(kind, 500, seed=2, buffer_size=100), 0, np.arange(500))
        assert not np.array_equal(a, b), kind


# --------------------------------------------------------------------------- partitions and tails


def _serve(p: FixedPlan, rank: int, upto: int | None = None) -> list[int]:
    """Indices of rank's batches 0, 1, ... (all of them, or the first `upto`)."""
    out: list[int] = []
    j = 0
    while (upto is None or j < upto) and (b := p.batch_indices(rank, j)) is not None:
        out.extend(b.tolist())
        j += 1
    return out


def _check_tail(tail: str, got: list[int], n: int, world: int, extra_repeats: int = 0) -> None:
    """What G1 says the indices of one epoch cover, for `tail` and the final world size."""
    c = Counter(got)
    assert all(0 <= i < n for i in c), got
    missing = n - len(c)
    repeats = len(got) - len(c)
    if tail == "uneven":
        assert missing == 0 and repeats == 0, (missing, repeats)
    elif tail == "drop":
        assert repeats == 0 and missing < world, (missing, repeats)
    else:  # pad, pad_last
        assert missing == 0 and repeats < world + extra_repeats, (missing, repeats)


@given(
    n=st.integers(1, 400),
    world=st.integers(1, 12),
    batch_size=st.integers(1, 9),
    partition=st.sampled_from(PARTITIONS),
    tail=st.sampled_from(TAILS),
    kind=st.sampled_from(("none", "feistel", "window")),
    epoch=st.integers(0, 5),
)
@PROPS
def test_partitions_cover_what_the_tail_says(
    n: int, world: int, batch_size: int, partition: str, tail: str, kind: str, epoch: int
) -> None:
    spec = _spec(kind, n, seed=5, buffer_size=7, partition=partition, tail=tail, batch_size=batch_size)
    p = fixed_plan(spec, fresh(spec, epoch), world)
    per_rank = [_serve(p, r) for r in range(world)]
    for r, got in enumerate(per_rank):
        assert len(got) == p.samples(r), (r, len(got), p.samples(r))
    flat = [i for got in per_rank for i in got]
    _check_tail(tail, flat, n, world)
    if tail in ("uneven", "drop"):
        assert len(set(flat)) == len(flat)  # disjoint across ranks
    if tail != "uneven" or partition != "chunked":
        sizes = [len(g) for g in per_rank]
        assert max(sizes) - min(sizes) <= (0 if tail != "uneven" else 1), sizes
    full = order(spec, epoch, np.arange(n))
    extra = Counter(flat) - Counter(range(n))
    if tail == "pad_last":  # d9d: repeat the order's last element
        assert set(extra) <= {int(full[-1])}
    elif tail == "pad":  # torch: repeat from the start of the order (cyclically when n < world)
        assert sorted(extra.elements()) == sorted(np.resize(full, len(flat) - n).tolist())


def test_strided_partition_is_round_robin() -> None:
    spec = Spec(n=10, permutation="none", tail="uneven")
    p = fixed_plan(spec, fresh(spec, 0), 3)
    assert [_serve(p, r) for r in range(3)] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


# --------------------------------------------------------------------------- resize


def _consumed(p: FixedPlan, j: int) -> set[int]:
    """Real order positions (no padding) that the ranks of `p` consumed in their first j batches."""
    out: set[int] = set()
    b = p.spec.batch_size
    for r in range(p.world):
        local = np.arange(min(j * b, int(p.samples(r))), dtype=np.int64)
        v = p.virtual(r, local)
        out.update(p.positions(v[v < p.left]).tolist())
    return out


def _padding_served(p: FixedPlan, j: int) -> int:
    b = p.spec.batch_size
    return sum(int((p.virtual(r, np.arange(min(j * b, p.samples(r)))) >= p.left).sum()) for r in range(p.world))


@given(
    n=st.integers(1, 300),
    world=st.integers(1, 10),
    new_world=st.integers(1, 10),
    batch_size=st.integers(1, 8),
    partition=st.sampled_from(PARTITIONS),
    tail=st.sampled_from(TAILS),
    kind=st.sampled_from(("none", "feistel", "torch", "window", "feistel-rank", "window-rank")),
    epoch=st.integers(0, 3),
    frac=st.floats(0, 1),
)
@PROPS
def test_advance_then_any_world_covers_exactly_what_is_left(
    n: int, world: int, new_world: int, batch_size: int, partition: str, tail: str, kind: str, epoch: int, frac: float
) -> None:
    if kind.endswith("-rank") and partition == "strided":
        partition = "contiguous"
    spec = _spec(kind, n, seed=9, buffer_size=5, partition=partition, tail=tail, batch_size=batch_size)
    cursor = bind(spec, fresh(spec, epoch), world)
    p = fixed_plan(spec, cursor, world)
    j = int(frac * int(p.nb_r.max(initial=0)))
    assume(not p.done(j))
    first = [i for r in range(world) for i in _serve(p, r, j)]
    nxt = p.advance(j)
    assert nxt.epoch == epoch and nxt.base_world == cursor.base_world
    left = {x for a, b in nxt.remaining for x in range(a, b)}
    assert left == set(range(n)) - _consumed(p, j)
    # Resize: deal what is left to any world size and serve it to the end.
    q = fixed_plan(spec, nxt, new_world)
    second = [i for r in range(new_world) for i in _serve(q, r)]
    _check_tail(tail, first + second, n, new_world, extra_repeats=_padding_served(p, j))
    if q.nb_r.max() > 0:  # (a plan with no batch at all, e.g. "drop" with n < world, has no end to reach)
        assert q.advance(int(q.nb_r.max())) == fresh(spec, epoch + 1)


@given(
    n=st.integers(1, 200),
    worlds=st.lists(st.integers(1, 8), min_size=2, max_size=5),
    batch_size=st.integers(1, 4),
    partition=st.sampled_from(PARTITIONS),
    kind=st.sampled_from(("none", "feistel", "torch")),
    steps=st.lists(st.integers(1, 5), min_size=4, max_size=4),
)
@PROPS
def test_many_resizes_serve_every_index_once(
    n: int, worlds: list[int], batch_size: int, partition: str, kind: str, steps: list[int]
) -> None:
    spec = _spec(kind, n, seed=4, partition=partition, tail="uneven", batch_size=batch_size)
    cursor: Cursor = fresh(spec, 2)
    got: list[int] = []
    for world, j in zip(worlds, steps):
        p = fixed_plan(spec, cursor, world)
        if p.done(j):
            break
        got += [i for r in range(world) for i in _serve(p, r, j)]
        cursor = p.advance(j)
    else:
        p = fixed_plan(spec, cursor, worlds[-1])
    if cursor.epoch == 2:
        got += [i for r in range(p.world) for i in _serve(p, r)]
    assert sorted(got) == list(range(n))


@settings(max_examples=examples(150), deadline=None)
@given(n=st.integers(2, 2**62), seed=st.integers(0, 2**32), data=st.data())
def test_feistel_scalar_path_equals_vector_path(n: int, seed: int, data: st.DataObject) -> None:
    """Inputs of at most _feistel.SMALL positions take a pure-Python path; it is the same bijection."""
    from croupier.core import feistel as _feistel

    positions = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=_feistel.SMALL + 1, max_size=64)), dtype=np.int64)
    keys = _feistel.round_keys(_feistel.derive_key(seed, 7))
    vector = _feistel.permute(positions, n, keys)
    scalar = np.concatenate([_feistel.permute(positions[i : i + 3], n, keys) for i in range(0, positions.size, 3)])
    assert vector.tolist() == scalar.tolist()
