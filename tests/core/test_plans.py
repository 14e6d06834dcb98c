"""The plan interface: every way of dealing (a toy one defined in a test too) keeps the EpochPlan contract,
and a plan the coordinator deals its Dealer's; the registry picks the plan."""

from __future__ import annotations

import dataclasses
import pathlib
import pickle
from collections.abc import Iterator

import numpy as np
import pytest
from _reverse_kind import reverse_registered
from hypothesis import given, settings
from hypothesis import strategies as st

from croupier.core.cursor import Cursor, fresh
from croupier.core.deals import EpochDeals
from croupier.core.errors import OutOfRange
from croupier.core.order import order
from croupier.core.plan import EpochPlan
from croupier.core.registry import KINDS, PlanKind, kind_of, plan_epoch
from croupier.core.spec import Spec
from tests._budget import examples

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: Every way of dealing the contract runs on: the registered ones and the toy kind defined in a test
#: (tests/_reverse_kind.py), registered for this module's tests.
NAMES = ["dynamic", "fixed", "reverse", "shards", "shards-dynamic", "tokens"]


@pytest.fixture(autouse=True, scope="module")
def _toy_kind() -> Iterator[None]:
    with reverse_registered():
        yield


def _spec(kind: str, n: int, batch: int, seed: int) -> Spec:
    lengths = (np.arange(n) * 7919 + seed) % 50 + 1
    if kind == "fixed":
        return Spec(n=n, seed=seed, batch_size=batch, tail="uneven")
    if kind == "tokens":
        return Spec.with_lengths(lengths, seed=seed, max_tokens=120, tail="uneven", token_window=64)
    if kind.startswith("shards"):  # shards of 1 to 13 samples, windows of 3, reader groups of 2
        sizes = [1 + (i * 7 + seed) % 13 for i in range(n)]
        cut = np.searchsorted(np.cumsum(sizes), n)
        sizes = sizes[:cut] + [n - sum(sizes[:cut])] if n - sum(sizes[:cut]) else sizes[:cut]
        return Spec.with_shards(sizes, seed=seed, batch_size=batch, tail="uneven", shard_window=3, lanes=4, reader_group=2,
                                dealing="dynamic" if kind == "shards-dynamic" else "static")
    return Spec(n=n, seed=seed, batch_size=batch, tail="uneven", dealing=kind)


def _grant(p: EpochPlan, rank: int, first: int, count: int, book: EpochDeals) -> object:
    """The grant the coordinator answers: for a plan it deals, after its dealer's deal is recorded in `book`."""
    d = p.dealer
    if d is None:
        return p.grant(rank, first, count)
    runs, new = d.deal(book, rank, first, count)
    end = book.ended(d.batches, runs, new)  # decided before the deal is recorded, as the coordinator does
    if new:
        for g, c in runs:
            book.deal(rank, g, c)
    return p.grant(rank, first, count, (runs, end))


def _lease_all(p: EpochPlan, rank: int, count: int, book: EpochDeals) -> list[int]:
    """Every index of `rank` in plan `p`, leased `count` steps at a time until the plan says it ends."""
    out: list[int] = []
    first = 0
    while True:
        grant = _grant(p, rank, first, count, book)
        idx, sizes = p.lease(rank, first, count, grant)  # type: ignore[arg-type]
        assert sum(sizes) == len(idx)
        assert p.agrees(grant, sizes)  # type: ignore[arg-type]
        if p.fixed_batches:
            assert all(s == p.spec.batch_size for s in sizes[:-1])
        assert len(p.lease_positions(rank, first, count, grant)) == len(idx)  # type: ignore[arg-type]
        out += idx.tolist()
        if p.ends(rank, first, count, len(sizes), grant):  # type: ignore[arg-type]
            return out
        first += len(sizes)
        assert sizes, "a lease that is not the end deals something"


def test_every_kind_is_picked_by_its_spec_and_agrees_with_its_entry() -> None:
    assert sorted(KINDS) == NAMES
    for name in NAMES:
        spec = _spec(name, 100, 4, 1)
        assert kind_of(spec) is KINDS[name]
        p = plan_epoch(spec, fresh(spec, 0), 3, 0)
        assert p is not None
        assert p.coordinator_deals == KINDS[name].coordinator_deals == (p.dealer is not None)
        assert p.fixed_batches == KINDS[name].fixed_batches
        assert (p.spec, p.cursor, p.world) == (spec, fresh(spec, 0), 3)
    assert all(pickle.loads(pickle.dumps(k)) is k for k in KINDS.values()), "a sampler's kind travels by name"


