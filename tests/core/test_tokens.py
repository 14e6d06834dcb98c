"""Token-budget plans: every index dealt as the tail says, within budget, in equal steps, lazily, through resumes."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from croupier.core.errors import OutOfRange
from croupier.core.order import Cursor, fresh, order, validate_cursor
from croupier.core.registry import plan_epoch as token_plan_epoch
from croupier.core.spec import Spec
from croupier.core.tokens import TokenPlan, token_plan
from tests._budget import examples

PROPS = settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
TAILS = ("uneven", "drop", "pad")
COSTS = ("sum", "padded")


@st.composite
def token_specs(draw: Any, tails: tuple[str, ...] = TAILS) -> Spec:
    """A small token-budget spec: lengths in [1, max_tokens], any window, cost and tail."""
    n = draw(st.integers(1, 400))
    max_tokens = draw(st.integers(1, 64))
    seed = draw(st.integers(0, 2**63 - 1))
    lengths = np.random.default_rng(seed % 2**32).integers(1, max_tokens + 1, size=n)
    if draw(st.booleans()):  # many samples at the budget: singleton batches
        lengths[: draw(st.integers(0, n))] = max_tokens
    return Spec.with_lengths(
        lengths,
        seed=seed,
        max_tokens=max_tokens,
        cost=draw(st.sampled_from(COSTS)),
        tail=draw(st.sampled_from(tails)),
        token_window=draw(st.integers(1, 128)),
        permutation=draw(st.sampled_from(("feistel", "none", "window"))),
        buffer_size=draw(st.integers(1, 64)),
    )


def _cost(spec: Spec, idx: np.ndarray) -> int:
    lens = spec.sort_keys[idx]
    return int(lens.sum() if spec.cost == "sum" else lens.max() * len(lens))


def _batches(p: TokenPlan, rank: int, first: int, count: int) -> list[np.ndarray]:
    idx, sizes = p.lease(rank, first, count)
    assert sum(sizes) == len(idx)
    return np.split(idx, np.cumsum(sizes)[:-1]) if sizes else []


def _deal_all(p: TokenPlan) -> list[list[np.ndarray]]:
    """Every rank's batches of the plan, leased in lockstep chunks of 3 steps."""
    out: list[list[np.ndarray]] = [[] for _ in range(p.world)]
    first = 0
    while True:
        got = [_batches(p, r, first, 3) for r in range(p.world)]
        for r, b in enumerate(got):
            out[r] += b
        if not any(got):
            return out
        first += 3


def _check_tail(spec: Spec, epoch: int, world: int, dealt: np.ndarray, universe: int) -> None:
    """`dealt` (indices) against the tail's promise over `universe` indices."""
    c = Counter(dealt.tolist())
    if spec.tail == "uneven":
        assert len(dealt) == universe and len(c) == universe, "every index exactly once"
    elif spec.tail == "drop":
        assert max(c.values(), default=1) == 1, "no index twice"
        assert universe - len(c) < world, "fewer than W dropped"
    else:
        assert len(c) == universe, "every index at least once"
        repeats = len(dealt) - universe
        assert repeats < world
        # the repeats are positions 0, 1, ... of the epoch's order, as torch pads
        extra = Counter({i: k - 1 for i, k in c.items() if k > 1})
        assert extra == Counter(order(spec, epoch, np.arange(repeats) % spec.n).tolist())


# --------------------------------------------------------------------------- one plan


