"""Replicas on one shared store (``postgresql://``, no leader): the commit protocol that appends each decision at the
seq this replica has applied and decides again on a conflict (``croupier.server._commits.Commits``)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from croupier.core.api import now_ms
from croupier.core.errors import CroupierError, Unavailable
from croupier.server._commits import Changed, Journaled, T
from croupier.server._deadline import UNBOUNDED, Budget
from croupier.server._decide import decide_report
from croupier.server._events import Event
from croupier.server._journal import pack_event, replay
from croupier.server._state import State
from croupier.server._store import Recovered, Store, StoreConflict, StoreError, StoreUnavailable, Watched
from croupier.server._turns import FairLock

log = logging.getLogger("croupier.server")

#: How often the progress reports gathered are appended (at most), and the conflicting appends in a row after
#: which a decision gives up (UNAVAILABLE: the client retries).
REPORTS_EVERY_S, CONFLICTS = 0.05, 100


class SharedCommits(Journaled):
    """Replicas on one database: append at the seq applied, decide again on a conflict.

    NOTE: a lock of this replica's own (``_io``) serializes its round trips to the store (the
    Store contract's one driving thread per process), so a decision and the append that follows
    it see no other read or write of this replica in between. The coordinator's lock is taken
    only to decide and to apply: the append runs outside it, at the seq the decision read, and
    its events are applied after it, still under ``_io``, so in seq order. A read answered from
    the state (a watched journal end within the staleness bound, or after its own refresh) never
    waits for another call's append. A call takes ``_io`` within its deadline and checks the
    deadline before each round trip: the call of a client that is gone never reaches the store.
    """

    def __init__(self, store: Store, state: State, rec: Recovered, snapshot_every: int,
                 changed: Changed, max_staleness_s: float) -> None:
        super().__init__(store, state, rec, snapshot_every, changed)
        self._max_staleness_s = max_staleness_s
        self._io = FairLock()  # taken in turn: a waiter sits through the appends asked before it, no more
        #: progress reports not journaled yet: (job, generation, rank) -> (epoch, batches, ms)
        self._reports: dict[tuple[str, int, int], tuple[int, int, int]] = {}

    @contextlib.contextmanager
    def _round_trips(self, doing: str, budget: Budget) -> Iterator[None]:
        """This replica's turn to talk to the store, taken within the call's deadline (else Unavailable)."""
        budget.acquire(self._io, doing)
        try:
            yield
        finally:
            self._io.release()

    def _unavailable(self, e: StoreError) -> Unavailable:
        """The Unavailable a caller gets for `e`; a failure that is not a lost connection fails the protocol."""
        if isinstance(e, StoreUnavailable):
            # NOTE: nothing was applied here; whether a commit landed (a connection lost during
            # it) the next read of the journal tells.
            return Unavailable(f"the coordinator's store {self.store.url} is unavailable: {e}")
        with self._cond:
            self._fail(e)
        return Unavailable(f"the coordinator's store {self.store.url} failed: {e}")

    def commit(self, decide: Callable[[], tuple[T, list[Event]]], durable: bool, budget: Budget) -> T:
        for _ in range(CONFLICTS):
            with self._round_trips("decide", budget):
                # NOTE: a decision reads the journal's end for real, watch or not: one that makes no
                # event (a join with an incarnation a newer generation fenced) is answered from this read alone.
                self._read(budget, force=True)
                with self._cond:
                    self.check_ok()
                    value, events = decide()
                    if not events:
                        return value
                    at = self.seq  # reserved: no other round trip of this replica until it is applied
                records = [pack_event(ev) for ev in events]
                budget.check("appending to the journal")
                try:
                    last = self.store.append_at(at, records, deadline=budget.deadline)
                except StoreConflict:
                    continue  # another replica wrote first: read what it wrote and decide again
                except StoreError as e:
                    raise self._unavailable(e) from None
                with self._cond:
                    self._packer.changed(ev.job for ev in events)
                    for ev in events:
                        self.state.apply(ev)
                    self.seq = self._durable = last
                    self._since_snapshot += len(events)
                    snapshot = None
                    if self._since_snapshot >= self._snapshot_every:
                        self._since_snapshot = 0
                        snapshot = self._packer.pack(self.state)
                    self._changed({ev.job for ev in events})
                    self._cond.notify_all()
                if snapshot is not None:
                    try:
                        self.store.write_snapshot(last, snapshot)
                    except StoreError as e:  # a snapshot only shortens recovery
                        log.warning("store %s: snapshot at %d not written: %s", self.store.url, last, e)
                return value
        raise Unavailable(f"the coordinator's store {self.store.url} kept changing under this replica "
                          f"({CONFLICTS} conflicting writes in a row); retry")

    def _watched_last(self) -> int | None:
        """The journal's end as the store's watch confirmed it within the staleness bound, or None."""
        if self._max_staleness_s > 0 and isinstance(self.store, Watched):
            return self.store.known_last(self._max_staleness_s)
        return None

    def refresh(self, budget: Budget, force: bool = False) -> None:
        """Reads what other replicas journaled since this one last looked (fencing needs the latest generation).

        NOTE: where the store is watched (:class:`Watched`) and there is a staleness bound, the journal's
        end comes from the watch while it confirmed it within the bound, so a grant asks the database
        nothing (nor waits for this replica's round trips): it is answered from the state of at most
        the bound ago. That is safe for what such calls decide: a grant authorises nothing (a rank
        computes its batches without one through an outage, and a generation resumes from a journaled
        checkpoint). Every decision and a join's wait read with `force`: writes stay exact.
        """
        self.check_ok()
        if not force:
            last = self._watched_last()
            if last is not None and last <= self.seq:  # a watch may not have seen this replica's own latest append yet
                return
        budget.check_at_once("read the journal")
        with self._round_trips("read the journal", budget):
            self._read(budget, force)

    def _read(self, budget: Budget, force: bool) -> None:
        """Under ``_io``: reads and applies what the journal holds past :attr:`seq`."""
        self.check_ok()
        try:
            last = None if force else self._watched_last()
            if last is None:
                budget.check("reading the journal's end")
                last = self.store.last_seq(deadline=budget.deadline)
            if last <= self.seq:
                return
            budget.check("reading the journal")
            rec = self.store.read_since(self.seq, deadline=budget.deadline)
        except StoreError as e:
            raise self._unavailable(e) from None
        with self._cond:
            self._packer.changed(None)  # the replay changes the state in place, or replaces it
            try:
                self.state = replay(self.store, rec, self.state)
            except StoreError as e:
                self._fail(e)
                raise Unavailable(f"the coordinator's store {self.store.url} failed: {e}") from None
            self._since_snapshot += len(rec.records)
            self.seq = self._durable = rec.last_seq
            self._changed(None)
            self._cond.notify_all()

    def report(self, job: str, generation: int, rank: int, epoch: int, batches: int, budget: Budget) -> bool:
        """Checks the report (fencing first) and keeps it for the writer thread, so a grant costs no commit."""
        self.refresh(budget)
        with self._cond:
            self.check_ok()
            decide_report(self.state, job, generation, rank, epoch, batches, 0)  # raises for a bad report
            key = (job, generation, rank)
            if self._reports.get(key, (-1, -1, 0))[:2] < (epoch, batches):
                self._reports[key] = (epoch, batches, now_ms())
                self._cond.notify_all()
        return True

    def _run(self) -> None:
        """Writes whatever progress reports arrived, in one append, at most every 50 ms."""
        cond = self._cond
        while True:
            with cond:
                while not self._reports and not self._closing:
                    cond.wait()
                if self._closing and not self._reports:
                    return
                reports, self._reports = self._reports, {}

            def decide(reports: dict[tuple[str, int, int], tuple[int, int, int]] = reports) -> tuple[None, list[Event]]:
                events: list[Event] = []
                for (job, gen, rank), (epoch, batches, at) in reports.items():
                    try:
                        events += decide_report(self.state, job, gen, rank, epoch, batches, at)[1]
                    except CroupierError:  # fenced or gone meanwhile: nothing to report
                        pass
                return None, events

            try:
                self.commit(decide, durable=True, budget=UNBOUNDED)
            except Unavailable as e:  # reports are advisory: the ranks' next ones come soon
                log.debug("progress reports not journaled: %s", e)
            with cond:
                if not self._closing:
                    cond.wait(REPORTS_EVERY_S)  # the next reports gather meanwhile