@pytest.mark.parametrize("name", NAMES)
def test_the_epoch_rule_is_the_same_for_every_kind(name: str) -> None:
    spec = _spec(name, 60, 4, 2)
    start = Cursor(epoch=3, remaining=((10, 60),))
    assert plan_epoch(spec, start, 2, 3).cursor == start  # type: ignore[union-attr]
    assert plan_epoch(spec, start, 2, 4).cursor == fresh(spec, 4)  # type: ignore[union-attr]
    assert plan_epoch(spec, fresh(spec, 3), 2, 2) is None  # the epoch a fresh start finished
    with pytest.raises(OutOfRange, match="before this generation's resume point"):
        plan_epoch(spec, start, 2, 2)
    assert plan_epoch(spec, start, 2, 3) is plan_epoch(spec, start, 2, 3), "plans are cached"


@settings(max_examples=examples(60), deadline=None)
@given(name=st.sampled_from(NAMES), n=st.integers(1, 300), batch=st.integers(1, 9), world=st.integers(1, 6),
       count=st.integers(1, 5), seed=st.integers(0, 2**20))
def test_a_plan_deals_every_remaining_position_once(name: str, n: int, batch: int, world: int, count: int,
                                                    seed: int) -> None:
    """With the uneven tail, the ranks' leases together are the epoch's remainder, each index once."""
    spec = _spec(name, n, batch, seed)
    p = plan_epoch(spec, fresh(spec, 0), world, 0)
    assert p is not None
    book = EpochDeals()
    # NOTE: a plan the coordinator deals deals to whoever asks: the ranks ask in turn, one lease each.
    got = [i for r in range(world) for i in _lease_all(p, r, count, book)]
    assert sorted(got) == list(range(spec.n))
    if p.known_steps(0) is not None:
        assert p.known_steps(0) == p.steps(0)
    if p.dealer is not None:
        assert book.next == p.dealer.batches


@settings(max_examples=examples(40), deadline=None)
@given(name=st.sampled_from(["fixed", "tokens"]), n=st.integers(1, 300), batch=st.integers(1, 9),
       world=st.integers(1, 6), new_world=st.integers(1, 6), steps=st.integers(0, 40), seed=st.integers(0, 2**20))
def test_advance_is_topology_free(name: str, n: int, batch: int, world: int, new_world: int, steps: int,
                                  seed: int) -> None:
    """What the ranks took before `advance` and what any new world is dealt after it: the epoch, each index once."""
    spec = _spec(name, n, batch, seed)
    p = plan_epoch(spec, fresh(spec, 0), world, 0)
    assert p is not None
    taken = [i for r in range(world) for i in p.lease(r, 0, steps)[0].tolist()]
    cursor = p.advance(steps)
    if cursor.epoch == 1:
        assert sorted(taken) == list(range(spec.n))
        return
    q = plan_epoch(spec, cursor, new_world, 0)
    assert q is not None
    rest = [i for r in range(new_world) for i in _lease_all(q, r, 3, EpochDeals())]
    assert sorted(taken + rest) == list(range(spec.n))


@settings(max_examples=examples(40), deadline=None)
@given(name=st.sampled_from(["dynamic", "reverse"]), n=st.integers(1, 300), batch=st.integers(1, 9),
       world=st.integers(1, 6), new_world=st.integers(1, 6), asks=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4)),
                                                                           max_size=30),
       credit=st.integers(0, 12), lockstep=st.booleans(), seed=st.integers(0, 2**20))
def test_a_dealers_checkpoint_is_topology_free(name: str, n: int, batch: int, world: int, new_world: int,
                                               asks: list[tuple[int, int]], credit: int, lockstep: bool,
                                               seed: int) -> None:
    """Deals to ranks asking in any order, a checkpoint crediting some of them, and any new world dealt
    the checkpoint's cursor: every index of the epoch once, the credited batches' before, the rest after."""
    spec = _spec(name, n, batch, seed)
    p = plan_epoch(spec, fresh(spec, 0), world, 0)
    assert p is not None and p.dealer is not None
    book = EpochDeals()
    for rank, count in asks:
        rank %= world
        grant = _grant(p, rank, book.dealt(rank), count, book)
        assert grant.runs == tuple(book.sequence(rank, book.dealt(rank) - grant.batches, grant.batches))  # type: ignore[attr-defined]
    credited = book.credits(0, credit, lockstep)
    taken = [i for r, k in credited.items()
             for i in p.lease(r, 0, k, p.grant(r, 0, k, (tuple(book.sequence(r, 0, k)), False)))[0].tolist()]
    cursor = p.dealer.checkpoint(book, credited)
    if cursor.epoch == 1:
        assert sorted(taken) == list(range(spec.n))
        return
    q = plan_epoch(spec, cursor, new_world, 0)
    assert q is not None
    fresh_book = EpochDeals()
    rest = [i for r in range(new_world) for i in _lease_all(q, r, 3, fresh_book)]
    assert sorted(taken + rest) == list(range(spec.n))


