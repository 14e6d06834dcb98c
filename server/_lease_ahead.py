"""Leases computed ahead (the Lease RPC): a rank's next lease is made while it trains on the one it got."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from croupier.core.plan import EpochPlan, Grant

log = logging.getLogger("croupier.server")

#: The indices computed ahead that are kept, in bytes (int64): 256 leases of 65,536 indices. Beyond
#: it the oldest go; a lease that is asked and not kept is computed when it is asked, as before.
BUDGET_BYTES = 128 << 20
#: Leases waiting to be computed ahead; beyond it the oldest waiting are dropped.
MAX_WAITING = 1024

Key = tuple[Any, ...]
Computed = tuple[np.ndarray, list[int]]


def _key(plan: EpochPlan, rank: int, first: int, count: int) -> Key | None:
    """What names a lease of `plan` for the cache, or None for a plan whose leases are not kept.

    NOTE: only a portable plan (``EpochPlan.portable``: a pure function of (spec, cursor, world),
    its leases computed from the plan alone, never from a grant) is kept: its lease asked later is
    the one computed now, bit for bit. A spec with per-sample lengths is left out: hashing its key
    would cost O(n) a call.
    """
    if not plan.portable or plan.spec.lengths is not None:
        return None
    return (plan.spec, plan.cursor, plan.world, rank, first, count)


class LeaseAhead:
    """The coordinator's leases: computed one at a time (under `compute`), and each rank's next one ahead.

    When a lease of a portable plan is served and the rank has batches after it, the lease that
    follows it (the same count, from the next batch) is computed in a background thread and kept
    (at most ``BUDGET_BYTES``, the oldest dropped first); the rank's next call takes it without
    computing. What a call is answered is the same either way: fencing, validation and progress
    are the caller's, before it asks here, and the lease itself is a pure function of its key.

    Args:
        compute: The lock every lease computation takes (numpy work that holds the GIL in short
            bursts: one at a time, so that threads do not trade the GIL back and forth).
    """

    def __init__(self, compute: threading.Lock) -> None:
        self._compute = compute
        self._cond = threading.Condition()  # guards everything below
        self._ready: collections.OrderedDict[Key, Computed] = collections.OrderedDict()
        self._bytes = 0
        self._waiting: collections.OrderedDict[Key, tuple[EpochPlan, int, int, int]] = collections.OrderedDict()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._computing: Key | None = None  # the lease the thread is computing
        self._held = 0  # answers on their way out (see hold): nothing starts to be computed ahead meanwhile
        self.hits = 0  # calls answered from what was computed ahead (for tests and metrics)

    def lease(self, plan: EpochPlan, rank: int, first: int, count: int, grant: Grant | None) -> Computed:
        """``plan.lease(rank, first, count, grant)``: taken from what was computed ahead when it is there."""
        key = _key(plan, rank, first, count)
        got: Computed | None = None
        if key is not None:
            with self._cond:
                # being computed ahead now: wait for it rather than compute it twice
                self._cond.wait_for(lambda: self._computing != key)
                got = self._take(key)
                self._waiting.pop(key, None)  # asked before it was computed ahead: it is computed here
        if got is None:
            with self._compute:
                got = plan.lease(rank, first, count, grant)
        self._next(key, plan, rank, first, count, grant, got)
        return got

    def ready(self, plan: EpochPlan, rank: int, first: int, count: int, grant: Grant | None) -> Computed | None:
        """:meth:`lease` when it was computed ahead and is there now, else None: never computes, never waits.

        What an event loop's thread may ask (a lease answered there costs no hop to a worker thread);
        with None it hands the call to a thread, which asks :meth:`lease`.
        """
        key = _key(plan, rank, first, count)
        if key is None:
            return None
        with self._cond:
            got = None if self._computing == key else self._take(key)
        if got is not None:
            self._next(key, plan, rank, first, count, grant, got)
        return got

    def _take(self, key: Key) -> Computed | None:
        """The lease kept under `key`, no longer kept, or None (the caller holds the lock)."""
        got = self._ready.pop(key, None)
        if got is not None:
            self._bytes -= got[0].nbytes
            self.hits += 1
        return got

    def _next(self, key: Key | None, plan: EpochPlan, rank: int, first: int, count: int, grant: Grant | None,
              got: Computed) -> None:
        """Has the lease after `got` (kept under `key`) computed ahead, when `plan`'s leases are kept and the
        rank has batches after it."""
        sizes = got[1]
        if key is not None and sizes and not plan.ends(rank, first, count, len(sizes), grant):
            self._ahead(plan, rank, first + len(sizes), count)

    def _ahead(self, plan: EpochPlan, rank: int, first: int, count: int) -> None:
        key = _key(plan, rank, first, count)
        assert key is not None
        with self._cond:
            if self._closed or key in self._ready:
                return
            self._waiting[key] = (plan, rank, first, count)
            self._waiting.move_to_end(key)
            while len(self._waiting) > MAX_WAITING:
                self._waiting.popitem(last=False)
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="croupier-lease-ahead", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while (not self._waiting or self._held) and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                key, (plan, rank, first, count) = self._waiting.popitem(last=False)
                self._computing = key
            got: Computed | None = None
            try:
                with self._compute:
                    got = plan.lease(rank, first, count, None)
            except Exception:  # the call computes it then, and raises there if it still fails
                log.debug("a lease computed ahead failed", exc_info=True)
            with self._cond:
                self._computing = None
                self._cond.notify_all()
                if self._closed:
                    return
                if got is not None:
                    self._keep(key, got)

    def _keep(self, key: Key, got: Computed) -> None:
        """Keeps a lease computed ahead, dropping the oldest beyond the budget (the caller holds the lock)."""
        self._ready[key] = got
        self._bytes += got[0].nbytes
        while self._bytes > BUDGET_BYTES and self._ready:
            _, old = self._ready.popitem(last=False)
            self._bytes -= old[0].nbytes

    def hold(self) -> Callable[[], None]:
        """Holds back computing ahead until the function returned is called (again: no-op): an answer is on its way.

        NOTE: computing ahead is numpy work that takes the GIL back after each of its ~150 steps; begun
        while an answer of 256 KiB is made, serialized and handed to gRPC, it makes each of those steps
        wait for the GIL (measured: a paced lease's p50 2-4 ms longer). The serving layer holds it for
        each Lease call until the call's answer is handed to gRPC; a lease being computed ahead when the
        hold begins is finished.
        """
        with self._cond:
            self._held += 1
        released = False

        def release() -> None:
            nonlocal released
            with self._cond:
                if not released:
                    released = True
                    self._held -= 1
                    self._cond.notify_all()

        return release

    def idle(self, timeout: float) -> bool:
        """Waits up to `timeout` s until nothing is waiting to be computed ahead; whether that is so."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._waiting and self._computing is None, timeout)

    def close(self) -> None:
        """Stops the background thread and drops what it kept."""
        with self._cond:
            self._closed = True
            self._ready.clear()
            self._waiting.clear()
            self._bytes = 0
            self._cond.notify_all()
