"""How a coordinator's decisions reach its store: two commit protocols behind one interface.

* :class:`WriterCommits` — a single-writer store (``memory://``, ``sqlite:///``): decisions are
  applied at once, in order, and queued; one writer thread appends everything queued in one
  call (group commit: one fsync acknowledges many callers).
* :class:`SharedCommits` — a shared store (``postgresql://``, several replicas, no leader): a
  decision is appended at the seq this replica has applied up to; a conflict (another replica
  wrote first) reads what it wrote and decides again. Progress reports, which are advisory, are
  gathered and appended by a background thread.

The coordinator picks one in one place (:func:`commits_for`) from its store's ``shared``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

from croupier.core.api import now_ms
from croupier.core.errors import CroupierError, Unavailable
from croupier.server._events import Event
from croupier.server._journal import pack_event, pack_snapshot, recover, replay
from croupier.server._store import StoreConflict, StoreError, StoreFull, StoreUnavailable, Watched

if TYPE_CHECKING:
    from croupier.server._coordinator import Coordinator

log = logging.getLogger("croupier.server")

#: What a decision returns beside its events.
T = TypeVar("T")
#: How often a join waiting on a shared store reads the journal; and the conflicting appends in a
#: row after which a decision gives up (UNAVAILABLE: the client retries).
SHARED_POLL_S, CONFLICTS = 0.05, 100


class Commits(Protocol):
    """A commit protocol: how the coordinator's decisions reach its store and its state.

    The coordinator's lock is held on every call but :meth:`run`, which is the protocol's thread.

    Invariants every protocol MUST keep:
        * ``commit(decide, durable)`` calls ``decide()`` on the coordinator's current state (on
          a shared store, first brought up to date), journals the events it returns in order,
          applies them to the state in that same order (``State.apply``) and returns ``decide``'s
          value; when `durable`, only once the store made the events durable. Whatever the
          caller answers from the value or the state MUST NOT name an event the store may
          still lose, unless the caller allows it (a progress report, ``durable=False``).
        * The state holds the journal's events in the journal's order: replaying the store
          after the events applied here are durable rebuilds it. An event applied here whose
          append then fails makes the coordinator fail (``Coordinator._fail``): it never
          acknowledges again, and a restart recovers what the store holds.
        * A decision that lost a race (another replica appended first) applies nothing; it is
          decided again on the state with the other writer's events.
        * After ``refresh()`` the state holds every event any writer had made durable before the
          call (a single writer holds them already).
        * ``report(...)`` either takes a progress report to journal later, after checking it
          (a bad report raises its domain error), and returns True, or returns False and the
          coordinator commits the report as any other decision.
        * ``run()`` returns once the coordinator is closing and nothing the protocol queued is
          left unwritten (or the store failed).
        * Once the store failed, ``commit`` raises Unavailable (the coordinator checks before it
          calls ``refresh``).
    """

    #: How long a join waiting for the other ranks sleeps between looks at the state (None: until
    #: a commit of this coordinator wakes it; a shared store's events come from other replicas).
    join_poll_s: float | None

    def commit(self, decide: Callable[[], tuple[T, list[Event]]], durable: bool) -> T:
        """Journals and applies the events of ``decide()`` and returns its value (durable first when `durable`)."""
        ...

    def refresh(self, force: bool = False) -> None:
        """Brings the state up to date with what other writers made durable (nothing for a single writer);
        `force` asks the store even where it may answer from what it knows (after a conflict)."""
        ...

    def report(self, job: str, generation: int, rank: int, epoch: int, batches: int) -> bool:
        """Takes a progress report (no checkpoint) to journal later, after checking it; False
        when this protocol journals reports as any other commit."""
        ...

    def run(self) -> None:
        """The protocol's thread: writes what it queued until the coordinator closes."""
        ...


def commits_for(coordinator: Coordinator) -> Commits:
    """The commit protocol of the coordinator's store."""
    return SharedCommits(coordinator) if coordinator.store.shared else WriterCommits(coordinator)


