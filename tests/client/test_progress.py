"""The epoch's life in a sampler (client/_progress.py): every walk of its transitions keeps its rules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from croupier.client._progress import EpochLife, Phase

TRANSITIONS = ("enter", "skip", "exhaust", "cut", "log_end", "next_epoch")


class Flags:
    """The reference: the four flags the sampler kept before (an iteration began, the epoch is over,
    the leases ran out, the end was logged), changed as the sampler changed them."""

    def __init__(self) -> None:
        self.entered = self.complete = self.exhausted = self.ended = False

    def apply(self, t: str) -> bool | None:
        if t == "enter":
            self.entered = True
        elif t == "skip":
            self.complete = True
        elif t == "exhaust":
            self.exhausted = True
        elif t == "cut":
            self.complete = True
        elif t == "log_end":
            first, self.ended = not self.ended, True
            return first
        else:
            self.entered = self.complete = self.exhausted = self.ended = False
        return None

    def finished(self, taken: int, rest: int | None) -> bool:
        if self.complete:
            return True
        if not self.entered:
            return False
        return self.exhausted or rest is not None and taken >= rest


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(TRANSITIONS), st.integers(0, 5), st.one_of(st.none(), st.integers(0, 5))),
                max_size=40))
def test_every_walk_agrees_with_the_flags_and_refuses_what_cannot_happen(
        walk: list[tuple[str, int, int | None]]) -> None:
    life, ref = EpochLife(), Flags()
    for t, taken, rest in walk:
        before = life.phase
        try:
            got = getattr(life, t)()
        except RuntimeError as e:
            # Refused: an epoch that was skipped, exhausted or is over cannot be skipped or exhausted again,
            # and a finished one cannot be entered again (the sampler moves on to the next epoch first).
            assert t in ("enter", "skip", "exhaust") and str(before.value) in str(e)
            assert life.phase is before, "a refused transition changes nothing"
            continue
        assert ref.apply(t) == got
        assert (life.entered, life.over, life.exhausted, life.end_logged) == (
            ref.entered, ref.complete, ref.exhausted and not ref.complete, ref.ended), (t, life)
        assert life.finished(taken, rest) == ref.finished(taken, rest)
        if life.phase in (Phase.EXHAUSTED, Phase.OVER, Phase.SKIPPED):
            assert life.finished(taken, rest), "a phase past running is finished"


def test_the_walk_checks_can_fail() -> None:
    life = EpochLife()
    life.enter()
    life.exhaust()
    with pytest.raises(RuntimeError, match="exhausted cannot enter"):
        life.enter()
    life.next_epoch()
    assert (life.phase, life.end_logged) == (Phase.FRESH, False)
    assert life.log_end() and not life.log_end()
