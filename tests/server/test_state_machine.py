"""G1 and the job's history through the production path, for both kinds of job, in one state machine.

A hypothesis state machine (tests/server/_machine_jobs.py) draws each example's job of either kind. A job of
generations is a lockstep data-parallel job under random crashes, restarts from any checkpoint, resizes,
zombies and coordinator and store loss: a real coordinator (``Server``, gRPC on 127.0.0.1, over a memory
store) and one real ``DistributedSampler`` or ``DistributedBatchSampler`` per rank, each leasing a few
batches ahead in its prefetch thread. Batches come from ``Coordinator.lease`` over gRPC and checkpoints from
the samplers' ``state_dict``; the test computes neither. It audits G1 (docs/guarantees.md) after every step
and at every finished epoch, with the allowances of ``_sim.allowance``. A job of torchft-style replica-group
steps is the one of tests/server/test_state_machine_ft.py's planted bugs: its record of committed steps is
checked against the model after every rule.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import _machine_world
import hypothesis.errors
import pytest
from _budget import quick
from _machine_jobs import SETTINGS, Jobs
from _machine_world import EXAMPLES, KINDS, STEPPED, STEPS, TOTALS
from _reverse_kind import ReversePlan, reverse_registered
from hypothesis import Phase, settings
from hypothesis.stateful import (
    run_state_machine_as_test,
)

from croupier.client import _sampler
from croupier.core.deals import EpochDeals
from croupier.core.errors import FailedPrecondition, InvalidArgument
from croupier.core.ledger import Ledger
from croupier.core.order import FixedPlan
from croupier.core.schedule import Schedule
from croupier.core.shard_deals import _Taking
from croupier.core.tokens import TokenPlan


@pytest.fixture(autouse=True, scope="module")
def _toy_kind() -> Iterator[None]:
    """The toy way of dealing of tests/_reverse_kind.py, which the machine draws beside the registered ones."""
    with reverse_registered():
        yield


def _report(title: str) -> None:
    lingering = [t for t in threading.enumerate() if t.name.startswith("croupier-lease")]
    for t in lingering:  # a closed sampler's prefetch thread ends within its put timeout
        t.join(timeout=5.0)
    print(f"\n{title}: {dict(sorted(TOTALS.items()))}")
    assert not [t for t in lingering if t.is_alive()], "prefetch threads outlived their samplers"


#: The default run in parts of its own, each drawing its share of the examples, so that pytest-xdist's workers
#: share it (one run of them all was the last test to end in make test); a short run (make check's 12) is one part.
#: CROUPIER_SM_EXAMPLES examples of each kind of job: twice that in all.
PARTS = 3 if EXAMPLES >= 60 else 1
#: The kinds of job of generations (those of the planted bugs in a sampler, a plan or the ledger of generations).
GENERATIONS = [k for k in KINDS if k not in STEPPED]


@pytest.mark.parametrize("part", range(PARTS))
def test_exactly_once_under_chaos(part: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one machine, its share of the examples given to each kind of job in turn.

    NOTE: a draw of the kind (``Jobs.start``) is not even: one part of 67 examples drew 16 jobs of generations,
    15 of them mixtures, and no restart among them. So each part runs the machine over the kinds of generations,
    then over the stepped ones, half its examples each (`make slow`'s long run draws them mixed). make check's
    short run (CROUPIER_QUICK) is one fixed search: the edit loop must not fail by an unlucky draw; make test
    draws anew every run.
    """
    TOTALS.clear()
    share = -(-EXAMPLES // PARTS)
    for kinds in (GENERATIONS, [k for k in KINDS if k in STEPPED]):
        if kinds:
            monkeypatch.setattr(_machine_world, "KINDS", kinds)
            run_state_machine_as_test(Jobs, settings=settings(SETTINGS, max_examples=share, derandomize=quick()))
    _report(f"state machine, part {part + 1} of {PARTS} ({share} examples of each kind x up to {STEPS} steps)")
    if GENERATIONS:  # the generations' faults were exercised
        assert TOTALS["epochs_audited"] > 0
        assert TOTALS["restarts"] + TOTALS["resizes"] + TOTALS["coordinator_restarts"] > 0, dict(TOTALS)
    if len(GENERATIONS) < len(KINDS):
        assert TOTALS["ft_steps_kept_checked"] > 0 and TOTALS["ft_attempts_all"] > 0


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_exactly_once_under_chaos_long() -> None:
    TOTALS.clear()
    run_state_machine_as_test(Jobs, settings=settings(SETTINGS, max_examples=7000, stateful_step_count=60))
    _report("state machine (7000 examples x up to 60 steps)")


# ---------------------------------------------------------------------- the test can fail

# NOTE: one failure is enough: a planted bug found two ways would otherwise come back as an ExceptionGroup.
# Hypothesis replays a failing case before it reports it; the machine drives real threads, so the
# replay may draw differently (Flaky: the first run failed, which is the catch) where it would
# otherwise raise the audit's AssertionError.
#: What finds a planted bug: an audit (G1Violation is an AssertionError), a flaky replay, or croupier's own
#: check of a state the bug made (a re-striping that forgets a rank's last positions can leave a state
#: with none left, which load_state_dict refuses as malformed; a dynamic checkpoint that counts an item
#: too many can make the coordinator refuse the next epoch while the last one has batches left to deal).
CAUGHT = (AssertionError, hypothesis.errors.Flaky, InvalidArgument, FailedPrecondition)
PLANTED = settings(SETTINGS, max_examples=200, database=None, phases=[Phase.generate], report_multiple_bugs=False,
                   derandomize=True)  # the same search every run: its time does not vary with luck


def _forget_one_rank(self: FixedPlan, consumed):  # type: ignore[no-untyped-def]
    # A broken re-striping: the last rank's unconsumed remainder is forgotten.
    out = _real_virtual_left(self, consumed)
    if self.spec.partition != "strided" and self.world > 1 and out:
        out = out[:-1]
    elif self.world > 1 and out:
        a, b = out[-1]
        out = out[:-1] + ([(a, b - 1)] if b - 1 > a else [])
    return out


_real_virtual_left = FixedPlan._virtual_left


@pytest.mark.exhaustive  # in make test, not in make check
def test_broken_restriping_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The state machine can fail: a re-striping (behind the samplers' state_dict) that drops a rank's remainder is found."""
    monkeypatch.setattr(FixedPlan, "_virtual_left", _forget_one_rank)
    monkeypatch.setattr(_machine_world, "KINDS", ["index", "batch"])  # the plans it breaks
    with pytest.raises(CAUGHT):
        run_state_machine_as_test(Jobs, settings=PLANTED)


@pytest.mark.exhaustive  # in make test, not in make check: its search takes 0.5 to 30 s here
def test_a_rank_dropped_from_a_dynamic_checkpoint_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The state machine can fail: dynamic dealing's checkpoint without the last rank's consumed batches."""
    real = EpochDeals.credits

    def credits(book: EpochDeals, rank: int, batches: int, lockstep: bool) -> dict[int, int]:
        out = real(book, rank, batches, lockstep)
        if len(out) > 1:
            del out[max(out)]
        return out

    monkeypatch.setattr(EpochDeals, "credits", credits)
    monkeypatch.setattr(_machine_world, "KINDS", ["dynamic"])
    with pytest.raises(CAUGHT):
        run_state_machine_as_test(Jobs, settings=PLANTED)


def test_a_toy_checkpoint_one_batch_ahead_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The state machine can fail on the toy way of dealing too: its dealer credits each rank a batch more."""
    real = ReversePlan.checkpoint
    monkeypatch.setattr(ReversePlan, "checkpoint",
                        lambda self, book, credited: real(self, book, {r: k + 1 for r, k in credited.items()}))
    monkeypatch.setattr(_machine_world, "KINDS", ["reverse"])
    with pytest.raises(CAUGHT):
        run_state_machine_as_test(Jobs, settings=PLANTED)


#: The searches take 10 to 30 s here: in make test, not in make check (which keeps the toy kind's above).
@pytest.mark.exhaustive
@pytest.mark.parametrize("kind", ["tokens", "shards-tokens"])
def test_a_token_checkpoint_one_round_ahead_is_caught(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """The state machine can fail: token-budget batches (over a shard order too) whose checkpoint skips the
    round after it."""
    real = TokenPlan.advance
    monkeypatch.setattr(TokenPlan, "advance", lambda self, j: real(self, j + 1 if j else j))
    monkeypatch.setattr(_machine_world, "KINDS", [kind])
    with pytest.raises(CAUGHT):
        run_state_machine_as_test(Jobs, settings=PLANTED)


@pytest.mark.exhaustive  # in make test, not in make check
def test_a_shard_deal_reading_past_a_dealt_batch_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The state machine can fail on a dynamically dealt shard order: a deal that reads a front on past the
    batches dealt already (to another group, or taken from the back) deals them twice."""
    def front(self: _Taking, a: int, end: int) -> None:  # reads on to `end`, whatever lies dealt before it
        if self.need > 0 and not self.is_dealt(a):
            self._take(a, min(end, a + self.need))

    monkeypatch.setattr(_Taking, "front", front)
    monkeypatch.setattr(_machine_world, "KINDS", ["shards-dynamic"])
    with pytest.raises(CAUGHT):
        run_state_machine_as_test(Jobs, settings=PLANTED)


@pytest.mark.exhaustive  # 5 to 12 s each: in make test, not in make check
@pytest.mark.parametrize("off", [1, -1], ids=["one-item-too-many", "one-item-too-few"])
def test_state_dict_off_by_one_is_caught(monkeypatch: pytest.MonkeyPatch, off: int) -> None:
    """The state machine can fail: a sampler whose state_dict counts one item (index or batch) too many or too few."""
    real = _sampler.SamplerBase.state_dict

    def state_dict(self: Any, consumed: int | None = None, *, step: int | None = None) -> dict[str, Any]:
        if consumed is None and self._start is not None and not self._progress.over:
            consumed = max(0, self.items_done + off)
        return real(self, consumed, step=step)

    monkeypatch.setattr(_sampler.SamplerBase, "state_dict", state_dict)
    monkeypatch.setattr(_machine_world, "KINDS", GENERATIONS)
    with pytest.raises(CAUGHT):
        run_state_machine_as_test(Jobs, settings=PLANTED)


@pytest.mark.exhaustive  # 200 examples each: in make test, not in make check
@pytest.mark.parametrize("plant", ["one-micro-batch-late", "lineage-lost"])
def test_a_wrong_step_ledger_is_caught(monkeypatch: pytest.MonkeyPatch, plant: str) -> None:
    """The state machine's provenance queries can fail: a ledger that places a step one micro-batch late,
    or one that loses a resumed generation's lineage (it finds no parent)."""
    if plant == "one-micro-batch-late":
        real = Schedule.between
        monkeypatch.setattr(Schedule, "between", lambda self, spec, world, after, upto:
                            real(self, spec, world, after, upto) + (upto > after))
    else:
        monkeypatch.setattr(Ledger, "_parent", lambda self, seg: None)
    monkeypatch.setattr(_machine_world, "KINDS", GENERATIONS)
    with pytest.raises(CAUGHT):
        run_state_machine_as_test(Jobs, settings=PLANTED)
