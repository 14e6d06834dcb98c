"""How a coordinator's decisions reach its store: the commit protocol's interface, and the single writer's.

* :class:`WriterCommits` — a single-writer store (``memory://``, ``sqlite:///``): decisions are applied at once, in
  order, and queued; one writer thread appends everything queued in one call (group commit: one fsync, many callers).
* ``SharedCommits`` (``croupier.server._shared_commits``) — a shared store (``postgresql://``, replicas, no
  leader): a decision is appended at the seq this replica has applied; a conflict (another replica wrote
  first) reads what it wrote and decides again.

A protocol is built from what it needs (the store, the recovered state, two callbacks), never from the
coordinator, which asks it through :class:`Commits` (``Coordinator`` picks one from the store's ``shared``).
The state and the lock that guards it are the protocol's own: the coordinator reads the state through
:meth:`Commits.read` and shares no lock with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from croupier.core.errors import Unavailable
from croupier.server._deadline import Budget
from croupier.server._events import Event
from croupier.server._journal import pack_event, recover
from croupier.server._snapshots import SnapshotPacker
from croupier.server._state import State
from croupier.server._store import Recovered, Store, StoreError, StoreFull

log = logging.getLogger("croupier.server")

#: What a decision returns beside its events.
T = TypeVar("T")

#: Called under the lock after events of these jobs (None: any) were applied, the state replaced, or refusals changed.
Changed = Callable[[set[str] | None], None]


class Commits(Protocol):
    """A commit protocol: holds the coordinator's state and journal position, and brings decisions to the store.

    The protocol guards its state with a lock of its own (reentrant), which no caller holds when it calls
    :meth:`commit`, :meth:`refresh`, :meth:`report`, :meth:`start` or :meth:`close`: they take it to decide
    and to apply, and never hold it across a round trip to the store. A caller reads the state through
    :meth:`read` (under that lock) or in the ``decide`` it hands :meth:`commit`, never otherwise;
    :meth:`check_ok` only reads, with it or without.

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
        * With a budget ``at_once`` (``croupier.server._deadline.Budget``), ``refresh()`` and ``report()`` raise
          WouldWait before a round trip, changing nothing.
        * ``report(...)`` either takes a progress report to journal later, after checking it
          (a bad report raises its domain error), and returns True, or returns False and the
          coordinator commits the report as any other decision.
        * ``close()`` returns once nothing the protocol queued is left unwritten (or the store
          failed) and its thread has stopped.
        * Once the store failed, :meth:`commit`, :meth:`refresh` and :meth:`check_ok` raise Unavailable;
          so do :meth:`commit` and :meth:`refresh` before any round trip of a call past its budget's deadline;
          a call's budget is the value it passes, never something the protocol finds for itself.
        * The ``changed`` callback is called under the lock after every apply, replay, rollback,
          failure and close; it MAY call :meth:`read` and :meth:`stopped` (the lock is reentrant).
        * ``read(fn, durable)`` calls ``fn(state)`` under the lock and returns its value; when
          ``durable(value)``, only once every event applied to the state by then is durable.
    """

    #: The coordinator's state: every event applied so far (only in a ``decide`` or through :meth:`read`).
    state: State
    #: The journal seq of the last event applied to :attr:`state`.
    seq: int
    #: Why the store failed (the coordinator no longer acknowledges), or None.
    failed: str | None

    def commit(self, decide: Callable[[], tuple[T, list[Event]]], durable: bool, budget: Budget) -> T:
        """Journals and applies the events of ``decide()`` and returns its value (durable first when `durable`),
        within the call's `budget`."""
        ...

    def refresh(self, budget: Budget, force: bool = False) -> None:
        """Unavailable if the store failed; brings the state up to date with what other writers made
        durable (nothing for a single writer), within the call's `budget`; `force` asks the store even
        where it may answer from what it knows (a decision, a join's wait)."""
        ...

    def report(self, job: str, generation: int, rank: int, epoch: int, batches: int, budget: Budget) -> bool:
        """Takes a progress report (no checkpoint) to journal later, after checking it; False
        when this protocol journals reports as any other commit."""
        ...

    def check_ok(self) -> None:
        """Unavailable when calls are refused (the store failed, or has no room for now)."""
        ...

    def stopped(self) -> bool:
        """Whether calls are refused or the protocol is closing: a waiting join waits no longer."""
        ...

    def read(self, fn: Callable[[State], T], durable: Callable[[T], bool] | None = None) -> T:
        """``fn(state)`` under the protocol's lock; when ``durable(value)``, returned once every event applied by then
        is durable (Unavailable if the store fails or an outage dropped it)."""
        ...

    def start(self) -> None:
        """Starts the protocol's thread (the journal writer, or the progress-report writer)."""
        ...

    def close(self) -> None:
        """Writes what is queued, refuses new commits and stops the protocol's thread."""
        ...


