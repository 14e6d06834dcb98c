"""The budget of a call, handed to the commit path as a value: its deadline (no round trip for a caller that is
gone) and, on an event loop's thread, whether it must be answered at once (no round trip at all)."""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

from croupier.core.errors import Unavailable


class WouldWait(Exception):
    """A call asked to answer at once would wait for the store or ask it: it changed nothing."""


class Acquirable(Protocol):
    """A lock :meth:`Budget.acquire` takes: ``threading.Lock``, or one with its ``acquire``."""

    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool:
        """Takes the lock within `timeout` seconds (-1: as long as it takes); whether it was taken."""
        ...


@dataclasses.dataclass(frozen=True)
class Budget:
    """What one call may spend on the store.

    Attributes:
        deadline: When its caller stops waiting (``time.monotonic()``); None: never (an in-process caller).
        at_once: The call is answered on an event loop's thread: where it would make a round trip to the
            store or wait for one, it raises :class:`WouldWait` instead, having changed nothing.
    """

    deadline: float | None = None
    at_once: bool = False

    @classmethod
    def until(cls, deadline: float | None) -> Budget:
        """A call that must be answered by `deadline` (``time.monotonic()``; None: no deadline)."""
        return cls(deadline)

    def remaining(self) -> float | None:
        """Seconds left to the call (never below 0), or None when it has no deadline."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def check(self, doing: str) -> None:
        """Unavailable, naming `doing`, when the call is past its deadline: its caller has gone."""
        left = self.remaining()
        if left is not None and left <= 0.0:
            raise Unavailable(f"the call's deadline passed before {doing}: its caller is no longer waiting (not done)")

    def check_at_once(self, doing: str) -> None:
        """WouldWait, naming `doing`, when the call is answered at once (see :attr:`at_once`)."""
        if self.at_once:
            raise WouldWait(doing)

    def acquire(self, lock: Acquirable, doing: str) -> None:
        """Takes `lock` within the call's deadline (without one: as long as it takes), else Unavailable."""
        left = self.remaining()
        if left is None:
            lock.acquire()
            return
        if left <= 0.0 or not lock.acquire(timeout=left):
            raise Unavailable(f"the call's deadline passed while waiting to {doing}: not done")


#: The budget of a call with no deadline, answered on the thread that asks (an in-process caller).
UNBOUNDED = Budget()
