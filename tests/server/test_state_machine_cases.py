"""Cases the state machine (tests/server/test_state_machine.py) found, replayed step by step so that each stays fixed
whatever hypothesis draws next."""

from __future__ import annotations

from typing import Any

from _machine import Elastic
from _machine_world import JOB, Setup


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


def test_a_skip_after_a_pending_grow_names_the_sample_the_sampler_handed_out() -> None:
    """Source 0 grown from 5 to 8 samples, pending; then a skip of index 12, which the running sampler hands out
    as source 2's sample 2. The coordinator read it in the grown numbering, where 12 is source 1's sample 4, and
    recorded that: the sample the user named was dealt on, and one nobody named never again. A skip's indices
    are now read as the ranks hand them out (the grows their generation holds; a pending one renumbers nothing);
    after the restart, which holds the grow, the epoch is audited in the grown numbering."""
    m = Elastic()
    setup = Setup(kind="batch", n=15, seed=3, permutation="feistel", partition="contiguous", tail="uneven",
                  buffer_size=None, batch=1, drop_last=False, even_batches=False, lease_ahead=1, prefetch=2, lengths=(),
                  max_tokens=0, token_window=0, sources=(5, 5, 5), weights=((0, (1, 1, 1)),),
                  max_epochs=(None, None, None))
    try:
        m.start(setup=setup, world=1, start=None)
        m.train(k=3)
        m.amend(Draws("grow", 0, 3))
        m.amend(Draws("skip", [12]))  # asserts the skip recorded (source 2, sample 2)
        assert m.server.core.job(JOB).amendments[-1].pairs == [(2, 2)]
        m.checkpoint()
        m.restart_from_any_checkpoint(Draws(False, 0, False), world=2)
        m.train(k=20)  # the epoch ends and is audited
        m.no_duplicates_so_far()
        assert m.stats["epochs_audited"] >= 1 and m.stats["amendments_skip"] == 1
    finally:
        m.teardown()
