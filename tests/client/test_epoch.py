"""Where a sampler is in its epochs (client/_epoch.py): every walk of its transitions keeps its rules."""

from __future__ import annotations

import array
import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from croupier.client._epoch import EpochProgress, Phase, position
from croupier.core.cursor import Cursor, fresh
from croupier.core.spec import Spec
from tests._budget import examples

PHASES = ("enter", "skip", "exhaust", "cut", "end_written", "next_epoch")
HANDING = ("hand_out", "take", "chunk_done", "stop")
BEFORE_JOIN = ("load", "name_epoch", "cut_resumed", "join", "at")
#: The walks' job: its generations start fresh at the epoch a join names.
SPEC = Spec(n=10)


class Reference:
    """The reference: the flags and counters the sampler kept as attributes before, changed as it changed them."""

    def __init__(self) -> None:
        self.entered = self.complete = self.exhausted = self.ended = False
        self.epoch = self.before = self.yielded = 0
        self.chunk: tuple[int, int] | None = None  # (items handed out of it, its size)
        self.hint: int | None = None
        self.resume: Cursor | None = None
        self.resume_items: int | None = None
        self.cut_on_join: tuple[int, int] | None = None

    def taken(self) -> int:
        return self.yielded + (self.chunk[0] if self.chunk else 0)

    def finished(self, rest: int | None) -> bool:
        if self.complete:
            return True
        if not self.entered:
            return False
        return self.exhausted or rest is not None and self.taken() >= rest

    def apply(self, t: str, arg: int) -> None:  # noqa: C901 (one branch a transition, as the sampler had them)
        if t == "enter":
            self.entered = True
        elif t in ("skip", "cut"):
            self.complete = True
        elif t == "exhaust":
            self.exhausted = True
        elif t == "end_written":
            self.ended = True
        elif t == "next_epoch":
            self.entered = self.complete = self.exhausted = self.ended = False
            self.epoch, self.before, self.yielded, self.chunk = self.epoch + 1, 0, 0, None
        elif t == "hand_out":
            self.chunk = (0, arg)
        elif t == "take" and self.chunk is not None:
            self.chunk = (min(self.chunk[1], self.chunk[0] + arg), self.chunk[1])
        elif t in ("chunk_done", "stop"):
            self.yielded, self.chunk = self.taken(), None
        elif t == "load":
            self.resume, self.resume_items, self.cut_on_join = Cursor(arg, ((1, 9),)), arg, None
        elif t == "name_epoch":
            self.hint = arg
        elif t == "cut_resumed":
            assert self.resume is not None
            self.cut_on_join = (self.resume.epoch, arg)
            self.resume, self.resume_items = Cursor(self.resume.epoch + 1, ((0, 10),)), None
            self.hint = self.resume.epoch
        elif t == "join":
            self.epoch, self.before, self.yielded, self.chunk = arg, 2, 0, None
            if self.hint is not None and self.hint == arg - 1:
                self.epoch, self.complete = self.hint, True
        elif t == "at":
            self.epoch = arg


def step(p: EpochProgress, t: str, arg: int, chunks: dict[int, Any]) -> EpochProgress:
    """Transition `t` of `p` (`take` advances the chunk in hand, outside the value, as the loop does)."""
    if t == "hand_out":
        it = iter(array.array("q", range(arg)))
        chunks[id(it)] = it
        return p.hand_out(it, arg)
    if t == "take":
        for _ in range(arg):
            if p.chunk is not None:
                next(p.chunk, None)
        return p
    if t in ("load", "cut_resumed"):
        return p.load(Cursor(arg, ((1, 9),)), arg) if t == "load" else p.cut_resumed(
            Cursor(p.resume.epoch + 1 if p.resume else 0, ((0, 10),)), arg)
    if t == "join":
        return p.join(SPEC, fresh(SPEC, arg), 2)
    if t in ("name_epoch", "at"):
        return getattr(p, t)(arg)  # type: ignore[no-any-return]
    return getattr(p, t)()  # type: ignore[no-any-return]


