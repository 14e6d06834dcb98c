"""An epoch the trainer cut short is an event of its own (``EpochCut``), and the step ledger places the next
epoch's steps right after the cut (docs/provenance.md)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from croupier.core.api import JoinRequest
from croupier.core.ledger import Ledger
from croupier.core.order import order
from croupier.core.registry import plan_epoch
from croupier.core.spec import Spec
from croupier.server._decide import decide_join, decide_report
from croupier.server._events import EpochCut, Event, decode_event, encode_event
from croupier.server._state import State

N = 40


def _apply(st: State, events: list[Event]) -> list[Event]:
    for ev in events:
        st.apply(decode_event(msgpack.unpackb(msgpack.packb(encode_event(ev)))))
    return events


def _started(spec: Spec, world: int) -> State:
    st = State()
    for r in range(world):
        _apply(st, decide_join(st, JoinRequest("j", spec, "t1", world, r), 0))
    return st


def _checkpoint(st: State, spec: Spec, world: int, epoch: int, micro: int, step: int) -> list[Event]:
    """Every rank reports `micro` micro-batches of `epoch` taken, and rank 0 a checkpoint there at `step`."""
    gen = st.current("j")
    assert gen.start is not None
    plan = plan_epoch(spec, gen.start, world, epoch)
    assert plan is not None
    for r in range(1, world):
        _apply(st, decide_report(st, "j", 1, r, epoch, micro, step)[1])
    return _apply(st, decide_report(st, "j", 1, 0, epoch, micro, step, (step, plan.advance(micro), f"t1/0/{step}"))[1])


def _ledger(st: State) -> Ledger:
    return Ledger("j", st.jobs["j"].spec, st.jobs["j"].ledger)


def test_a_cut_epoch_places_the_next_epochs_steps_after_the_cut() -> None:
    """The trainer takes 7 steps of epoch 0 (of 40), moves on (set_epoch(1)) and checkpoints 3 steps into epoch 1,
    at step 10: step 8 trained epoch 1's first sample, not epoch 0's eighth."""
    spec = Spec(n=N, seed=5, batch_size=1)
    st = _started(spec, 1)
    _apply(st, decide_report(st, "j", 1, 0, 0, 5, 1)[1])  # a periodic report inside epoch 0
    events = _checkpoint(st, spec, 1, 1, 3, 10)
    assert [ev for ev in events if isinstance(ev, EpochCut)] == [EpochCut("j", 1, 0, 7)]
    ledger = _ledger(st)
    first = order(spec, 1, np.arange(3), 0)
    for t, k in ((8, 0), (9, 1), (10, 2)):
        v = ledger.step(t).kept
        assert v is not None and v.epoch == 1, (t, v)
        assert v.batches[0].indices.tolist() == [int(first[k])]
    v7 = ledger.step(7).kept
    assert v7 is not None and v7.epoch == 0 and ledger.ends_epoch(7) and not ledger.ends_epoch(6)
    # where epoch 1's first sample was trained: step 8, once in epoch 1
    assert [o.step for o in ledger.index(int(first[0])) if o.epoch == 1] == [8]
    # a snapshot and a replay keep the cut; a second checkpoint in the epoch decides nothing new
    assert _ledger(State.restore(st.snapshot())).step(8).kept == ledger.step(8).kept
    assert not [ev for ev in _checkpoint(st, spec, 1, 1, 5, 12) if isinstance(ev, EpochCut)]


def test_a_rank_whose_share_ended_first_is_not_a_cut() -> None:
    """41 samples on 2 ranks: rank 0 has 21 of epoch 0, rank 1 20. Rank 1's epoch ends while rank 0 is still in
    it; a checkpoint 3 steps into epoch 1 at step 24 agrees with the epoch's 21 steps: nothing is cut."""
    spec = Spec(n=N + 1, seed=5, batch_size=1, tail="uneven")
    st = _started(spec, 2)
    _apply(st, decide_report(st, "j", 1, 1, 0, 20, 1)[1])  # rank 1 took its whole share
    _apply(st, decide_report(st, "j", 1, 0, 0, 20, 1)[1])  # rank 0 one short of its own
    events = _checkpoint(st, spec, 2, 1, 3, 24)
    assert not [ev for ev in events if isinstance(ev, EpochCut)] and st.jobs["j"].ledger[0].cuts == {}
    ledger = _ledger(st)
    v21, v22 = ledger.step(21).kept, ledger.step(22).kept
    assert v21 is not None and v21.epoch == 0 and [b.rank for b in v21.batches] == [0]
    assert v22 is not None and v22.epoch == 1 and [b.rank for b in v22.batches] == [0, 1]


@pytest.mark.parametrize("micro, step", [(3, 43), (3, 50), (0, 40)])
def test_a_checkpoint_whose_step_agrees_or_says_more_is_no_cut(micro: int, step: int) -> None:
    """Epoch 0 took its 40 steps (or the trainer counted more than the order has): no cut."""
    spec = Spec(n=N, seed=5, batch_size=1)
    st = _started(spec, 1)
    assert not [ev for ev in _checkpoint(st, spec, 1, 1, micro, step) if isinstance(ev, EpochCut)]
    assert st.jobs["j"].ledger[0].cuts == {}
