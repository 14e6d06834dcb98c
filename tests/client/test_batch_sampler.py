"""DistributedBatchSampler killed mid-epoch and resumed under another world size, audited for exactly-once.

Every case runs a world of W1 ranks for k lockstep steps (each rank takes one batch per step),
saves rank 0's ``state_dict()``, closes every sampler (the kill), starts a world of W2 ranks with
a new incarnation that loads the state, and runs the epoch (and the next one) to its end.
What the training loops received in the epoch -- W1's batches before the checkpoint and W2's
after it -- is then checked three ways:

* the exactly-once rule of the tail policy (W the final world): ``uneven``: every index of
  [0, N) once; ``drop``: none twice, fewer than W missing; ``pad`` / ``pad_last``: each at least
  once, fewer than W repeats (chunked / contiguous: each generation that trained padding may add
  fewer than its own W, see the NOTE of ``tests/_sim.py`` ``Job.allowance``);
* exactly: the multiset received is every index once, minus what the final plan drops on
  purpose (``drop_last`` / ``even_batches`` and the ``drop`` tail), plus the padding the plans
  serve (see :func:`audit_epoch`);
* batch for batch: each world gets what :func:`croupier.core.order.fixed_plan` computes for its start.

The checkpoint cursor itself is compared with a brute-force recomputation (the positions no rank
has been served yet), which does not use :meth:`FixedPlan.advance`, the function that makes it.
"""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _budget import cases
from _ranks import Ranks
from _resume_cases import (
    SEED,
    Case,
    G1Violation,
    assert_within_packs,
    audit_epoch,
    audit_exact,
    audit_rule,
    lengths_for,
    pack_ids,
    plan_batches,
    remaining_positions,
)
from _resume_run import (
    check_batches_follow_plans,
    check_cursor,
    check_everything,
    drain,
    kill_and_resize,
)

from croupier.client import DistributedBatchSampler
from croupier.core.checkpoint import to_state
from croupier.core.order import Cursor, FixedPlan, fixed_plan, fresh, order
from croupier.core.spec import PARTITIONS, TAILS
from croupier.server._service import Server

# --------------------------------------------------------------------------- the matrix

RESIZES = [(3, 2), (2, 5), (4, 1), (1, 3), (5, 2), (2, 4)]
SIZES = [23, 29, 31, 37, 41, 43, 47, 53, 59, 61]


