"""Exhaustive small worlds: every world-size sequence, a restart at every step boundary, exactly-once holds."""

from __future__ import annotations

import itertools

import pytest
from _sim import Job, audit_epoch

from croupier.core.order import Cursor, fixed_plan, fresh
from croupier.core.spec import Spec

pytestmark = pytest.mark.exhaustive

SEQUENCES = [s for k in (1, 2, 3) for s in itertools.product(range(1, 6), repeat=k)]


def _run(spec: Spec, worlds: tuple[int, ...], restart_after: int) -> tuple[list[int], int]:
    """One epoch where a new world from `worlds` (cyclically) takes over every `restart_after` steps.

    Returns what was trained and the world that completed the epoch.
    """
    cursor: Cursor = fresh(spec, 0)
    trained: list[int] = []
    for g in itertools.count():
        w = worlds[g % len(worlds)]
        p = fixed_plan(spec, cursor, w)
        for j in range(restart_after):
            if p.done(j):
                return trained, w
            for r in range(w):
                b = p.batch_indices(r, j)
                if b is not None:
                    trained.extend(b.tolist())
        if p.done(restart_after):
            return trained, w
        cursor = p.advance(restart_after)  # the checkpoint every rank saved; the next world loads it
        assert cursor.epoch == 0
    raise AssertionError("unreachable")


def _allowed(spec: Spec, final: int) -> tuple[int, int]:
    return (final - 1 if spec.tail == "drop" else 0), (final - 1 if spec.tail == "pad" else 0)


@pytest.mark.parametrize("partition", ["strided", "chunked", "contiguous"])
def test_every_sequence_restart_every_step_uneven(partition: str) -> None:
    """Tail uneven: every index of every epoch exactly once, for N <= 40 and every sequence."""
    runs = 0
    for n in range(1, 41):
        spec = Spec(n=n, permutation="feistel", partition=partition, tail="uneven", seed=n)
        for seq in SEQUENCES:
            trained, _ = _run(spec, seq, 1)
            assert sorted(trained) == list(range(n)), (n, seq)
            runs += 1
    assert runs == 40 * len(SEQUENCES)


@pytest.mark.parametrize("tail", ["drop", "pad"])
def test_every_sequence_restart_every_step_strided_tails(tail: str) -> None:
    """Tails drop and pad with torch's strided partition: G1's bounds with the final world size."""
    for n in range(1, 41):
        spec = Spec(n=n, permutation="feistel", partition="strided", tail=tail, seed=n, batch_size=1 + n % 3)
        for seq in SEQUENCES:
            trained, final = _run(spec, seq, 1)
            audit_epoch(spec, trained, *_allowed(spec, final))


@pytest.mark.parametrize("tail", ["uneven", "drop", "pad"])
def test_two_worlds_restart_at_each_boundary(tail: str) -> None:
    """One resize at each possible step boundary, between every pair of world sizes."""
    for n in (1, 2, 7, 16, 23, 40):
        spec = Spec(n=n, permutation="torch", partition="strided", tail=tail, seed=3, batch_size=2)
        for w1, w2 in itertools.product(range(1, 6), repeat=2):
            first = fixed_plan(spec, fresh(spec, 0), w1)
            for s in range(int(first.nb_r.max()) + 1):
                trained = [i for j in range(s) for r in range(w1) if (b := first.batch_indices(r, j)) is not None for i in b.tolist()]
                cur = first.advance(s)
                final = w1
                if cur.epoch == 0:
                    second = fixed_plan(spec, cur, w2)
                    final = w2
                    trained += [i for j in range(int(second.nb_r.max())) for r in range(w2)
                                if (b := second.batch_indices(r, j)) is not None for i in b.tolist()]
                audit_epoch(spec, trained, *_allowed(spec, final))


def test_multi_epoch_new_order_and_restart_across_the_boundary() -> None:
    """Epoch 1 is another permutation; a restart across the epoch boundary stays exactly-once."""
    spec = Spec(n=30, permutation="feistel", tail="uneven", batch_size=2, seed=11)
    job = Job(spec, 3)
    job.run_epoch()
    e0 = [i for e, _, _, b in job.log if e == 0 for i in b]
    ck_mid = None
    while job.epoch == 1:
        if job.j == 2:
            ck_mid = job.checkpoint()
        if job.step():
            break
    e1 = job.trained(1)
    assert sorted(e0) == sorted(e1) == list(range(30))
    assert e0 != e1, "epoch 1 must be a different order"
    # Checkpoint at the end of epoch 1, then resize 3 -> 2 and carry on across the boundary.
    end = job.checkpoint()
    assert end.state["epoch"] == 2 and end.state["remaining"] == [[0, 30]]
    job.restart(end, 2)
    job.run_epoch()
    assert sorted(job.trained(2)) == list(range(30))
    # Restart from a checkpoint in the middle of epoch 1, with 5 ranks: epoch 1 rolls back and
    # finishes exactly once, then epoch 2 follows with the same order as before.
    assert ck_mid is not None
    before = job.trained(2)
    job.restart(ck_mid, 5)
    job.run_epoch()
    assert sorted(job.trained(1)) == list(range(30))
    job.run_epoch()
    assert sorted(job.trained(2)) == list(range(30))
    assert job.trained(2) != before  # dealt to 5 ranks instead of 2: same order, other interleaving