@given(spec=token_specs(), world=st.integers(1, 8), epoch=st.integers(0, 5))
@PROPS
def test_a_fresh_epoch_is_dealt_as_the_tail_says_within_budget(spec: Spec, world: int, epoch: int) -> None:
    p = token_plan(spec, fresh(spec, epoch), world)
    dealt = _deal_all(p)
    nb = p.nb_r
    for r in range(world):
        assert len(dealt[r]) == nb[r] == p.steps(r) == p.known_steps(r)
        assert sum(len(b) for b in dealt[r]) == p.samples(r)
        assert all(len(b) >= 1 and _cost(spec, b) <= spec.max_tokens for b in dealt[r])
    if spec.tail == "uneven":
        assert nb.max() - nb.min() <= 1 and np.all(np.diff(nb) <= 0), "ranks differ by one step at most, the last ones short"
    else:
        assert nb.min() == nb.max(), "every rank has the same number of steps"
    _check_tail(spec, epoch, world, np.concatenate([b for bs in dealt for b in bs] or [np.zeros(0, np.int64)]), spec.n)


@given(spec=token_specs(), world=st.integers(1, 8), cuts=st.lists(st.integers(1, 7), min_size=1, max_size=6))
@PROPS
def test_leases_agree_however_they_are_cut(spec: Spec, world: int, cuts: list[int]) -> None:
    whole = token_plan(spec, fresh(spec, 1), world)
    chunked = token_plan(spec, fresh(spec, 1), world)
    for r in range(world):
        first, parts, k = 0, [], 0
        while got := _batches(chunked, r, first, cuts[k % len(cuts)]):
            parts += got
            first, k = first + cuts[k % len(cuts)], k + 1
        ref = _batches(whole, r, 0, 10**9)
        assert len(parts) == len(ref) and all(np.array_equal(a, b) for a, b in zip(parts, ref))
        assert chunked.batch_sizes(r, 0, 10**9) == [len(b) for b in ref]
        assert _batches(chunked, r, len(ref), 5) == []


@given(spec=token_specs(), world=st.integers(1, 8))
@PROPS
def test_done_and_advance_at_the_ends(spec: Spec, world: int) -> None:
    p = token_plan(spec, fresh(spec, 2), world)
    top = int(p.nb_r.max())
    assert p.advance(0) == p.cursor  # as FixedPlan.advance: nothing taken, nothing moves (even with no steps at all)
    assert p.done(top) and p.advance(max(top, 1)) == fresh(spec, 3)
    for j in range(top):
        assert not p.done(j)
        validate_cursor(spec, p.advance(j))


def test_the_last_round_is_recut_so_every_rank_steps_within_budget() -> None:
    # 10 samples of length 1 in one batch of budget 10: one batch for 4 ranks, cut 3 + 3 + 2 + 2.
    spec = Spec.with_lengths([1] * 10, max_tokens=10, tail="drop", permutation="none")
    p = token_plan(spec, fresh(spec, 0), 4)
    assert [p.batch_sizes(r, 0, 5) for r in range(4)] == [[3], [3], [2], [2]]
    # 3 samples for 4 ranks: pad repeats position 0 of the order, drop takes no step, uneven leaves rank 3 out.
    for tail, steps in (("pad", [1, 1, 1, 1]), ("drop", [0, 0, 0, 0]), ("uneven", [1, 1, 1, 0])):
        spec = Spec.with_lengths([1, 1, 1], max_tokens=10, tail=tail, permutation="none")
        p = token_plan(spec, fresh(spec, 0), 4)
        assert p.nb_r.tolist() == steps
    spec = Spec.with_lengths([1, 1, 1], max_tokens=10, tail="pad", permutation="none")
    assert token_plan(spec, fresh(spec, 0), 4).lease(3, 0, 1)[0].tolist() == [0]


def test_pieces_of_the_last_round_never_straddle_two_batches() -> None:
    # Two batches [8] and [1, 1, ..., 1] (budget 9) for 3 ranks: pieces inside each batch, so none costs over 9.
    spec = Spec.with_lengths([8] + [1] * 9, max_tokens=9, cost="sum", tail="uneven", permutation="none")
    p = token_plan(spec, fresh(spec, 0), 3)
    for r in range(3):
        for b in _batches(p, r, 0, 9):
            assert _cost(spec, b) <= 9


# --------------------------------------------------------------------------- resumes