class WriterCommits:
    """A single writer: decisions applied at once and queued; one thread appends the queue (group commit)."""

    join_poll_s: float | None = None

    def __init__(self, c: Coordinator) -> None:
        self.c = c
        self._pending: list[bytes] = []
        self._snapshots: list[tuple[int, bytes]] = []
        self._outages = 0  # outages in a row, with no append done between them

    def commit(self, decide: Callable[[], tuple[T, list[Event]]], durable: bool) -> T:
        c = self.c
        if c._closing:
            # NOTE: the writer has stopped or is flushing its last batch: an event decided now
            # would never be journaled (a durable commit would wait forever).
            raise Unavailable("the coordinator is shutting down")
        c._check_ok()
        value, events = decide()
        self._queue(events)
        if durable:
            c._wait_durable(c._seq)
        return value

    def refresh(self, force: bool = False) -> None:
        pass

    def report(self, job: str, generation: int, rank: int, epoch: int, batches: int) -> bool:
        return False

    def _queue(self, events: list[Event]) -> None:
        """Applies `events` in order and queues them for the writer, which keeps that order."""
        c = self.c
        for ev in events:
            self._pending.append(pack_event(ev))
            c._state.apply(ev)
            c._seq += 1
        c._since_snapshot += len(events)
        if events and c._since_snapshot >= c.snapshot_every:
            self._snapshots.append((c._seq, pack_snapshot(c._state)))
            c._since_snapshot = 0
        if events:
            c._changed({ev.job for ev in events})
            c._cond.notify_all()

    def run(self) -> None:
        c = self.c
        while True:
            with c._cond:
                while not self._pending and not self._snapshots and not c._closing:
                    c._cond.wait()
                if c._closing and not self._pending and not self._snapshots:
                    return
                batch, self._pending = self._pending, []
                snaps, self._snapshots = self._snapshots, []
            try:
                t0 = time.perf_counter()
                last = c.store.append(batch) if batch else c._durable
                took = time.perf_counter() - t0
            except StoreFull as e:
                self._outage(e)
                continue
            except StoreError as e:
                with c._cond:
                    c._fail(e)
                return
            self._outages = 0
            try:
                for seq, blob in snaps:
                    c.store.write_snapshot(seq, blob)
            except StoreFull as e:  # the batch is durable: a snapshot only shortens recovery, the next one comes later
                log.warning("store %s: snapshot not written: %s", c.store.url, e)
            except StoreError as e:
                with c._cond:
                    c._durable = last
                    c._fail(e)
                return
            if batch and c.on_commit is not None:  # before anyone is answered: an acknowledged event is counted
                c.on_commit(took, len(batch))
            with c._cond:
                c._durable = last
                c._cond.notify_all()


    def _outage(self, e: StoreFull) -> None:
        """The store had no room: what was decided and not durable is dropped (the state goes back to
        what the store holds, as after a restart), calls are UNAVAILABLE naming the store and the
        cause, and the coordinator takes decisions again once the store has room, without a restart.

        NOTE: the callers of a dropped decision were not answered yet (a join, a checkpoint: they
        wait for durability and get UNAVAILABLE) or were told it may be lost (a progress report),
        so dropping it acknowledges nothing that is then lost, as a restart would not.
        """
        c = self.c
        log.error("store %s: %s; not acknowledging until it has room", c.store.url, e)
        with c._cond:
            c._outage = f"the coordinator's store {c.store.url} is full: {e}"
            self._pending.clear()
            self._snapshots.clear()
            try:
                c._state, rec = recover(c.store)
            except StoreError as err:
                c._fail(err)
                return
            c._seq = c._durable = rec.last_seq
            c._since_snapshot = len(rec.records)
            c._rollbacks += 1
            c._kept[c._rollbacks] = rec.last_seq
            c._changed(None)
            c._cond.notify_all()
            # NOTE: a bounded backoff between looks at the file system's free space (the store's
            # has_room), until there is room or the coordinator closes; not synchronisation. An
            # outage lasts at least `wait`, longer each time the last one ended with no write done
            # (a quota statvfs does not show would otherwise reload the state for every batch).
            self._outages += 1
            wait = min(0.1 * 2 ** (self._outages - 1), 5.0)
            c._cond.wait(wait)
            while not c._closing and not c.store.has_room():
                c._cond.wait(wait)
                wait = min(wait * 2, 5.0)
            c._outage = None
            c._changed(None)
            log.warning("store %s has room again: acknowledging", c.store.url)


