"""A join that waits for its generation to start, in-process: what the served coordinator's waiting join does
(``croupier.server._join_wait``), for tests that drive a ``Coordinator`` without a server."""

from __future__ import annotations

import threading
import time

from croupier.core.api import JoinRequest, JoinResult
from croupier.server._coordinator import Coordinator
from croupier.server._join_wait import SHARED_POLL_S


def join_started(core: Coordinator, req: JoinRequest, wait_s: float) -> JoinResult:
    """Joins `req`, then waits up to `wait_s` seconds for its generation to start, be replaced, or the coordinator
    to stop; returns the rank's answer then (its generation's start, or the ranks still missing).

    The wait is the served one's: a listener on the coordinator (``Coordinator.on_start``); on a shared store,
    whose other replicas' joins arrive through the journal, it reads the journal every ``SHARED_POLL_S``.
    """
    result = core.join(req)
    if result.start is not None or wait_s <= 0:
        return result
    started = threading.Event()
    end = time.monotonic() + wait_s
    if core.on_start(req.job, result.generation, started.set):
        try:
            while not started.is_set() and (left := end - time.monotonic()) > 0:
                # NOTE: the interval between two looks at a shared store's journal, not synchronisation: the
                # start comes through the listener, which a read of the journal calls.
                started.wait(min(left, SHARED_POLL_S) if core.store.shared else left)
                if core.store.shared and not started.is_set():
                    core.poll()
        finally:
            core.off_start(req.job, result.generation, started.set)
    return core.join_answer(req.job, req.rank)
