"""The prefetcher: one rank's leases of one epoch, asked of the coordinator and computed ahead of the loop, in a thread."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from croupier.client import _expander
from croupier.client._rpc import CoordinatorClient, LeaseReply, Unreachable
from croupier.core.api import Grant
from croupier.core.mixture import sample_seeds
from croupier.core.order import tags
from croupier.core.plan import EpochPlan

log = logging.getLogger("croupier")
_DONE = object()
#: How long a lease waits for the coordinator's answer before the rank computes it itself; and
#: that wait while the coordinator is not answering.
_ASK_S, _PROBE_S = 1.0, 0.25
#: Indices of a generation's first lease (whole batches, at least one): its first batch waits for
#: this many, not for a whole lease (65,536 by default), and its next lease is made meanwhile.
FIRST_LEASE_INDICES = 1024


class Prefetcher:
    """Prepares batches of one rank in one epoch ahead of use, in a background thread, at most `depth` leases ahead.

    Every lease is asked of the coordinator, which fences replaced generations, as a grant: which
    batches of the generation's plan the rank takes (a few bytes), not their indices. The
    indices are computed from the plan by this process's lease helper process
    (`croupier.client._expander`: in a thread here the computation would contend for the GIL
    with the training loop; ``CROUPIER_EXPANDER=0`` computes here instead). When the coordinator
    does not answer within 1 s (0.25 s while it keeps not answering),
    the rank computes the lease from its plan, the same code the coordinator runs (its data
    cannot have changed: only a join changes it, and a join needs the coordinator), and asks
    again at the next lease; a lease refused as fenced stops it. With `ramp` (the generation's first
    lease) the first lease holds about ``FIRST_LEASE_INDICES`` indices, so the first batch does not
    wait for a whole lease to be computed.
    """

    def __init__(self, client: CoordinatorClient, job: str, generation: int, rank: int, epoch: int, first: int,
                 lease_size: int, depth: int, plan: EpochPlan, tag: bool = False,
                 read_ahead: Callable[[np.ndarray], object] | None = None, ramp: bool = False) -> None:
        self._q: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._args = (client, job, generation, rank, epoch)
        self._next = self._first = first
        self._lease_size = lease_size
        # `ramp`: the generation's first lease is small (FIRST_LEASE_INDICES), the next ones lease_size
        self._first_size = min(lease_size, max(1, FIRST_LEASE_INDICES // plan.spec.batch_size)) if ramp else lease_size
        self._plan = plan
        self._tag = tag  # each lease also carries its samples' sources, source epochs and seeds
        self._read_ahead = read_ahead  # told each lease's indices as they are computed (the sampler's read_ahead)
        self.ungranted = 0  # leases computed while the coordinator did not answer
        #: (epoch, batches) the consumer's loop had taken when it last took a lease: reported with
        #: the next request (the consumer sets it; a tuple is replaced whole)
        self.progress: tuple[int, int] | None = None
        self._thread = threading.Thread(target=self._run, name=f"croupier-lease-r{rank}-e{epoch}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._lease_all()
        except BaseException as e:  # handed to the consumer, which raises it
            self._put(e)
        self._put(_DONE)

    def _lease_all(self) -> None:
        """Asks for grants and computes their leases until the rank's epoch ends (or it is stopped)."""
        client, job, gen, rank, epoch = self._args
        plan, count = self._plan, self._first_size
        missed = False  # the last ask went unanswered
        while not self._stop.is_set():
            if self._next > self._first:  # past the first lease: full ones
                count = self._lease_size
            got: Grant | None
            asked = time.monotonic()
            # NOTE: while the coordinator does not answer, each lease still asks, but waits
            # only _PROBE_S: a stopped (not dead) coordinator never refuses, and a full
            # _ASK_S per lease could outlast the leases queued ahead of the loop.
            try:
                got = client.grant(job, gen, rank, epoch, self._next, count, timeout=_PROBE_S if missed else _ASK_S,
                                   progress=self.progress)
                if missed:
                    log.warning("croupier: the coordinator of job %r answers again (rank %d)", job, rank)
                missed = False
            except Unreachable:
                if client.closed:
                    return
                got = plan.own_grant(rank, self._next, count)  # None: only the coordinator grants
                if not missed:
                    log.warning("croupier: the coordinator of job %r does not answer; rank %d %s", job, rank,
                                "waits for it (its batches are dealt there)" if got is None
                                else "trains on from its plan and asks again at every lease")
                missed = True
                if got is None:
                    # An answer that comes at once (a refused connection, a failed store beside us)
                    # is asked again no sooner than a probe's wait later, not in a loop.
                    self._stop.wait(max(0.0, _PROBE_S - (time.monotonic() - asked)))
                    continue
                self.ungranted += 1
            idx, sizes = _expander.lease(plan, rank, self._next, count, got)
            if got is not None and not plan.agrees(got, sizes):
                raise RuntimeError(
                    f"the coordinator granted {got.batches} batches (the last of {got.last_size}) from batch "
                    f"{self._next} of epoch {epoch}, but this rank's plan has {len(sizes)}: the client and the "
                    "coordinator compute different plans (another croupier release?)"
                )
            end = plan.ends(rank, self._next, count, len(sizes), got)
            tags = self._tags(idx, self._next, count, got) if self._tag and sizes else None
            self._next += len(sizes)
            if sizes and self._read_ahead is not None:
                self._tell(idx)
            if sizes:
                self._put(LeaseReply(idx, sizes, end, plan.known_samples(rank), checked=True, tags=tags))
            if end:
                return

    def _tags(self, idx: np.ndarray, first: int, count: int,
              got: Grant | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(source, source epoch, seed) of each index of a lease, from the positions the plan dealt them at."""
        plan, (_, _, _, rank, epoch) = self._plan, self._args
        pos = plan.lease_positions(rank, first, count, got)
        if pos.size != idx.size:
            raise RuntimeError(f"the plan names {pos.size} positions for a lease of {idx.size} indices")
        source, source_epoch = tags(plan.spec, epoch, pos)
        return source, source_epoch, sample_seeds(plan.spec.seed, source, source_epoch, idx)

    def _tell(self, idx: np.ndarray) -> None:
        """Hands a lease's indices to the sampler's ``read_ahead``; a failure there is logged, never the loop's."""
        assert self._read_ahead is not None
        try:
            self._read_ahead(idx)
        except Exception:
            log.exception("croupier: read_ahead failed on a lease of %d indices (rank %d); training goes on",
                          idx.size, self._args[3])

    def _put(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def get(self) -> LeaseReply | None:
        """The next lease; None after the last one."""
        item = self._q.get()
        if item is _DONE:
            return None
        if isinstance(item, BaseException):
            raise item
        return item  # type: ignore[no-any-return]

    def close(self) -> None:
        self._stop.set()
