"""Cases the state machine (tests/server/test_state_machine.py) found, replayed step by step so that each stays fixed
whatever hypothesis draws next."""

from __future__ import annotations

from typing import Any

from _machine import Elastic
from _machine_world import Setup


class Draws:
    """Stands in for hypothesis's ``data`` argument: the values the rule draws, in order."""

    def __init__(self, *values: Any) -> None:
        self.values = list(values)

    def draw(self, strategy: Any, label: str | None = None) -> Any:
        return self.values.pop(0)


def test_a_pad_dealt_before_an_amendment_stays_a_sample_of_the_epoch() -> None:
    """pad_last copies the epoch's last position into every pad. A world of 6 resumed mid-epoch dealt it as a
    pad (sample 16, the 15th of the last source); new weights then came with the next generation, at
    the position the resume point says is the first not consumed: that same last position, dealt
    again by the new weights (sample 1). Sample 16 was then trained in an epoch that does not hold it
    (a G1 violation). The amendment now holds from the next epoch when the resume point is inside one."""
    m = Elastic()
    setup = Setup(kind="batch", n=22, seed=0, permutation="none", partition="contiguous", tail="pad_last",
                  buffer_size=None, batch=1, drop_last=False, even_batches=False, lease_ahead=1, prefetch=2, lengths=(),
                  max_tokens=0, token_window=0, sources=(1, 1, 15), weights=((0, (0, 2, 4)),), max_epochs=(None, None, None))
    try:
        m.start(setup=setup, world=1, start=None)
        m.train(k=11)
        m.checkpoint()
        m.lose_store(Draws(0, False), world=6)  # the store lost: the job resumes from the checkpoint with 6 ranks
        m.checkpoint()  # each of the 6 took its first item; the sixth had only pads
        m.amend(Draws("weights", [0, 1, 0]))
        m.restart_from_any_checkpoint(Draws(False, 1, False), world=1)
        m.train(k=6)  # the epoch ends and is audited
        m.no_duplicates_so_far()
        assert m.stats["epochs_audited"] >= 1
    finally:
        m.teardown()