@pytest.mark.parametrize("name", ["dynamic", "reverse"])
def test_a_plan_the_coordinator_deals_needs_its_deal(name: str) -> None:
    spec = _spec(name, 50, 4, 0)
    p = plan_epoch(spec, fresh(spec, 0), 2, 0)
    assert p is not None and p.coordinator_deals and p.known_steps(0) is None
    with pytest.raises(ValueError, match="dealt"):
        p.grant(0, 0, 1)
    with pytest.raises(ValueError, match="grant"):
        p.lease(0, 0, 1)
    with pytest.raises(ValueError, match="coordinator"):
        p.advance(1)


@pytest.mark.parametrize("kind", NAMES)
def test_sampler_defaults_come_from_the_registry(kind: str) -> None:
    k: PlanKind = KINDS[kind]
    assert k.tail(False, batches=True) == ("uneven" if k.coordinator_deals else "pad")
    assert k.tail(True, batches=False) == "drop"
    assert k.permutation(False, True) == "none"
    assert k.permutation(True, True) == (k.shuffled_by or ("bucket" if k.fixed_batches else "feistel"))


def _leases(p: EpochPlan, book: EpochDeals) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Every rank's batch sizes and indices in plan `p`, leased three steps at a time (dealt into `book`)."""
    sizes: dict[int, list[int]] = {}
    indices: dict[int, list[int]] = {}
    for r in range(p.world):
        first, sizes[r], indices[r] = 0, [], []
        while True:
            grant = _grant(p, r, first, 3, book)
            idx, got = p.lease(r, first, 3, grant)  # type: ignore[arg-type]
            sizes[r] += got
            indices[r] += idx.tolist()
            if p.ends(r, first, 3, len(got), grant):  # type: ignore[arg-type]
                break
            first += len(got)
    return sizes, indices


@settings(max_examples=examples(40), deadline=None)
@given(name=st.sampled_from(NAMES), n=st.integers(1, 200), batch=st.integers(1, 9), world=st.integers(1, 5),
       pad=st.booleans(), seed=st.integers(0, 2**20))
def test_where_the_kinds_differ_a_plan_answers_as_its_leases_deal(name: str, n: int, batch: int, world: int,
                                                                  pad: bool, seed: int) -> None:
    """A plan's own answers where the ways of dealing differ (a fixed plan's from its layout at once): the most
    steps of a rank, every step's positions, where an index lies and which samples are the tail's padding, as
    its leases deal them; a rank's own grant is the coordinator's, or none where the coordinator deals."""
    spec = _spec(name, n, batch, seed)
    if pad and not KINDS[name].coordinator_deals:
        spec = dataclasses.replace(spec, tail="pad")
    p = plan_epoch(spec, fresh(spec, 0), world, 0)
    assert p is not None
    assert p.dealt_out(None) == (p.dealer is None or p.dealer.batches == 0)
    book = EpochDeals()
    sizes, indices = _leases(p, book)
    assert p.dealt_out(book)
    most = p.most_steps(book)
    assert most == max(len(s) for s in sizes.values())
    ranks, steps, pos = p.step_positions(0, most + 1, book)
    dealt = order(spec, 0, pos, p.cursor.base_world)
    assert ranks.tolist() == [r for r in range(world) for _ in indices[r]]
    assert steps.tolist() == [j for r in range(world) for j, s in enumerate(sizes[r]) for _ in range(s)]
    assert dealt.tolist() == [i for r in range(world) for i in indices[r]]
    pads = [p.padding(r, j, s) for r in range(world) for j, s in enumerate(sizes[r])]
    if any(x is not None for x in pads):
        flags = np.concatenate(pads)  # type: ignore[arg-type]
        assert int(flags.sum()) == len(dealt) - spec.n, "the padding is what is dealt beyond the epoch"
        assert sorted(dealt[~flags].tolist()) == list(range(spec.n))
    for i in range(spec.n):
        hits = p.where(i)
        if hits is not None:
            k = np.flatnonzero(dealt == i)
            assert sorted(hits) == sorted(zip(ranks[k].tolist(), steps[k].tolist(), pos[k].tolist()))
    own = p.own_grant(0, 0, 2)
    assert own == (None if p.coordinator_deals else p.coordinator_grant(0, 0, 2, lambda: ((), True)))


@pytest.mark.parametrize("name", NAMES)
def test_a_kinds_stepped_variant_takes_every_position_of_an_epoch_once(name: str) -> None:
    """A job of torchft-style steps whose spec names a kind takes each epoch's positions in the kind's stepped
    order (the toy kind has one of its own), once each; its inverse finds each position's place."""
    for n, batch in ((1, 3), (10, 4), (12, 4), (37, 5)):
        spec = _spec(name, n, batch, seed=n)
        kind = kind_of(spec)
        for epoch in (0, 3):
            places = kind.stepped_positions(spec, epoch, 0, spec.n)
            assert sorted(places.tolist()) == list(range(spec.n)), (name, n, batch)
            assert kind.stepped_positions(spec, epoch, 2, spec.n).tolist() == places[2:].tolist()
            assert [kind.stepped_place(spec, epoch, int(p)) for p in places] == list(range(spec.n))
    assert (kind.stepped is None) == (name != "reverse")
