"""The bounds of the call a thread serves, so that they reach the store: its deadline (no round trip for a caller
that is gone) and, on an event loop's thread, that it is answered at once (no round trip at all)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Protocol

from croupier.core.errors import Unavailable

_local = threading.local()


@contextlib.contextmanager
def until(deadline: float | None) -> Iterator[None]:
    """Within the block, this thread serves a call that must be answered by `deadline` (time.monotonic(); None: no deadline)."""
    before = getattr(_local, "deadline", None)
    _local.deadline = deadline
    try:
        yield
    finally:
        _local.deadline = before


def remaining() -> float | None:
    """Seconds left to this thread's call (never below 0), or None when it has no deadline."""
    deadline: float | None = getattr(_local, "deadline", None)
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def check(doing: str) -> None:
    """Unavailable, naming `doing`, when this thread's call is past its deadline: its caller has gone."""
    left = remaining()
    if left is not None and left <= 0.0:
        raise Unavailable(f"the call's deadline passed before {doing}: its caller is no longer waiting (not done)")


class Acquirable(Protocol):
    """A lock ``wait_for`` takes: ``threading.Lock``, or one with its ``acquire``."""

    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool:
        """Takes the lock within `timeout` seconds (-1: as long as it takes); whether it was taken."""
        ...


def wait_for(lock: Acquirable, doing: str) -> None:
    """Takes `lock` within this thread's call's deadline (without one: as long as it takes), else Unavailable."""
    left = remaining()
    if left is None:
        lock.acquire()
        return
    if left <= 0.0 or not lock.acquire(timeout=left):
        raise Unavailable(f"the call's deadline passed while waiting to {doing}: not done")


class WouldWait(Exception):
    """A call asked to answer at once would wait for the store or ask it: it changed nothing."""


@contextlib.contextmanager
def at_once() -> Iterator[None]:
    """Within the block, this thread answers a call at once (an event loop's thread): :func:`check_at_once`
    raises :class:`WouldWait` where the call would make a round trip to the store or wait for one."""
    before = getattr(_local, "at_once", False)
    _local.at_once = True
    try:
        yield
    finally:
        _local.at_once = before


def check_at_once(doing: str) -> None:
    """WouldWait, naming `doing`, when this thread answers at once (see :func:`at_once`)."""
    if getattr(_local, "at_once", False):
        raise WouldWait(doing)