@given(
    spec=token_specs(),
    worlds=st.lists(st.integers(1, 8), min_size=2, max_size=4),
    fractions=st.lists(st.floats(0, 1), min_size=3, max_size=3),
)
@PROPS
def test_resume_chains_deal_every_index_as_the_tail_says(spec: Spec, worlds: list[int], fractions: list[float]) -> None:
    cursor = fresh(spec, 0)
    consumed: list[np.ndarray] = []
    for world, fraction in zip(worlds[:-1], fractions):
        p = token_plan(spec, cursor, world)
        j = int(fraction * (int(p.nb_r.max()) + 1))
        stage = [b for r in range(world) for b in _batches(p, r, 0, j)]
        consumed += stage
        cursor = p.advance(j)
        validate_cursor(spec, cursor)
        if cursor.epoch == 1:  # the chain finished the epoch
            assert p.done(j) and cursor == fresh(spec, 1)
            break
        assert (j == 0 or not p.done(j)) and cursor.left == p.left - sum(len(b) for b in stage)
    else:
        last = token_plan(spec, cursor, worlds[-1])
        for bs in _deal_all(last):
            consumed += bs
        world = worlds[-1]
    _check_tail(spec, 0, world, np.concatenate(consumed or [np.zeros(0, np.int64)]), spec.n)


@given(spec=token_specs(tails=("uneven",)), world=st.integers(1, 8), j=st.integers(1, 40), world2=st.integers(1, 8))
@PROPS
def test_advance_removes_exactly_the_positions_of_the_first_j_steps(spec: Spec, world: int, j: int, world2: int) -> None:
    p = token_plan(spec, fresh(spec, 0), world)
    if p.done(j):
        return
    taken = sum(sum(p.batch_sizes(r, 0, j)) for r in range(world))
    c = p.advance(j)
    assert c.left == spec.n - taken
    after = np.concatenate([b for bs in _deal_all(token_plan(spec, c, world2)) for b in bs])
    before = np.concatenate([p.lease(r, 0, j)[0] for r in range(world)])
    assert np.array_equal(np.sort(np.concatenate([before, after])), np.arange(spec.n))
    pos = {int(x) for a, b in c.remaining for x in range(a, b)}
    assert set(order(spec, 0, np.array(sorted(pos), dtype=np.int64)).tolist()) == set(after.tolist())


# --------------------------------------------------------------------------- laziness


def _long_tailed(n: int, max_tokens: int = 8192, seed: int = 1) -> np.ndarray:
    lens = np.random.default_rng(seed).lognormal(np.log(200), 1.0, n)
    out: np.ndarray = np.clip(lens, 1, max_tokens).astype(np.int64)
    return out


@pytest.fixture(scope="module")
def big_spec() -> Spec:
    return Spec.with_lengths(_long_tailed(10**6), max_tokens=8192, tail="pad", token_window=4096)


def test_a_plan_packs_only_what_its_first_leases_need(big_spec: Spec) -> None:
    p = token_plan(big_spec, fresh(big_spec, 0), 8)
    assert p._packs == 0 and p.known_steps(0) is None
    for r in range(8):
        idx, sizes = p.lease(r, 0, 4)
        assert len(sizes) == 4
    assert 1 <= p._packs <= 2
    assert p.known_steps(0) is None and p._packs <= 2, "known_steps never packs"
    # a resume from a mid-epoch state packs as little
    c = p.advance(3)
    q = token_plan(big_spec, c, 5)
    assert q._packs == 0
    q.lease(4, 0, 1)
    assert q._packs <= 2


def test_a_round_across_windows_packs_the_next_window_only() -> None:
    # Windows of 4 samples of 1 incarnation, budget 2: 2 batches a window; a round of W = 3 spans 2 windows.
    spec = Spec.with_lengths([1] * 1000, max_tokens=2, token_window=4, tail="uneven")
    p = token_plan(spec, fresh(spec, 0), 3)
    p.lease(0, 0, 1)
    assert p._packs == 2