class SharedCommits:
    """Replicas on one database: append at the seq applied, decide again on a conflict."""

    join_poll_s: float | None = SHARED_POLL_S

    def __init__(self, c: Coordinator) -> None:
        self.c = c
        #: progress reports not journaled yet: (job, generation, rank) -> (epoch, batches, ms)
        self._reports: dict[tuple[str, int, int], tuple[int, int, int]] = {}

    def commit(self, decide: Callable[[], tuple[T, list[Event]]], durable: bool) -> T:
        c = self.c
        for _ in range(CONFLICTS):
            c._check_ok()
            # NOTE: a decision reads the journal's end for real, watch or not: one that makes no
            # event (a join with an incarnation a newer generation fenced) is answered from this read alone.
            self.refresh(force=True)
            value, events = decide()
            if not events:
                return value
            try:
                last = c.store.append_at(c._seq, [pack_event(ev) for ev in events])
            except StoreConflict:
                continue  # another replica wrote first: read what it wrote and decide again
            except StoreUnavailable as e:
                # NOTE: nothing was applied here; whether the commit landed (a connection lost
                # during it) the next read of the journal tells.
                raise Unavailable(f"the coordinator's store {c.store.url} is unavailable: {e}") from None
            except StoreError as e:
                c._fail(e)
                raise Unavailable(f"the coordinator's store {c.store.url} failed: {e}") from None
            for ev in events:
                c._state.apply(ev)
            c._seq = c._durable = last
            c._since_snapshot += len(events)
            if c._since_snapshot >= c.snapshot_every:
                c._since_snapshot = 0
                try:
                    c.store.write_snapshot(c._seq, pack_snapshot(c._state))
                except StoreError as e:  # a snapshot only shortens recovery
                    log.warning("store %s: snapshot at %d not written: %s", c.store.url, c._seq, e)
            c._changed({ev.job for ev in events})
            c._cond.notify_all()
            return value
        raise Unavailable(f"the coordinator's store {c.store.url} kept changing under this replica "
                          f"({CONFLICTS} conflicting writes in a row); retry")

    def refresh(self, force: bool = False) -> None:
        """Reads what other replicas journaled since this one last looked (fencing needs the latest generation).

        NOTE: where the store is watched (:class:`Watched`) and the coordinator has a staleness bound,
        the journal's end comes from the watch while it confirmed it within the bound, so a grant
        asks the database nothing: it is answered from the state of at most the bound ago. That is
        safe for what such calls decide: a grant authorises nothing (a rank computes its batches
        without one through an outage, and a generation resumes from a checkpoint, which is
        journaled). Every decision (a join, a checkpoint, the reports) and a join's wait read with
        `force`, and append at the seq they read: writes stay exact.
        """
        c = self.c
        try:
            last = None
            if not force and c.max_staleness_s > 0 and isinstance(c.store, Watched):
                last = c.store.known_last(c.max_staleness_s)
            if last is None:
                last = c.store.last_seq()
            if last <= c._seq:  # a watch may not have seen this replica's own latest append yet
                return
            rec = c.store.read_since(c._seq)
        except StoreUnavailable as e:
            raise Unavailable(f"the coordinator's store {c.store.url} is unavailable: {e}") from None
        except StoreError as e:
            c._fail(e)
            raise Unavailable(f"the coordinator's store {c.store.url} failed: {e}") from None
        try:
            c._state = replay(c.store, rec, c._state)
        except StoreError as e:
            c._fail(e)
            raise Unavailable(f"the coordinator's store {c.store.url} failed: {e}") from None
        c._since_snapshot += len(rec.records)
        c._seq = c._durable = rec.last_seq
        c._changed(None)
        c._cond.notify_all()

    def report(self, job: str, generation: int, rank: int, epoch: int, batches: int) -> bool:
        """Checks the report (fencing first) and keeps it for :meth:`run`, so a grant costs no commit."""
        c = self.c
        c._fresh()
        c._state.decide_report(job, generation, rank, epoch, batches, 0)  # raises for a bad report
        key = (job, generation, rank)
        if self._reports.get(key, (-1, -1, 0))[:2] < (epoch, batches):
            self._reports[key] = (epoch, batches, now_ms())
            c._cond.notify_all()
        return True

    def run(self) -> None:
        """Writes whatever progress reports arrived, in one append, at most every 50 ms."""
        c = self.c
        while True:
            with c._cond:
                while not self._reports and not c._closing:
                    c._cond.wait()
                if c._closing and not self._reports:
                    return
                reports, self._reports = self._reports, {}

                def decide(reports: dict[tuple[str, int, int], tuple[int, int, int]] = reports) -> tuple[None, list[Event]]:
                    events: list[Event] = []
                    for (job, gen, rank), (epoch, batches, at) in reports.items():
                        try:
                            events += c._state.decide_report(job, gen, rank, epoch, batches, at)[1]
                        except CroupierError:  # fenced or gone meanwhile: nothing to report
                            pass
                    return None, events

                try:
                    self.commit(decide, durable=True)
                except Unavailable as e:  # reports are advisory: the ranks' next ones come soon
                    log.debug("progress reports not journaled: %s", e)
                if not c._closing:
                    c._cond.wait(SHARED_POLL_S)  # the next reports gather meanwhile
