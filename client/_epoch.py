"""Where a sampler is in its epochs (`EpochProgress`): one immutable value, changed only by named transitions."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from croupier.core.cursor import Cursor, epoch_agrees

if TYPE_CHECKING:
    from croupier.core.spec import Spec


class Phase(enum.Enum):
    """The life of the current epoch for this rank::

        FRESH --enter--> RUNNING --exhaust--> EXHAUSTED
          |                 |                    |
        skip, cut          cut                  cut
          v                 v                    v
        SKIPPED --enter--> OVER <----------------+

        next_epoch: any phase -> FRESH of the next epoch

    FRESH: no iteration of the epoch has begun. SKIPPED: the epoch is over before any iteration
    of it (the checkpoint the generation resumed from finished it, named by ``set_epoch`` before
    the join, or the trainer cut it). RUNNING: an iteration has begun; leases flow. EXHAUSTED:
    this rank's leases ran out (every item of its share was handed out). OVER: the epoch is over
    other than by its leases running out, after an iteration began (the trainer cut it, or it was
    SKIPPED and has been iterated, yielding nothing).
    """

    FRESH = "fresh"
    SKIPPED = "skipped"
    RUNNING = "running"
    EXHAUSTED = "exhausted"
    OVER = "over"


#: Transition -> {phase it may leave: phase it enters}.
_MOVES: dict[str, dict[Phase, Phase]] = {
    "enter": {Phase.FRESH: Phase.RUNNING, Phase.RUNNING: Phase.RUNNING, Phase.SKIPPED: Phase.OVER},
    "skip": {Phase.FRESH: Phase.SKIPPED},
    "exhaust": {Phase.RUNNING: Phase.EXHAUSTED},
    "cut": {Phase.FRESH: Phase.SKIPPED, Phase.SKIPPED: Phase.SKIPPED, Phase.RUNNING: Phase.OVER,
            Phase.EXHAUSTED: Phase.OVER, Phase.OVER: Phase.OVER},
}


@dataclasses.dataclass(frozen=True)
class EpochProgress:
    """Where a sampler is in its data: the epoch in hand, its phase and counts, and what it resumes from.

    A value: every transition returns a new one and leaves this one as it was; one that cannot
    happen raises ``RuntimeError`` naming the phase. Items are what the sampler yields (indices,
    or batches for the batch sampler).

    Attributes:
        epoch: The epoch being (or last) iterated.
        phase: That epoch's life (:class:`Phase`).
        end_logged: The audit log has that epoch's ``end`` record (written once).
        before: Items of `epoch` this rank took before its generation began (its resumed share).
        yielded: Items of `epoch` yielded by this generation, up to the chunk in hand.
        chunk: The iterator of the lease being handed out (its position counts as taken), or None.
        chunk_len: The items `chunk` holds.
        hint: The epoch ``set_epoch`` named before the join, if any.
        resume: The cursor loaded from a checkpoint state, until the join.
        resume_items: Items of the resumed epoch taken before that checkpoint (the state's items).
        cut_on_join: ``(epoch, items)`` of a resumed epoch that ``set_epoch`` cut before the join.
    """

    epoch: int = 0
    phase: Phase = Phase.FRESH
    end_logged: bool = False
    before: int = 0
    yielded: int = 0
    chunk: Iterator[Any] | None = dataclasses.field(default=None, compare=False)
    chunk_len: int = 0
    hint: int | None = None
    resume: Cursor | None = None
    resume_items: int | None = None
    cut_on_join: tuple[int, int] | None = None

    # ---------------------------------------------------------------- before the join

    def load(self, resume: Cursor | None, items: int | None) -> EpochProgress:
        """A checkpoint state was loaded: the generation will resume from `resume` (None: the start)."""
        return dataclasses.replace(self, resume=resume, resume_items=items, cut_on_join=None)

    def name_epoch(self, epoch: int) -> EpochProgress:
        """``set_epoch(epoch)`` before the join: the epoch the first iteration goes through."""
        return dataclasses.replace(self, hint=epoch)

    def cut_resumed(self, fresh: Cursor, taken: int) -> EpochProgress:
        """``set_epoch`` moved on from the resumed epoch before the join, after `taken` items: the
        rest of it is not trained, and the generation starts `fresh` (the next epoch)."""
        if self.resume is None:
            raise RuntimeError("no checkpoint state was loaded: there is no resumed epoch to cut")
        return dataclasses.replace(self, cut_on_join=(self.resume.epoch, taken), resume=fresh, resume_items=None,
                                   hint=fresh.epoch)

    def join(self, spec: Spec, start: Cursor, before: int) -> EpochProgress:
        """The generation of a job with `spec` started at `start`, this rank having taken `before` items of it.

        When ``set_epoch`` named the epoch before `start` that agrees with it (the epoch just before
        a fresh start: the checkpoint finished it), that epoch is the one in hand, SKIPPED: its
        iteration yields nothing.
        """
        if self.phase is not Phase.FRESH:
            raise RuntimeError(f"an epoch in phase {self.phase.value} cannot join: a sampler joins before its first iteration")
        p = dataclasses.replace(self, epoch=start.epoch, before=before, yielded=0, chunk=None, chunk_len=0)
        if self.hint is not None and self.hint < start.epoch and epoch_agrees(spec, start, self.hint):
            p = dataclasses.replace(p, epoch=self.hint)._move("skip")
        return p

    def at(self, epoch: int) -> EpochProgress:
        """An empty dataset's sampler (nothing to deal, no join) is at `epoch`."""
        return dataclasses.replace(self, epoch=epoch)

    # ---------------------------------------------------------------- the epoch's life

    def _move(self, transition: str) -> EpochProgress:
        to = _MOVES[transition].get(self.phase)
        if to is None:
            raise RuntimeError(f"an epoch in phase {self.phase.value} cannot {transition}")
        return dataclasses.replace(self, phase=to)

    def enter(self) -> EpochProgress:
        """An iteration of the epoch begins (or a new iterator takes over the one in hand)."""
        return self._move("enter")

    def skip(self) -> EpochProgress:
        """The checkpoint finished this epoch before any iteration of it."""
        return self._move("skip")

    def exhaust(self) -> EpochProgress:
        """This rank's last lease of the epoch was taken."""
        return self._move("exhaust")

    def cut(self) -> EpochProgress:
        """The trainer moved on to the next epoch: the rest of this one is not trained."""
        return self._move("cut")

    def end_written(self) -> EpochProgress:
        """The audit log's ``end`` record of the epoch is written (check `end_logged` first: once only)."""
        return dataclasses.replace(self, end_logged=True)

    def next_epoch(self) -> EpochProgress:
        """The next epoch begins, FRESH, with nothing taken."""
        return EpochProgress(epoch=self.epoch + 1, hint=self.hint, resume=self.resume,
                             resume_items=self.resume_items, cut_on_join=self.cut_on_join)

    # ---------------------------------------------------------------- handing out

    def hand_out(self, chunk: Iterator[Any], size: int) -> EpochProgress:
        """A lease of `size` items starts being handed out through `chunk` (an array's or a list's iterator)."""
        if self.chunk is not None:
            raise RuntimeError("a chunk is being handed out already: finish or stop it first")
        return dataclasses.replace(self, chunk=chunk, chunk_len=size)

    def chunk_done(self) -> EpochProgress:
        """The chunk in hand was used up (or let go of): what it handed out is yielded."""
        return self.stop()

    def stop(self) -> EpochProgress:
        """The iteration in hand stops: the items taken so far count, the chunk is let go of."""
        if self.chunk is None:
            return self
        return dataclasses.replace(self, yielded=self.taken(), chunk=None, chunk_len=0)

    # ---------------------------------------------------------------- reads

    def taken(self) -> int:
        """Items of `epoch` yielded by this generation, the chunk in hand's included."""
        if self.chunk is None:
            return self.yielded
        # NOTE: a chunk is handed out through an iterator, at C speed; how far it got is the
        # iterator's position, read only when someone asks.
        return self.yielded + position(self.chunk, self.chunk_len)

    @property
    def entered(self) -> bool:
        """An iteration of the epoch has begun."""
        return self.phase in (Phase.RUNNING, Phase.EXHAUSTED, Phase.OVER)

    @property
    def over(self) -> bool:
        """The epoch ended other than by its leases running out: cut, or finished by the checkpoint."""
        return self.phase in (Phase.SKIPPED, Phase.OVER)

    @property
    def exhausted(self) -> bool:
        """This rank's leases of the epoch ran out."""
        return self.phase is Phase.EXHAUSTED

    def finished(self, rest: int | None) -> bool:
        """Whether the epoch is over for this rank, `rest` being its items in it (None: not known yet)."""
        if self.over:
            return True
        if not self.entered:
            return False
        return self.exhausted or rest is not None and self.taken() >= rest

    def settled(self) -> bool:
        """Whether :meth:`finished` is decided without the epoch's count (so none need be computed)."""
        return self.over or not self.entered or self.exhausted


def position(it: Iterator[Any], size: int) -> int:
    """How many items the iterator of an ``array.array`` or a list of `size` items has handed out."""
    state = it.__reduce__()  # (iter, (array,), position), or (iter, ((),)) once exhausted
    return int(state[2]) if len(state) > 2 else size
