"""The coordinator calls of this process and ``fork()`` exclude each other: no call is in flight across a fork.

A ``DataLoader`` forks its workers while the sampler's prefetch thread may be inside a gRPC call (a grant).
gRPC's own fork handlers then find another thread inside gRPC: they are skipped (gRPC logs "Other threads are
currently calling into gRPC, skipping fork() handlers") and the child inherits gRPC's state mid-call. Here a
fork waits for the calls in flight to end (each has a deadline; the wait is bounded by :data:`WAIT_S`), and a
call that would begin during a fork waits until the fork is done. No lock is held while either waits.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

__all__ = ["WAIT_S", "calling", "gate"]

#: How long a fork waits at most for the coordinator calls in flight: a prefetch thread's grant waits at most
#: 1 s for its answer (a call of another thread may wait longer, a join's long poll; the fork goes on past this).
WAIT_S = 1.0


class _Gate:
    """Counts the calls in flight and the forks in progress."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._calls = 0
        self._forks = 0

    def enter(self) -> None:
        """A call begins: after any fork in progress."""
        with self._cond:
            while self._forks:
                self._cond.wait()
            self._calls += 1

    def leave(self) -> None:
        """A call ended (answered, failed or timed out)."""
        with self._cond:
            self._calls -= 1
            if not self._calls:
                self._cond.notify_all()

    def before_fork(self) -> None:
        """A fork begins: no call starts from now on, and the calls in flight end first (within WAIT_S)."""
        with self._cond:
            self._forks += 1
            until = time.monotonic() + WAIT_S
            while self._calls:
                left = until - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)

    def after_fork_parent(self) -> None:
        """The fork is done (or failed): calls may begin again."""
        with self._cond:
            self._forks -= 1
            if not self._forks:
                self._cond.notify_all()

    def after_fork_child(self) -> None:
        """In the child: only the forking thread lives on, so no call is in flight and no fork in progress; the
        lock may have been held by a thread the child does not have."""
        self._cond = threading.Condition(threading.Lock())
        self._calls = self._forks = 0

    @property
    def in_flight(self) -> int:
        """Calls in flight now."""
        return self._calls


gate = _Gate()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=gate.before_fork, after_in_parent=gate.after_fork_parent,
                        after_in_child=gate.after_fork_child)


@contextlib.contextmanager
def calling() -> Iterator[None]:
    """Around one attempt of a coordinator call (never around a wait between attempts)."""
    gate.enter()
    try:
        yield
    finally:
        gate.leave()