def fields(p: EpochProgress) -> tuple[Any, ...]:
    return tuple(getattr(p, f.name) for f in dataclasses.fields(p))


@settings(max_examples=examples(400), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(PHASES + HANDING + BEFORE_JOIN), st.integers(0, 6),
                          st.one_of(st.none(), st.integers(0, 12))), max_size=50))
def test_every_walk_agrees_with_the_reference_and_refuses_what_cannot_happen(
        walk: list[tuple[str, int, int | None]]) -> None:
    p, ref, chunks = EpochProgress(), Reference(), {}
    for t, arg, rest in walk:
        if t == "end_written" and p.end_logged:
            continue  # the sampler writes the end once: it asks end_logged first
        before, was = p, fields(p)
        try:
            p = step(p, t, arg, chunks)
        except RuntimeError as e:
            # Refused: an epoch that was skipped, exhausted or is over cannot be skipped or exhausted
            # again, a finished one cannot be entered again, a second chunk waits for the first,
            # only a loaded checkpoint's epoch can be cut before the join, and a join comes first.
            assert t in ("enter", "skip", "exhaust", "hand_out", "cut_resumed", "join")
            if t in ("enter", "skip", "exhaust", "join"):
                assert str(p.phase.value) in str(e)
            assert fields(p) == was, "a refused transition changes nothing"
            continue
        if t != "take":
            assert fields(before) == was, f"{t} changed the value it was made from"
        ref.apply(t, arg)
        assert (p.entered, p.over, p.exhausted, p.end_logged) == (
            ref.entered, ref.complete, ref.exhausted and not ref.complete, ref.ended), (t, p)
        assert (p.epoch, p.before, p.yielded, p.taken()) == (ref.epoch, ref.before, ref.yielded, ref.taken()), (t, p)
        assert (p.hint, p.resume, p.resume_items, p.cut_on_join) == (
            ref.hint, ref.resume, ref.resume_items, ref.cut_on_join), (t, p)
        assert p.yielded <= p.taken() <= p.yielded + p.chunk_len
        assert p.finished(rest) == ref.finished(rest)
        if p.settled():
            assert p.finished(rest) == p.finished(None), "a settled epoch needs no count"
        if p.phase in (Phase.EXHAUSTED, Phase.OVER, Phase.SKIPPED):
            assert p.finished(rest), "a phase past running is finished"


def test_the_walk_checks_can_fail() -> None:
    p = EpochProgress().enter().exhaust()
    with pytest.raises(RuntimeError, match="exhausted cannot enter"):
        p.enter()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.epoch = 3  # type: ignore[misc]
    nxt = p.end_written().next_epoch()
    assert (nxt.phase, nxt.end_logged, nxt.epoch) == (Phase.FRESH, False, 1)
    assert (p.phase, p.epoch) == (Phase.EXHAUSTED, 0), "the value a transition was made from is unchanged"
    with pytest.raises(RuntimeError, match="no checkpoint state"):
        EpochProgress().cut_resumed(Cursor(1, ((0, 4),)), 0)


def test_a_join_after_naming_the_finished_epoch_skips_it() -> None:
    p = EpochProgress().name_epoch(4).join(SPEC, fresh(SPEC, 5), 0)
    assert (p.epoch, p.phase) == (4, Phase.SKIPPED)
    assert EpochProgress().name_epoch(5).join(SPEC, fresh(SPEC, 5), 3) == EpochProgress(epoch=5, before=3, hint=5)


def test_a_chunk_counts_what_its_iterator_handed_out() -> None:
    for items in (array.array("q", range(5)), [[1, 2], [3], [4, 5]]):
        it = iter(items)
        p = EpochProgress(yielded=7).hand_out(it, len(items))
        next(it)
        next(it)
        assert p.taken() == 9 and position(it, len(items)) == 2
        list(it)
        assert p.taken() == 7 + len(items)
        done = p.chunk_done()
        assert (done.yielded, done.chunk, done.taken()) == (7 + len(items), None, 7 + len(items))
