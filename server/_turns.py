"""A lock granted in the order it was asked for: a replica's round trips to its store take turns."""

from __future__ import annotations

import collections
import threading


class FairLock:
    """A mutual-exclusion lock that hands itself to the longest-waiting thread on release.

    NOTE: ``threading.Lock`` is not fair: a thread that releases it and asks again at once (a
    replica's report writer, a client committing in a loop) usually takes it back before a thread
    that was already waiting wakes up, so a waiter may sit through several appends to a slow
    database. Here a release hands the lock to the first waiter: a thread waits for at most the
    round trips of the threads that asked before it.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        #: One locked lock per waiting thread, in the order they asked; released to hand over.
        self._waiters: collections.deque[threading.Lock] = collections.deque()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Takes the lock, waiting at most `timeout` seconds (-1: as long as it takes); whether it was taken."""
        with self._mutex:
            if not self._held and not self._waiters:
                self._held = True
                return True
            if not blocking:
                return False
            turn = threading.Lock()
            turn.acquire()
            self._waiters.append(turn)
        if turn.acquire(timeout=timeout):
            return True  # handed over by release(): held for this thread
        with self._mutex:
            try:
                self._waiters.remove(turn)
            except ValueError:  # handed over as the wait timed out: it is this thread's now
                return True
            return False

    def release(self) -> None:
        """Hands the lock to the longest-waiting thread, or frees it."""
        with self._mutex:
            if not self._held:
                raise RuntimeError("release of a FairLock that is not held")
            if self._waiters:
                self._waiters.popleft().release()  # still held: by the waiter now
            else:
                self._held = False

    def locked(self) -> bool:
        """Whether some thread holds the lock."""
        return self._held