def matrix() -> Iterator[Case]:
    """Every tail x partition x drop_last x even_batches, with resizes, sizes and kill points spread over them."""
    combos = itertools.product(TAILS, PARTITIONS, (False, True), (False, True))
    for i, (tail, partition, drop_last, even) in enumerate(combos):
        w1, w2 = RESIZES[i % len(RESIZES)]
        n = SIZES[(i * 3) % len(SIZES)]
        b = (2, 3, 4)[(i // 2) % 3]
        b = min(b, n // (2 * w1 + 2))  # the busiest rank has >= 2 batches: a mid-epoch kill exists
        yield Case(n, b, tail, partition, drop_last, even, w1, w2, at=(0.3, 0.5, 0.8)[(i // 3) % 3],
                   warmup_epochs=1 if i % 7 == 3 else 0, set_epoch=i % 4 == 1)


MATRIX = list(matrix())

OTHER = [
    # DGL's DistributedItemSampler: split first, shuffle each part in windows; the parts keep W1's layout.
    Case(37, 3, "uneven", "contiguous", True, True, 3, 2, scope="rank", permutation="window", buffer_size=5),
    Case(43, 2, "uneven", "contiguous", False, True, 2, 4, scope="rank", permutation="window", buffer_size=4),
    Case(31, 2, "pad", "chunked", True, False, 4, 2, scope="rank", permutation="feistel"),
    # Chunked shares that end early: rank 3 of 4 has 2 batches, the others 4; killed after 3 steps
    # (with drop_last, rank 3's dropped last sample stays in the checkpoint and is dealt again).
    Case(25, 2, "uneven", "chunked", False, False, 4, 2, k=3),
    Case(29, 2, "uneven", "chunked", True, False, 4, 3, k=3),
    # The same world again, and a world of one grown to several.
    Case(41, 3, "pad", "strided", False, False, 3, 3, at=0.6),
    Case(29, 2, "drop", "contiguous", True, False, 1, 4, at=0.4),
]


@pytest.mark.parametrize("case", cases(MATRIX) + OTHER, ids=lambda c: c.id)
def test_resume_under_another_world(server: Server, case: Case) -> None:
    check_everything(kill_and_resize(server, case))


STATELESS = [
    Case(37, 2, "pad", "strided", False, False, 2, 5, stateless=True),
    Case(31, 3, "uneven", "chunked", True, False, 1, 3, stateless=True, set_epoch=True),
    Case(47, 2, "drop", "contiguous", False, True, 2, 4, stateless=True),
    Case(43, 2, "pad_last", "chunked", True, True, 3, 4, stateless=True, at=0.7),
    Case(53, 3, "uneven", "contiguous", False, False, 2, 3, stateless=True, warmup_epochs=1, set_epoch=True),
    Case(41, 2, "pad", "contiguous", False, False, 1, 5, stateless=True, at=0.8),
    Case(43, 2, "uneven", "contiguous", True, True, 2, 4, stateless=True, scope="rank", permutation="window",
         buffer_size=4),
]


@pytest.mark.parametrize("case", STATELESS, ids=lambda c: c.id)
def test_ranks_added_by_a_scale_up_need_no_state(server: Server, case: Case) -> None:
    run = kill_and_resize(server, case)
    assert any(b is None for b in run.lens_before), "the case must add stateless ranks"
    check_everything(run)


BOUNDARY = [
    Case(37, 2, "uneven", "strided", False, False, 3, 2, stop="last-batch"),
    Case(41, 3, "pad", "chunked", True, True, 2, 5, stop="last-batch", set_epoch=True),
    Case(29, 2, "drop", "contiguous", True, False, 4, 1, stop="after-end"),
    Case(31, 2, "pad_last", "strided", False, True, 1, 3, stop="after-end", warmup_epochs=1),
    Case(33, 2, "uneven", "chunked", True, False, 2, 4, stop="after-end", stateless=True, set_epoch=True),
    Case(60, 2, "uneven", "strided", False, False, 3, 2, stop="after-end", bucket=(36, 12), packs_promised=True),
]


@pytest.mark.parametrize("case", BOUNDARY, ids=lambda c: c.id)
def test_resume_at_an_epoch_boundary_starts_the_next_epoch(server: Server, case: Case) -> None:
    run = kill_and_resize(server, case)
    assert run.cursor == fresh(run.spec, run.epoch + 1)
    assert run.states[0]["remaining"] == [[0, run.spec.n]] and run.states[0]["epoch"] == run.epoch + 1
    assert all(run.ended) == (case.stop == "after-end")
    check_everything(run)


BUCKETS = [
    # Strided, N = 60, windows of 36 and 24 holding whole packs of 12, batch 2 and W in {1, 2, 3, 6}:
    # W * batch_size divides pack_size, and each kill is at a pack boundary (k * W1 * batch_size a
    # multiple of 12), so every lockstep step of either world lies inside one pack.
    Case(60, 2, "pad", "strided", w1=3, w2=2, k=2, bucket=(36, 12), packs_promised=True),
    Case(60, 2, "drop", "strided", w1=2, w2=3, k=3, bucket=(36, 12), packs_promised=True, set_epoch=True),
    Case(60, 2, "uneven", "strided", w1=6, w2=2, k=2, bucket=(36, 12), packs_promised=True, warmup_epochs=1),
    Case(60, 2, "pad_last", "strided", w1=1, w2=6, k=6, bucket=(36, 12), packs_promised=True),
    Case(60, 2, "uneven", "strided", w1=2, w2=6, k=6, bucket=(36, 12), packs_promised=True, stateless=True),
    # Chunked / contiguous, batch_size == pack_size == 4, N = 48, windows of 16: every part start and
    # every interval the checkpoint leaves is a multiple of 4, so every batch is one whole pack.
    Case(48, 4, "uneven", "contiguous", w1=2, w2=4, k=2, bucket=(16, 4), packs_promised=True),
    Case(48, 4, "pad", "chunked", w1=2, w2=4, k=2, bucket=(16, 4), packs_promised=True, stateless=True),
    Case(48, 4, "drop", "contiguous", w1=4, w2=2, k=1, bucket=(16, 4), packs_promised=True),
    # Sizes that promise nothing about packs: the exactly-once and plan checks only.
    Case(47, 3, "uneven", "chunked", True, False, 3, 2, bucket=(16, 4)),
    Case(53, 2, "pad", "contiguous", False, True, 2, 5, bucket=(20, 5), at=0.7),
    Case(41, 2, "drop", "strided", True, True, 4, 1, bucket=(12, 3)),
    Case(61, 3, "pad_last", "strided", False, False, 2, 3, bucket=(25, 6), stateless=True),
]


@pytest.mark.parametrize("case", BUCKETS, ids=lambda c: c.id)
def test_bucketing_resumes(server: Server, case: Case) -> None:
    run = kill_and_resize(server, case)
    if case.packs_promised:
        # The kill is at a pack boundary: the checkpoint leaves whole packs.
        ids = pack_ids(lengths_for(case.n), *case.bucket)  # type: ignore[misc]
        left = order(run.spec, run.cursor.epoch, remaining_positions(run.cursor), run.cursor.base_world)
        served = np.setdiff1d(np.arange(case.n), left)
        assert not set(ids[left].tolist()) & set(ids[served].tolist()), "a pack is split by the checkpoint"
    check_everything(run)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("preloaded", [False, True], ids=["nothing-loaded", "own-state-loaded"])
@pytest.mark.parametrize("change", ["batch_size", "lengths"])
def test_a_state_of_another_spec_is_refused_and_changes_nothing(server: Server, tmp_path: Path, change: str,
                                                                preloaded: bool) -> None:
    n, w = 40, 2
    saved_case = Case(n, 2, "uneven", bucket=(16, 4), w1=w)
    job = f"refuse-{change}-{uuid.uuid4().hex[:8]}"
    ranks = Ranks([saved_case.sampler(server.address, job, f"{job}/a", w, r) for r in range(w)])
    try:
        for _ in range(3):
            for r in range(w):
                assert ranks.next(r) is not None
        saved = ranks.samplers[0].state_dict()
    finally:
        ranks.close()

    # The restarted job was changed: another batch size, or one sample's length. Its coordinator
    # is a new one (the old one holds the job with the old spec, and would refuse the join).
    other = Server(f"sqlite:///{tmp_path}/other.db").start()
    try:
        if change == "batch_size":
            new_case = dataclasses.replace(saved_case, batch_size=3)
            samplers = [new_case.sampler(other.address, job, f"{job}/b", w, r) for r in range(w)]
        else:
            lengths = lengths_for(n)
            lengths[7] += 1
            samplers = [DistributedBatchSampler(n, 2, w, r, seed=SEED, address=other.address, job=job,
                                                incarnation=f"{job}/b", tail="uneven", permutation="bucket",
                                                lengths=lengths, buffer_size=16, pack_size=4, lease_ahead=3)
                        for r in range(w)]
        spec = samplers[0].spec
        assert spec.fingerprint != saved["fingerprint"]
        own = Cursor(epoch=1, remaining=((4, 20), (26, n)))
        if preloaded:
            for s in samplers:
                s.load_state_dict(to_state(job, spec, own))
        before = [(s.state_dict(), len(s), s.epoch) for s in samplers]
        snapshot = other.core.snapshot_state()
        for s in samplers:
            with pytest.raises(ValueError) as refused:
                s.load_state_dict(saved)
            msg = str(refused.value)
            assert saved["fingerprint"] in msg and spec.fingerprint in msg, msg
            assert ("batch_size=3" if change == "batch_size" else "lengths='<40 keys") in msg, msg
        assert [(s.state_dict(), len(s), s.epoch) for s in samplers] == before
        assert other.core.snapshot_state() == snapshot
        ranks = Ranks(samplers)
        try:
            got = drain(ranks)
        finally:
            ranks.close()
        start = own if preloaded else fresh(spec, 0)
        assert got == plan_batches(fixed_plan(spec, start, w))
    finally:
        other.stop(grace=0.5)


# --------------------------------------------------------------------------- the checks can fail


@pytest.mark.parametrize("shift", [-1, 1], ids=["cursor-one-batch-early", "cursor-one-batch-late"])
@pytest.mark.parametrize(
    "case",
    [Case(37, 2, "uneven", "chunked", w1=3, w2=2, k=3), Case(43, 3, "pad", "strided", True, False, 2, 5, k=3),
     Case(41, 2, "drop", "contiguous", False, True, 4, 3, k=2)],
    ids=lambda c: c.id,
)
def test_the_checks_catch_a_checkpoint_one_batch_off(server: Server, monkeypatch: pytest.MonkeyPatch, case: Case,
                                                     shift: int) -> None:
    real = FixedPlan.advance
    monkeypatch.setattr(FixedPlan, "advance", lambda self, j: real(self, j + shift))
    run = kill_and_resize(server, case)
    trained, segments = run.trained(), run.segments()
    # Early: the last step before the kill is served again; late: the step after it is skipped.
    with pytest.raises(G1Violation, match="received [1-9]" if shift < 0 else "lacks [1-9]"):
        audit_exact(run.spec, trained, segments)
    if case.tail == "uneven":  # nothing is allowed missing or repeated: the rule alone sees it too
        with pytest.raises(G1Violation, match=r"[1-9]\d* repeats" if shift < 0 else r"[1-9]\d* missing"):
            audit_rule(run.spec, trained, segments)
    with pytest.raises(G1Violation):
        audit_epoch(run.spec, trained, segments)
    with pytest.raises(AssertionError, match="re-serves" if shift < 0 else "skips"):
        check_cursor(run)
    # What the resumed world got is still what the plan of the (wrong) cursor says: the serving is
    # right, the checkpoint is not, and only the checks above notice.
    check_batches_follow_plans(run)


def test_the_pack_check_catches_batches_across_packs() -> None:
    case = Case(60, 2, "pad", "strided", w1=3, w2=2, bucket=(36, 12))
    ids = pack_ids(lengths_for(60), 36, 12)
    spec = case.spec()
    assert_within_packs(plan_batches(fixed_plan(spec, fresh(spec, 0), 3)), ids, True, "bucketed")
    shuffled = dataclasses.replace(case, bucket=None, permutation="feistel").spec()
    with pytest.raises(AssertionError, match="spans packs"):
        assert_within_packs(plan_batches(fixed_plan(shuffled, fresh(shuffled, 0), 3)), ids, True, "not bucketed")


# --------------------------------------------------------------------------- len() before the join


def test_len_when_the_loop_replays_the_epoch_the_checkpoint_finished(server: Server) -> None:
    case = Case(20, 2, "uneven", "strided", w1=2, w2=2, stop="last-batch")
    run = kill_and_resize(server, case)
    assert run.cursor == fresh(run.spec, 1)
    samplers = [case.sampler(server.address, run.job, f"{run.job}/c", 2, r) for r in range(2)]
    for s in samplers:
        s.set_epoch(0)  # the loop's epoch variable, saved with the checkpoint at the end of epoch 0
        s.load_state_dict(run.states[0])
    lens = [len(s) for s in samplers]
    ranks = Ranks(samplers)
    try:
        got = drain(ranks)
    finally:
        ranks.close()
    assert got == [[], []]  # epoch 0 is complete: its iteration yields nothing
    assert lens == [0, 0], f"len() said {lens} for an iteration that yields no batch"