class Journaled:
    """What both protocols hold: the state, the journal position, why calls are refused, and a thread."""

    def __init__(self, store: Store, state: State, rec: Recovered,
                 snapshot_every: int, changed: Changed) -> None:
        self.store, self.state = store, state
        #: The protocol's own lock (reentrant): taken to decide, to apply and to read the state, never held
        #: across a round trip to the store; nothing outside the protocol takes it but through :meth:`read`.
        self._cond = threading.Condition()
        self.seq = rec.last_seq
        self._durable = self.seq
        self._since_snapshot = len(rec.records)
        self._snapshot_every = snapshot_every
        self._changed = changed
        #: Packs the snapshots from each job's encoding kept since the job last changed: told of every apply.
        self._packer = SnapshotPacker()
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
        with self._cond:
            return self.failed is not None or self._outage is not None or self._closing

    def read(self, fn: Callable[[State], T], durable: Callable[[T], bool] | None = None) -> T:
        with self._cond:
            value = fn(self.state)
            if durable is not None and durable(value):
                self.wait_durable()
            return value

    def wait_durable(self) -> None:
        """Under the lock: waits until every event applied to the state is durable."""
        target, rollbacks = self.seq, self._rollbacks
        if self._durable >= target:
            return
        while self._durable < target and self.failed is None and self._rollbacks == rollbacks:
            self._cond.wait()
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
        self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._changed(None)
            self._cond.notify_all()
        self._thread.join()


class WriterCommits(Journaled):
    """A single writer: decisions applied at once and queued; one thread appends the queue (group commit)."""

    def __init__(self, store: Store, state: State, rec: Recovered, snapshot_every: int,
                 changed: Changed, timed: Callable[[float, int], None]) -> None:
        super().__init__(store, state, rec, snapshot_every, changed)
        self._timed = timed
        self._pending: list[bytes] = []
        self._snapshots: list[tuple[int, bytes]] = []
        self._outages = 0  # outages in a row, with no append done between them

    def commit(self, decide: Callable[[], tuple[T, list[Event]]], durable: bool, budget: Budget) -> T:
        budget.check("deciding")
        with self._cond:
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

    def refresh(self, budget: Budget, force: bool = False) -> None:
        self.check_ok()

    def report(self, job: str, generation: int, rank: int, epoch: int, batches: int, budget: Budget) -> bool:
        return False

    def _queue(self, events: list[Event]) -> None:
        """Under the lock: applies `events` in order and queues them for the writer, which keeps that order."""
        self._packer.changed(ev.job for ev in events)
        for ev in events:
            self._pending.append(pack_event(ev))
            self.state.apply(ev)
            self.seq += 1
        self._since_snapshot += len(events)
        if events and self._since_snapshot >= self._snapshot_every:
            self._snapshots.append((self.seq, self._packer.pack(self.state)))
            self._since_snapshot = 0
        if events:
            self._changed({ev.job for ev in events})
            self._cond.notify_all()

    def _run(self) -> None:
        cond, store = self._cond, self.store
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
            if batch:  # before anyone is answered: an acknowledged event is counted
                self._timed(took, len(batch))
            with cond:
                # NOTE: only here, once the append returned (the batch is fsync'd), are its callers
                # answered; the snapshots come after: they only shorten recovery, so no caller
                # waits for one's fsync.
                self._durable = last
                cond.notify_all()
            try:
                for seq, blob in snaps:
                    store.write_snapshot(seq, blob)
            except StoreFull as e:  # the batch is durable: a snapshot only shortens recovery, the next one comes later
                log.warning("store %s: snapshot not written: %s", store.url, e)
            except StoreError as e:
                with cond:
                    self._fail(e)
                return

    def _outage_of(self, e: StoreFull) -> None:
        """The store had no room: what was decided and not durable is dropped (the state goes back to
        what the store holds, as after a restart), calls are UNAVAILABLE naming the store and the
        cause, and the coordinator takes decisions again once the store has room, without a restart.

        NOTE: the callers of a dropped decision were not answered yet (a join, a checkpoint: they
        wait for durability and get UNAVAILABLE) or were told it may be lost (a progress report),
        so dropping it acknowledges nothing that is then lost, as a restart would not.
        """
        cond, store = self._cond, self.store
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
            self._packer.changed(None)
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
