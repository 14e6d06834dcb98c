"""The life of one epoch in a sampler, as one small state with named transitions.

::

    FRESH --enter--> RUNNING --exhaust--> EXHAUSTED
      |                 |                    |
    skip, cut          cut                  cut
      v                 v                    v
    SKIPPED --enter--> OVER <----------------+

    next_epoch: any phase -> FRESH of the next epoch

FRESH      no iteration of the epoch has begun.
SKIPPED    the epoch is over before any iteration of it: the checkpoint the generation resumed
           from finished it (named by ``set_epoch`` before the join), or the trainer cut it.
RUNNING    an iteration has begun; leases flow.
EXHAUSTED  this rank's leases ran out: every item of its share was handed out.
OVER       the epoch is over for this rank other than by its leases running out, after an
           iteration began: the trainer cut it (``set_epoch`` of the next epoch), or it was
           SKIPPED and has been iterated (yielding nothing).
"""

from __future__ import annotations

import dataclasses
import enum


class Phase(enum.Enum):
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


@dataclasses.dataclass
class EpochLife:
    """Where this rank is in the life of its current epoch; changed only by the named transitions.

    Attributes:
        phase: See the module.
        end_logged: The audit log has this epoch's ``end`` record (written once).
    """

    phase: Phase = Phase.FRESH
    end_logged: bool = False

    def _move(self, transition: str) -> None:
        to = _MOVES[transition].get(self.phase)
        if to is None:
            raise RuntimeError(f"an epoch in phase {self.phase.value} cannot {transition}")
        self.phase = to

    def enter(self) -> None:
        """An iteration of the epoch begins (or a new iterator takes over the one in hand)."""
        self._move("enter")

    def skip(self) -> None:
        """The checkpoint finished this epoch before any iteration of it."""
        self._move("skip")

    def exhaust(self) -> None:
        """This rank's last lease of the epoch was taken."""
        self._move("exhaust")

    def cut(self) -> None:
        """The trainer moved on to the next epoch: the rest of this one is not trained."""
        self._move("cut")

    def log_end(self) -> bool:
        """Marks the epoch's ``end`` record written; True the first time only (write it then)."""
        first = not self.end_logged
        self.end_logged = True
        return first

    def next_epoch(self) -> None:
        """The next epoch begins, FRESH."""
        self.phase, self.end_logged = Phase.FRESH, False

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

    def finished(self, taken: int, rest: int | None) -> bool:
        """Whether the epoch is over for this rank, having taken `taken` of its `rest` items (None: not known yet)."""
        if self.over:
            return True
        if not self.entered:
            return False
        return self.exhausted or rest is not None and taken >= rest
