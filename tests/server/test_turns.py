"""FairLock: a replica's round trips take turns in the order they asked."""

from __future__ import annotations

import threading

import pytest

from croupier.server._turns import FairLock


def _waiting(lock: FairLock, n: int) -> None:
    """Returns once `n` threads wait for `lock` (they have asked; none can be handed it meanwhile: it is held)."""
    while len(lock._waiters) < n:
        pass


def test_a_release_hands_the_lock_to_the_threads_in_the_order_they_asked() -> None:
    lock = FairLock()
    order: list[int] = []
    assert lock.acquire()

    def take(i: int) -> None:
        assert lock.acquire()
        order.append(i)
        lock.release()

    threads = []
    for i in range(5):
        t = threading.Thread(target=take, args=(i,))
        t.start()
        _waiting(lock, i + 1)
        threads.append(t)
    lock.release()
    for t in threads:
        t.join()
    assert order == [0, 1, 2, 3, 4]
    assert not lock.locked()


def test_a_thread_that_releases_and_asks_again_at_once_waits_its_turn() -> None:
    """Fails with threading.Lock, which the releasing thread takes back before the waiter wakes."""
    lock = FairLock()
    assert lock.acquire()
    got = threading.Event()
    done = threading.Event()

    def waiter() -> None:
        lock.acquire()
        got.set()
        done.wait(10.0)
        lock.release()

    t = threading.Thread(target=waiter)
    t.start()
    _waiting(lock, 1)
    lock.release()
    assert not lock.acquire(blocking=False), "the releasing thread took the lock back before the waiter"
    assert got.wait(10.0)
    done.set()
    assert lock.acquire(timeout=10.0)
    lock.release()
    t.join()


def test_a_wait_that_times_out_leaves_no_turn_behind() -> None:
    lock = FairLock()
    assert lock.acquire()
    assert not lock.acquire(timeout=0.05)
    assert len(lock._waiters) == 0
    lock.release()
    assert not lock.locked() and lock.acquire(blocking=False)
    lock.release()
    with pytest.raises(RuntimeError, match="not held"):
        lock.release()
