"""How a coordinator's decisions reach its store: two commit protocols, each owning the state and its journal position.

* :class:`WriterCommits` — a single-writer store (``memory://``, ``sqlite:///``): decisions are applied at once, in
  order, and queued; one writer thread appends everything queued in one call (group commit: one fsync, many callers).
* :class:`SharedCommits` — a shared store (``postgresql://``, replicas, no leader): a decision is appended
  at the seq this replica has applied; a conflict (another replica wrote first) reads what it wrote and
  decides again. The replica's round trips take turns on a lock of their own, never the coordinator's.
  Progress reports, which are advisory, are gathered and appended by a background thread.

A protocol is built from what it needs (the store, the coordinator's lock, the recovered state, two
callbacks), never from the coordinator, which asks it through :class:`Commits` (:func:`commits_for` picks one).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

from croupier.core.api import now_ms
from croupier.core.errors import CroupierError, Unavailable
from croupier.server import _deadline as deadline
from croupier.server._events import Event
from croupier.server._journal import pack_event, pack_snapshot, recover, replay
from croupier.server._state import State
from croupier.server._store import Recovered, Store, StoreConflict, StoreError, StoreFull, StoreUnavailable, Watched
from croupier.server._turns import FairLock

log = logging.getLogger("croupier.server")

#: What a decision returns beside its events.
T = TypeVar("T")
#: How often a join waiting on a shared store reads the journal; and the conflicting appends in a
#: row after which a decision gives up (UNAVAILABLE: the client retries).
SHARED_POLL_S, CONFLICTS = 0.05, 100

#: Called under the lock after events of these jobs (None: any) were applied, the state replaced, or refusals changed.
Changed = Callable[[set[str] | None], None]


class Commits(Protocol):
    """A commit protocol: holds the coordinator's state and journal position, and brings decisions to the store.

    The coordinator's lock (given at construction) is NOT held when :meth:`commit`, :meth:`refresh`,
    :meth:`report`, :meth:`start` or :meth:`close` is called: they take it to decide and to apply,
    and never hold it across a round trip to the store. It IS held to read :attr:`state` and to
    call :meth:`stopped` and :meth:`wait_durable`; :meth:`check_ok` only reads, with it or without.

    Invariants every protocol MUST keep:
        * ``commit(decide, durable)`` calls ``decide()`` under the lock on the current state (on
          a shared store, first brought up to date), journals the events it returns in order,
          applies them to the state in that same order (``State.apply``) and returns ``decide``'s
          value; when `durable`, only once the store made the events durable. Whatever the
          caller answers from the value or the state MUST NOT name an event the store may
          still lose, unless the caller allows it (a progress report, ``durable=False``).
        * The state holds the journal's events in the journal's order: replaying the store
          after the events applied here are durable rebuilds it. An event applied here whose
          append then fails makes the protocol fail (:attr:`failed`): the coordinator never
          acknowledges again, and a restart recovers what the store holds.
        * A decision that lost a race (another replica appended first) applies nothing; it is
          decided again on the state with the other writer's events.
        * After ``refresh(force=True)`` the state holds every event any writer had made durable
          before the call (a single writer holds them already); without `force`, a watched shared
          store may answer from a journal end confirmed within the staleness bound.
        * Within ``_deadline.at_once()``, ``refresh()`` and ``report()`` raise WouldWait before a round trip, changing nothing.
        * ``report(...)`` either takes a progress report to journal later, after checking it
          (a bad report raises its domain error), and returns True, or returns False and the
          coordinator commits the report as any other decision.
        * ``close()`` returns once nothing the protocol queued is left unwritten (or the store
          failed) and its thread has stopped.
        * Once the store failed, :meth:`commit`, :meth:`refresh` and :meth:`check_ok` raise Unavailable;
          so do :meth:`commit` and :meth:`refresh` before any round trip of a call past its deadline.
        * The ``changed`` callback is called under the lock after every apply, replay, rollback,
          failure and close.
    """

    #: How long a join waiting for the other ranks sleeps between looks at the state (None: until
    #: a commit of this coordinator wakes it; a shared store's events come from other replicas).
    join_poll_s: float | None
    #: The coordinator's state: every event applied so far (read it under the lock).
    state: State
    #: The journal seq of the last event applied to :attr:`state`.
    seq: int
    #: Why the store failed (the coordinator no longer acknowledges), or None.
    failed: str | None

    def commit(self, decide: Callable[[], tuple[T, list[Event]]], durable: bool) -> T:
        """Journals and applies the events of ``decide()`` and returns its value (durable first when `durable`)."""
        ...

    def refresh(self, force: bool = False) -> None:
        """Unavailable if the store failed; brings the state up to date with what other writers made
        durable (nothing for a single writer); `force` asks the store even where it may answer from
        what it knows (a decision, a join's wait)."""
        ...

    def report(self, job: str, generation: int, rank: int, epoch: int, batches: int) -> bool:
        """Takes a progress report (no checkpoint) to journal later, after checking it; False
        when this protocol journals reports as any other commit."""
        ...

    def check_ok(self) -> None:
        """Unavailable when calls are refused (the store failed, or has no room for now)."""
        ...

    def stopped(self) -> bool:
        """Whether calls are refused or the protocol is closing: a waiting join waits no longer."""
        ...

    def wait_durable(self) -> None:
        """Waits until every event applied to the state is durable (Unavailable if the store fails or
        an outage dropped it)."""
        ...

    def start(self) -> None:
        """Starts the protocol's thread (the journal writer, or the progress-report writer)."""
        ...

    def close(self) -> None:
        """Writes what is queued, refuses new commits and stops the protocol's thread."""
        ...


def commits_for(store: Store, cond: threading.Condition, state: State, rec: Recovered, snapshot_every: int,
                max_staleness_s: float, timed: Callable[[float, int], None], changed: Changed) -> Commits:
    """The commit protocol of `store` (see :class:`Commits`), holding `state` as recovered from `rec`, under the
    coordinator's lock `cond`; `max_staleness_s` bounds a watched shared store's reads, `timed(seconds, records)` is
    called after a single writer's group commits, `changed` under the lock after every apply, replay, rollback, failure, close."""
    if store.shared:
        return SharedCommits(store, cond, state, rec, snapshot_every, changed, max_staleness_s)
    return WriterCommits(store, cond, state, rec, snapshot_every, changed, timed)


class _Journaled:
    """What both protocols hold: the state, the journal position, why calls are refused, and a thread."""

    def __init__(self, store: Store, cond: threading.Condition, state: State, rec: Recovered,
                 snapshot_every: int, changed: Changed) -> None:
        self.store, self.cond, self.state = store, cond, state
        self.seq = rec.last_seq
        self._durable = self.seq
        self._since_snapshot = len(rec.records)
        self._snapshot_every = snapshot_every
        self._changed = changed
        self.failed: str | None = None
        #: Why the store takes no writes for now (it is full), or None: calls are UNAVAILABLE meanwhile.
        self._outage: str | None = None
        #: How often the state went back to what the store holds after an outage (see wait_durable).
        self._rollbacks = 0
        #: The last seq the store held at each such rollback: a change up to it was durable.
        self._kept: dict[int, int] = {}
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="croupier-journal", daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def check_ok(self) -> None:
        if self.failed is not None:
            raise Unavailable(f"{self.failed}; restart the coordinator to recover from what it made durable")
        if self._outage is not None:
            raise Unavailable(f"{self._outage}; the coordinator goes on by itself once it has room")

    def stopped(self) -> bool:
        return self.failed is not None or self._outage is not None or self._closing

    def wait_durable(self) -> None:
        target, rollbacks = self.seq, self._rollbacks
        if self._durable >= target:
            return
        while self._durable < target and self.failed is None and self._rollbacks == rollbacks:
            self.cond.wait()
        if self.failed is not None:
            self.check_ok()
        if self._rollbacks != rollbacks and target > self._kept[rollbacks + 1]:
            # decided, then dropped in an outage (the state went back to what the store holds)
            raise Unavailable(f"{self._outage or 'the store had no room'}; this call's change was not stored: retry")

    def _fail(self, e: StoreError) -> None:
        """Under the lock: the store failed; no call is acknowledged again."""
        log.error("store %s failed; no longer acknowledging: %s", self.store.url, e)
        self.failed = f"the coordinator's store {self.store.url} failed: {e}"
        self._changed(None)
        self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self._closing = True
            self._changed(None)
            self.cond.notify_all()
        self._thread.join()


class WriterCommits(_Journaled):
    """A single writer: decisions applied at once and queued; one thread appends the queue (group commit)."""

    join_poll_s: float | None = None

    def __init__(self, store: Store, cond: threading.Condition, state: State, rec: Recovered, snapshot_every: int,
                 changed: Changed, timed: Callable[[float, int], None]) -> None:
        super().__init__(store, cond, state, rec, snapshot_every, changed)
        self._timed = timed
        self._pending: list[bytes] = []
        self._snapshots: list[tuple[int, bytes]] = []
        self._outages = 0  # outages in a row, with no append done between them

    def commit(self, decide: Callable[[], tuple[T, list[Event]]], durable: bool) -> T:
        deadline.check("deciding")
        with self.cond:
            if self._closing:
                # NOTE: the writer has stopped or is flushing its last batch: an event decided now
                # would never be journaled (a durable commit would wait forever).
                raise Unavailable("the coordinator is shutting down")
            self.check_ok()
            value, events = decide()
            self._queue(events)
            if durable:
                self.wait_durable()
            return value

    def refresh(self, force: bool = False) -> None:
        self.check_ok()

    def report(self, job: str, generation: int, rank: int, epoch: int, batches: int) -> bool:
        return False

    def _queue(self, events: list[Event]) -> None:
        """Under the lock: applies `events` in order and queues them for the writer, which keeps that order."""
        for ev in events:
            self._pending.append(pack_event(ev))
            self.state.apply(ev)
            self.seq += 1
        self._since_snapshot += len(events)
        if events and self._since_snapshot >= self._snapshot_every:
            self._snapshots.append((self.seq, pack_snapshot(self.state)))
            self._since_snapshot = 0
        if events:
            self._changed({ev.job for ev in events})
            self.cond.notify_all()

    def _run(self) -> None:
        cond, store = self.cond, self.store
        while True:
            with cond:
                while not self._pending and not self._snapshots and not self._closing:
                    cond.wait()
                if self._closing and not self._pending and not self._snapshots:
                    return
                batch, self._pending = self._pending, []
                snaps, self._snapshots = self._snapshots, []
                durable = self._durable
            try:
                t0 = time.perf_counter()
                last = store.append(batch) if batch else durable
                took = time.perf_counter() - t0
            except StoreFull as e:
                self._outage_of(e)
                continue
            except StoreError as e:
                with cond:
                    self._fail(e)
                return
            self._outages = 0
            try:
                for seq, blob in snaps:
                    store.write_snapshot(seq, blob)
            except StoreFull as e:  # the batch is durable: a snapshot only shortens recovery, the next one comes later
                log.warning("store %s: snapshot not written: %s", store.url, e)
            except StoreError as e:
                with cond:
                    self._durable = last
                    self._fail(e)
                return
            if batch:  # before anyone is answered: an acknowledged event is counted
                self._timed(took, len(batch))
            with cond:
                self._durable = last
                cond.notify_all()

    def _outage_of(self, e: StoreFull) -> None:
        """The store had no room: what was decided and not durable is dropped (the state goes back to
        what the store holds, as after a restart), calls are UNAVAILABLE naming the store and the
        cause, and the coordinator takes decisions again once the store has room, without a restart.

        NOTE: the callers of a dropped decision were not answered yet (a join, a checkpoint: they
        wait for durability and get UNAVAILABLE) or were told it may be lost (a progress report),
        so dropping it acknowledges nothing that is then lost, as a restart would not.
        """
        cond, store = self.cond, self.store
        log.error("store %s: %s; not acknowledging until it has room", store.url, e)
        with cond:
            self._outage = f"the coordinator's store {store.url} is full: {e}"
            self._pending.clear()
            self._snapshots.clear()
        try:  # outside the lock: no decision is taken during an outage, and this thread is the store's one caller
            state, rec = recover(store)
        except StoreError as err:
            with cond:
                self._fail(err)
            return
        with cond:
            self.state = state
            self.seq = self._durable = rec.last_seq
            self._since_snapshot = len(rec.records)
            self._rollbacks += 1
            self._kept[self._rollbacks] = rec.last_seq
            self._changed(None)
            cond.notify_all()
            # NOTE: a bounded backoff between looks at the file system's free space (the store's
            # has_room), until there is room or the coordinator closes; not synchronisation. An
            # outage lasts at least `wait`, longer each time the last one ended with no write done
            # (a quota statvfs does not show would otherwise reload the state for every batch).
            self._outages += 1
            wait = min(0.1 * 2 ** (self._outages - 1), 5.0)
            cond.wait(wait)
            while not self._closing and not store.has_room():
                cond.wait(wait)
                wait = min(wait * 2, 5.0)
            self._outage = None
            self._changed(None)
            log.warning("store %s has room again: acknowledging", store.url)


class SharedCommits(_Journaled):
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

    join_poll_s: float | None = SHARED_POLL_S

    def __init__(self, store: Store, cond: threading.Condition, state: State, rec: Recovered, snapshot_every: int,
                 changed: Changed, max_staleness_s: float) -> None:
        super().__init__(store, cond, state, rec, snapshot_every, changed)
        self._max_staleness_s = max_staleness_s
        self._io = FairLock()  # taken in turn: a waiter sits through the appends asked before it, no more
        #: progress reports not journaled yet: (job, generation, rank) -> (epoch, batches, ms)
        self._reports: dict[tuple[str, int, int], tuple[int, int, int]] = {}

    @contextlib.contextmanager
    def _round_trips(self, doing: str) -> Iterator[None]:
        """This replica's turn to talk to the store, taken within the call's deadline (else Unavailable)."""
        deadline.wait_for(self._io, doing)
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
        with self.cond:
            self._fail(e)
        return Unavailable(f"the coordinator's store {self.store.url} failed: {e}")

    def commit(self, decide: Callable[[], tuple[T, list[Event]]], durable: bool) -> T:
        for _ in range(CONFLICTS):
            with self._round_trips("decide"):
                # NOTE: a decision reads the journal's end for real, watch or not: one that makes no
                # event (a join with an incarnation a newer generation fenced) is answered from this read alone.
                self._read(force=True)
                with self.cond:
                    self.check_ok()
                    value, events = decide()
                    if not events:
                        return value
                    at = self.seq  # reserved: no other round trip of this replica until it is applied
                records = [pack_event(ev) for ev in events]
                deadline.check("appending to the journal")
                try:
                    last = self.store.append_at(at, records)
                except StoreConflict:
                    continue  # another replica wrote first: read what it wrote and decide again
                except StoreError as e:
                    raise self._unavailable(e) from None
                with self.cond:
                    for ev in events:
                        self.state.apply(ev)
                    self.seq = self._durable = last
                    self._since_snapshot += len(events)
                    snapshot = None
                    if self._since_snapshot >= self._snapshot_every:
                        self._since_snapshot = 0
                        snapshot = pack_snapshot(self.state)
                    self._changed({ev.job for ev in events})
                    self.cond.notify_all()
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

    def refresh(self, force: bool = False) -> None:
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
        deadline.check_at_once("read the journal")
        with self._round_trips("read the journal"):
            self._read(force)

    def _read(self, force: bool) -> None:
        """Under ``_io``: reads and applies what the journal holds past :attr:`seq`."""
        self.check_ok()
        try:
            last = None if force else self._watched_last()
            if last is None:
                deadline.check("reading the journal's end")
                last = self.store.last_seq()
            if last <= self.seq:
                return
            deadline.check("reading the journal")
            rec = self.store.read_since(self.seq)
        except StoreError as e:
            raise self._unavailable(e) from None
        with self.cond:
            try:
                self.state = replay(self.store, rec, self.state)
            except StoreError as e:
                self._fail(e)
                raise Unavailable(f"the coordinator's store {self.store.url} failed: {e}") from None
            self._since_snapshot += len(rec.records)
            self.seq = self._durable = rec.last_seq
            self._changed(None)
            self.cond.notify_all()

    def report(self, job: str, generation: int, rank: int, epoch: int, batches: int) -> bool:
        """Checks the report (fencing first) and keeps it for the writer thread, so a grant costs no commit."""
        self.refresh()
        with self.cond:
            self.check_ok()
            self.state.decide_report(job, generation, rank, epoch, batches, 0)  # raises for a bad report
            key = (job, generation, rank)
            if self._reports.get(key, (-1, -1, 0))[:2] < (epoch, batches):
                self._reports[key] = (epoch, batches, now_ms())
                self.cond.notify_all()
        return True

    def _run(self) -> None:
        """Writes whatever progress reports arrived, in one append, at most every 50 ms."""
        cond = self.cond
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
                        events += self.state.decide_report(job, gen, rank, epoch, batches, at)[1]
                    except CroupierError:  # fenced or gone meanwhile: nothing to report
                        pass
                return None, events

            try:
                self.commit(decide, durable=True)
            except Unavailable as e:  # reports are advisory: the ranks' next ones come soon
                log.debug("progress reports not journaled: %s", e)
            with cond:
                if not self._closing:
                    cond.wait(SHARED_POLL_S)  # the next reports gather meanwhile