def test_lockstep_leases_pack_every_window_once(big_spec: Spec) -> None:
    spec = Spec.with_lengths(big_spec.sort_keys[:100_000], max_tokens=8192, tail="pad")
    p = token_plan(spec, fresh(spec, 0), 8)
    first = 0
    while any(p.batch_sizes(r, first, 64) for r in range(8)):
        first += 64
    assert p._packs == p.windows == 25
    assert p.known_steps(0) is not None and p.known_steps(0) == p.steps(0) and p._packs == 25


# --------------------------------------------------------------------------- fill


@pytest.mark.parametrize(("cost", "floor"), [("sum", 0.95), ("padded", 0.93)])
def test_fill_on_a_long_tailed_distribution(cost: str, floor: float) -> None:
    # lognormal lengths, median 200, clipped to [1, 8192]: measured fill 0.990 (sum) and 0.940 (padded)
    spec = Spec.with_lengths(_long_tailed(100_000), max_tokens=8192, cost=cost, tail="uneven", token_window=4096)
    p = token_plan(spec, fresh(spec, 0), 8)
    fills = [_cost(spec, b) / 8192 for bs in _deal_all(p) for b in bs]
    assert float(np.mean(fills)) >= floor


# --------------------------------------------------------------------------- determinism and caching


@given(spec=token_specs(), world=st.integers(1, 8))
@settings(max_examples=examples(40), deadline=None)
def test_the_same_plan_twice_deals_the_same(spec: Spec, world: int) -> None:
    a, b = token_plan(spec, fresh(spec, 3), world), token_plan(spec, fresh(spec, 3), world)
    for r in range(world):
        x, y = a.lease(r, 0, 10**6), b.lease(r, 0, 10**6)
        assert np.array_equal(x[0], y[0]) and x[1] == y[1]
    j = int(a.nb_r.max()) // 2
    assert a.advance(j) == b.advance(j)


def test_token_plan_epoch_is_cached_and_refuses_earlier_epochs() -> None:
    spec = Spec.with_lengths([3, 1, 4, 1, 5, 9, 2, 6], max_tokens=10)
    start = Cursor(epoch=2, remaining=((3, 8),))
    p = token_plan_epoch(spec, start, 2, 2)
    assert p is token_plan_epoch(spec, start, 2, 2)
    assert p is not None and p.cursor == start
    nxt = token_plan_epoch(spec, start, 2, 3)
    assert nxt is not None and nxt.cursor == fresh(spec, 3)
    assert token_plan_epoch(spec, fresh(spec, 2), 2, 1) is None
    with pytest.raises(OutOfRange):
        token_plan_epoch(spec, start, 2, 1)


def test_plans_refuse_what_they_cannot_deal() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        token_plan(Spec(n=4), fresh(Spec(n=4), 0), 2)
    spec = Spec.with_lengths([1, 2], max_tokens=2)
    with pytest.raises(ValueError, match="world"):
        token_plan(spec, fresh(spec, 0), 0)
    with pytest.raises(ValueError, match="rank"):
        token_plan(spec, fresh(spec, 0), 2).lease(2, 0, 1)


def test_a_samplers_first_batch_packs_one_window_not_the_epoch(server) -> None:  # type: ignore[no-untyped-def]
    """Through the sampler and its coordinator, the first batch packs what one lease needs (the epoch is 50 windows)."""
    from croupier.client import DistributedBatchSampler

    n = 50 * 256
    lengths = np.random.default_rng(0).integers(1, 100, n)
    s = DistributedBatchSampler(n, num_replicas=1, rank=0, address=server.address, job="first", incarnation="t",
                                lengths=lengths, max_tokens=400, token_window=256, lease_ahead=4)
    try:
        next(iter(s))
        p = s._epoch_plan(s._progress.epoch)
        assert p is not None and p._packs <= 2, p._packs  # type: ignore[attr-defined]
    finally:
        s.close()
