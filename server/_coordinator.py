"""The coordinator core: the state machine behind a journal — decide, journal, apply, reply."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import NoReturn

import msgpack
import numpy as np

from croupier.core.amend import Amendment
from croupier.core.api import (
    MAX_COUNT,
    MAX_LEASE_BATCHES,
    MAX_LEASE_INDICES,
    CheckpointRecord,
    Grant,
    JobStatus,
    JoinRequest,
    JoinResult,
    Lease,
    RankCursor,
    now_ms,
)
from croupier.core.checks import check_int
from croupier.core.cursor import Cursor
from croupier.core.errors import InvalidArgument, ResourceExhausted
from croupier.core.ftsteps import CommittedStep
from croupier.core.ledger import Ledger, pack, unpack
from croupier.core.plan import EpochPlan
from croupier.core.registry import plan_epoch
from croupier.core.spec import Spec
from croupier.server._commits import Changed, Commits, WriterCommits
from croupier.server._deadline import UNBOUNDED, Budget, WouldWait
from croupier.server._decide import decide_amend, decide_deal, decide_join, decide_report, decide_step
from croupier.server._events import Event, GenerationOpened, GenerationStarted, JobRegistered
from croupier.server._journal import pack_snapshot, recover
from croupier.server._lease_ahead import LeaseAhead
from croupier.server._shared_commits import SharedCommits
from croupier.server._state import State
from croupier.server._store import Recovered, Store

log = logging.getLogger("croupier.server")


class Coordinator:
    """Holds the jobs: decides, journals, applies, replies.

    Whatever a caller relies on -- a join, a checkpoint record, a deal of batches -- is durable
    in the store before the caller is answered; a progress report (advisory: losing the last one
    only makes a rank's cursor older until its next) is answered at once and journaled soon
    after. How events reach the store is the store's commit protocol
    (croupier.server._commits), picked once from its ``shared``: a single-writer store's events
    are applied at once, in order, and one writer thread appends everything queued in one call
    (group commit: concurrent joins share one fsync; it is the store's only caller after
    recovery, as the Store contract requires); replicas on a shared store append each decision
    at the seq they have applied, and a conflict decides again on what the other replica wrote.
    A grant or a lease touches the store when it carries a progress report and, with dynamic
    dealing, when it deals batches; computing its indices does not. A snapshot of the whole
    state is written every ``snapshot_every`` events so that recovery replays a short journal.

    NOTE: no call holds the coordinator's lock across a round trip to the store: a call brings the
    state up to date (``Commits.refresh``: on a shared store, possibly a read) before it takes the
    lock, and commits without it (the protocol takes it to decide and to apply).

    If the store fails (anything but a shared store's lost connection, after which the next call
    reads the journal again), the coordinator stops acknowledging: every call raises Unavailable
    until the process is restarted and recovers from what the store made durable.
    """

    def __init__(self, store: Store, snapshot_every: int = 1000, max_jobs: int | None = None,
                 max_staleness_s: float = 0.0) -> None:
        """Recovers the state the store holds and starts its commit protocol's thread (the journal
        writer of a single-writer store, the progress-report writer of a shared one).

        Args:
            store: An open store; the coordinator owns it from now on (and closes it, also when
                recovery fails).
            snapshot_every: Events between two snapshots.
            max_jobs: Jobs held at most: a join that would register one more is RESOURCE_EXHAUSTED.
            max_staleness_s: On a shared store that is watched (PostgreSQL), reads (grants, leases,
                a job's status) may be answered from a state confirmed this long ago instead of asking
                the database first; 0 asks every time. Writes are exact either way.

        Raises:
            StoreCorrupt: If the store's contents could not be verified, or a record or the
                snapshot could not be read; the message names the store and the record's seq.
            StoreUnavailable: If the store could not be read.
        """
        self.store = store
        self.snapshot_every = snapshot_every
        self.max_jobs = max_jobs
        if not 0 <= max_staleness_s <= 60:
            raise ValueError(f"max_staleness_s must be in [0, 60] seconds (got {max_staleness_s=})")
        self.max_staleness_s = max_staleness_s
        try:
            state, rec = recover(store)
        except BaseException:
            store.close()
            raise
        #: Calls waiting for a generation to start or be replaced: job -> generation -> callbacks (see on_start).
        #: NOTE: changed only where no event can be applied meanwhile: in ``Commits.read`` or the protocol's
        #: ``changed`` callback, both under the protocol's lock (the coordinator has no lock of its own for it).
        self._listeners: dict[str, dict[int, list[Callable[[], None]]]] = {}
        # NOTE: leases are numpy work that holds the GIL in short bursts; run one at a time, the
        # server's threads stop trading the GIL back and forth (measured: 260 -> 1,039 leases/s
        # with 64 threads) and each lease finishes sooner.
        self._compute = threading.Lock()
        self._leases = LeaseAhead(self._compute)  # the Lease RPC's: each rank's next lease computed ahead
        #: Called by a single writer's journal thread after each group commit, with (seconds the
        #: append took, records); a shared store's appends are not timed. It MUST be quick and
        #: MUST NOT raise (the metrics set it).
        self.on_commit: Callable[[float, int], None] | None = None
        #: How decisions reach the store (one writer with group commit, or replicas on a shared store);
        #: it holds the state, the lock that guards it, the journal position and why calls are refused.
        self._commits = _commits_for(store, state, rec, snapshot_every, max_staleness_s, self._timed, self._changed)
        self._commits.start()
        log.info("recovered %d jobs from %s (snapshot at %d, %d journal records)",
                 len(state.jobs), store.url, rec.snapshot_seq, len(rec.records))

    @property
    def _state(self) -> State:
        """The state, as a decision handed to the commit protocol reads it (the protocol holds it)."""
        return self._commits.state

    def _timed(self, took: float, records: int) -> None:
        if self.on_commit is not None:
            self.on_commit(took, records)

    # ---------------------------------------------------------------- writes

    def join(self, req: JoinRequest, budget: Budget = UNBOUNDED) -> JoinResult:
        """Decides, journals and applies a join; answers once it is durable, without waiting for the other ranks.

        A rank that waits for its generation to start waits outside the core: it listens for the start
        (:meth:`on_start`) and then asks :meth:`join_answer` (``croupier.server._join_wait``).
        """
        def decide() -> tuple[list[Event], list[Event]]:
            if self.max_jobs is not None and req.job not in self._state.jobs and len(self._state.jobs) >= self.max_jobs:
                raise ResourceExhausted(f"this coordinator holds {len(self._state.jobs)} jobs, its limit (croupier serve "
                                        f"--max-jobs {self.max_jobs}); job {req.job!r} is not one of them")
            events = decide_join(self._state, req, now_ms())
            return events, events

        events = self._commits.commit(decide, durable=True, budget=budget)
        _log_join(req, events)  # durable now; written outside the lock
        return self.join_answer(req.job, req.rank, budget)

    def join_answer(self, job: str, rank: int, budget: Budget = UNBOUNDED) -> JoinResult:
        """Where `rank` of `job`'s current generation stands, after its join: a waiting join's answer.

        A start it names is durable first (it may be another rank's event still on its way to disk).
        """
        self._commits.refresh(budget)
        return self._commits.read(lambda state: state.join_result(job, rank), durable=lambda r: r.start is not None)

    def on_start(self, job: str, number: int, fn: Callable[[], None]) -> bool:
        """Calls `fn` once generation `number` of `job` has started, has been replaced, or the
        coordinator stops (failed, closing); False, and nothing registered, when that is so already.

        `fn` is called with the commit protocol's lock held, from whichever thread applied the change:
        it MUST be quick and MUST NOT raise (an event loop's ``call_soon_threadsafe``). A waiting
        join holds no thread this way: it awaits what `fn` sets.
        """
        def listen(state: State) -> bool:  # under the protocol's lock: no start can slip in between
            if self._settled(state, job, number):
                return False
            self._listeners.setdefault(job, {}).setdefault(number, []).append(fn)
            return True

        return self._commits.read(listen)

    def off_start(self, job: str, number: int, fn: Callable[[], None]) -> None:
        """Forgets `fn` (a waiting join that gave up); nothing if it was called or never registered."""
        def forget(state: State) -> None:
            fns = self._listeners.get(job, {}).get(number)
            if fns is not None and fn in fns:
                fns.remove(fn)
                if not fns:
                    del self._listeners[job][number]
                    if not self._listeners[job]:
                        del self._listeners[job]

        self._commits.read(forget)

    def poll(self, budget: Budget = UNBOUNDED) -> None:
        """Reads what other replicas journaled (a shared store; nothing for a single writer), waking the
        joins whose generation started meanwhile; Unavailable when the store cannot be read."""
        self._commits.refresh(budget, force=True)

    def _settled(self, state: State, job: str, number: int) -> bool:
        j = state.jobs.get(job)
        gen = None if j is None else j.generation
        return gen is None or gen.number != number or gen.start is not None or self._commits.stopped()

    def _changed(self, jobs: set[str] | None) -> None:
        """Under the protocol's lock, after events of `jobs` (None: any job) were applied: calls the listeners
        of the generations that started or were replaced (O(1) per job while a generation still waits)."""
        if not self._listeners:
            return
        for job in list(self._listeners) if jobs is None else [j for j in jobs if j in self._listeners]:
            waiting = self._listeners[job]
            for number in [n for n in waiting if self._settled(self._state, job, n)]:
                for fn in waiting.pop(number):
                    fn()
            if not waiting:
                del self._listeners[job]

    def report(self, job: str, generation: int, rank: int, epoch: int, batches: int,
               checkpoint: tuple[int | None, Cursor | None, str] | None = None, lockstep: bool = True,
               items: int | None = None, budget: Budget = UNBOUNDED) -> Cursor | None:
        """Records how far a rank's loop got and, with `checkpoint` (step, cursor, origin), a
        checkpoint state it took; returns once the checkpoint is durable.

        A progress report alone is journaled without waiting: losing the last one in a crash
        only makes the cursor older until the rank's next report. On a shared store it is checked
        here (fencing first) and journaled by a background thread, several in one append, so a
        grant costs no commit.

        Returns:
            The checkpoint's cursor (for dynamic dealing, computed here), or None without one.
        """
        if checkpoint is None and self._commits.report(job, generation, rank, epoch, batches, budget):
            return None
        return self._commits.commit(
            lambda: decide_report(self._state, job, generation, rank, epoch, batches, now_ms(), checkpoint, lockstep,
                                  items),
            durable=checkpoint is not None, budget=budget)

    def amend(self, job: str, kind: str, values: Sequence[int], budget: Budget = UNBOUNDED) -> Amendment:
        """Records a change of a running mixture (``croupier.core.amend``); answers once it is durable.

        It holds from the first stream position the job's next generation deals (a restart, a
        resize or a rollback starts one), so that no rank of the running generation, which computes
        its own batches, deals by other rules than its peers.
        """
        return self._commits.commit(lambda: decide_amend(self._state, job, kind, values), durable=True, budget=budget)

    def ledger(self, job: str, budget: Budget = UNBOUNDED) -> tuple[Spec, bytes, bytes]:
        """The job's spec, its step ledger's segments, packed (``croupier.server._ledger``), and a
        fault-tolerant job's committed steps, packed (``croupier.core.ftsteps``); NotFound for an unknown job."""
        def packed(state: State) -> tuple[Spec, bytes, bytes]:
            j = state.jobs.get(job)
            if j is None or (j.generation is None and not j.steps.runs):
                state.current(job)  # NotFound, as for any call naming an unknown job
            assert j is not None
            steps = msgpack.packb([r.to_dict() for r in j.steps.runs]) if j.steps.runs else b""
            return j.spec, pack(j.ledger), steps

        self._commits.refresh(budget)
        return self._commits.read(packed)

    def commit_step(self, job: str, spec: Spec, run: str, parent: str, resumed: int, mode: str, batch: int,
                    step: CommittedStep, budget: Budget = UNBOUNDED) -> bool:
        """Records a fault-tolerant job's committed step (``croupier.core.ftsteps``); answers once it is
        durable, False when it was recorded already."""
        return self._commits.commit(lambda: decide_step(self._state, job, spec, run, parent, resumed, mode, batch, step),
                                    durable=True, budget=budget)

    def step_ledger(self, job: str, budget: Budget = UNBOUNDED) -> Ledger:
        """The job's step ledger (``croupier.core.ledger.Ledger``) as it stands now; NotFound for an unknown job.

        NOTE: the segments are copied (packed) under the lock and the ledger is built outside it: a
        question asked of it (the status page's timeline, a step's samples) computes without
        holding the coordinator's other calls.
        """
        spec, blob, _ = self.ledger(job, budget)
        return Ledger(job, spec, unpack(blob))

    def checkpoint(self, job: str, step: int | None, budget: Budget = UNBOUNDED) -> tuple[Spec, CheckpointRecord]:
        """The job's spec and its record of the checkpoint at training step `step`, or its latest
        record for None (NotFound if none)."""
        def recorded(state: State) -> tuple[Spec, CheckpointRecord]:
            record = state.checkpoint(job, step)
            return state.jobs[job].spec, record

        self._commits.refresh(budget)
        # NOTE: a record still on its way to disk must not be answered: a relaunch resuming from
        # it, then a crash that loses it, would skip what it names.
        return self._commits.read(recorded, durable=lambda _: True)

    # ---------------------------------------------------------------- reads

    def _request_plan(self, what: str, job: str, generation: int, rank: int, epoch: int, first: int,
                      count: int, budget: Budget) -> tuple[Spec, EpochPlan | None]:
        """Checks a lease or grant request (fencing first) and returns the plan of its epoch."""
        check_int(f"{what} count", count, 1, None, InvalidArgument)
        if count > MAX_LEASE_BATCHES:
            raise ResourceExhausted(f"{what} count {count} is more than the {MAX_LEASE_BATCHES} batches one call serves")
        def standing(state: State) -> tuple[Spec, Cursor | None, int]:
            gen = state.generation(job, generation)
            return state.jobs[job].dealing_spec, gen.start, gen.world

        self._commits.refresh(budget)
        spec, start, world = self._commits.read(standing)
        assert start is not None
        check_int("rank", rank, 0, world, InvalidArgument)
        check_int("epoch", epoch, 0, MAX_COUNT, InvalidArgument)
        check_int("first batch", first, 0, MAX_COUNT, InvalidArgument)
        if spec.batch_size * count > MAX_LEASE_INDICES:
            raise ResourceExhausted(
                f"{what} of {count} batches of {spec.batch_size} is more than the {MAX_LEASE_INDICES} indices one call serves"
            )
        return spec, plan_epoch(spec, start, world, epoch)

    def _grant(self, p: EpochPlan, job: str, generation: int, rank: int, epoch: int, first: int, count: int,
               budget: Budget) -> Grant:
        """The plan's grant; for a plan the coordinator deals, after the deal is durable."""
        return p.coordinator_grant(rank, first, count,
                                   lambda: self.deal(job, generation, rank, epoch, first, count, budget))

    def lease(self, job: str, generation: int, rank: int, epoch: int, first: int, count: int,
              progress: tuple[int, int] | None = None, budget: Budget = UNBOUNDED) -> Lease:
        """Up to `count` batches of `rank` from batch `first` of `epoch` (fewer at the epoch's end),
        with their indices computed here (the Lease RPC; samplers ask for grants instead).

        `progress` (epoch, batches) is the rank's report of how far its loop got (see :meth:`report`).

        With a `budget` answered at once (``Budget.at_once``), a lease computed ahead is answered from there
        without leaving the caller's thread; where answering would compute the lease, wait for the store or
        ask it, raises :class:`~croupier.server._deadline.WouldWait` instead, as :meth:`grant` does.
        """
        spec, p = self._request_plan("lease", job, generation, rank, epoch, first, count, budget)
        if budget.at_once and p is not None:
            return self._lease_kept(spec, p, job, generation, rank, first, count, progress, budget)
        if progress is not None:
            self.report(job, generation, rank, *progress, budget=budget)
        if p is None:
            return Lease(np.zeros(0, dtype=np.int64), [], True, 0, spec.space)
        g = self._grant(p, job, generation, rank, epoch, first, count, budget)
        idx, sizes = self._leases.lease(p, rank, first, count, g)
        return Lease(idx, sizes, p.ends(rank, first, count, len(sizes), g), p.known_samples(rank), spec.space)

    def _lease_kept(self, spec: Spec, p: EpochPlan, job: str, generation: int, rank: int, first: int, count: int,
                    progress: tuple[int, int] | None, budget: Budget) -> Lease:
        """:meth:`lease` answered at once: the lease computed ahead, else WouldWait with the state unchanged.

        NOTE: the grant and the lease kept are asked before the report, so that a call that would wait
        raises having changed nothing; one whose report would wait (a shared store) has taken the lease
        kept, which its thread then computes again, the same.
        """
        g = p.coordinator_grant(rank, first, count, _deal_waits)  # a plan the coordinator deals: WouldWait
        got = self._leases.ready(p, rank, first, count, g)
        if got is None:
            raise WouldWait("compute a lease")
        if progress is not None:
            self.report(job, generation, rank, *progress, budget=budget)
        idx, sizes = got
        return Lease(idx, sizes, p.ends(rank, first, count, len(sizes), g), p.known_samples(rank), spec.space)

    def hold_leases(self) -> Callable[[], None]:
        """Holds back the leases computed ahead while a lease's answer is made and sent; the function returned
        ends the hold (see ``LeaseAhead.hold``)."""
        return self._leases.hold()

    def deal(self, job: str, generation: int, rank: int, epoch: int, first: int,
             count: int, budget: Budget = UNBOUNDED) -> tuple[tuple[tuple[int, int], ...], bool]:
        """Dynamic dealing: batches first .. first + count - 1 of `rank`'s sequence in `epoch`, as
        runs of global batches (new ones are durable before this returns), and whether the epoch
        has nothing left to deal."""
        return self._commits.commit(lambda: decide_deal(self._state, job, generation, rank, epoch, first, count),
                                    durable=True, budget=budget)

    def grant(self, job: str, generation: int, rank: int, epoch: int, first: int, count: int,
              progress: tuple[int, int] | None = None, budget: Budget = UNBOUNDED) -> Grant:
        """The same batches as :meth:`lease`, as positions of the plan: the client computes their indices.

        With dynamic dealing, `first` counts batches of the rank's own sequence, and the grant
        names the global batches dealt to it (see :meth:`deal`).

        With a `budget` answered at once (``Budget.at_once``), raises :class:`~croupier.server._deadline.WouldWait`
        (having changed nothing) where answering would wait for the store or ask it -- a plan the
        coordinator deals, a shared store whose watch has not confirmed the journal's end within the
        staleness bound -- so that an event loop may answer
        the rest itself and hand only those to a thread.
        """
        spec, p = self._request_plan("grant", job, generation, rank, epoch, first, count, budget)
        # NOTE: answering at once, the grant is asked first: a plan the coordinator deals raises WouldWait
        # here, before anything changed (its deal waits for the store); any other plan's grant is its own,
        # the same before the report as after it.
        ready = p.coordinator_grant(rank, first, count, _deal_waits) if budget.at_once and p is not None else None
        if progress is not None:
            self.report(job, generation, rank, *progress, budget=budget)
        if p is None:
            return Grant(0, 0, True, 0)
        return ready if ready is not None else self._grant(p, job, generation, rank, epoch, first, count, budget)

    def job(self, job: str, budget: Budget = UNBOUNDED) -> JobStatus:
        """The job's spec, its current generation's standing, its ranks' cursors and its checkpoints."""
        def status(state: State) -> tuple[JobStatus, Spec, dict[tuple[int, int], int]]:
            gen = state.current(job)
            j = state.jobs[job]
            result = JoinResult(gen.number, gen.world, gen.start, gen.waiting_for(), j.held, None, gen.waiting())
            ranks = tuple(RankCursor(rank, epoch, batches, 0, at) for rank, (epoch, batches, at) in sorted(j.progress.items()))
            dealt = {(e, r): b.dealt(r) for e, b in j.deals.items() for r in b.runs}
            return JobStatus(j.spec, result, ranks, tuple(j.checkpoints), (*j.held, *j.pending)), j.dealing_spec, dealt

        self._commits.refresh(budget)
        st, spec, dealt = self._commits.read(status)
        # each rank's share of its epoch, computed outside the lock
        g = st.result
        ranks = tuple(dataclasses.replace(c, batches_in_epoch=_share(spec, g.start, g.world, c.rank, c.epoch, dealt))
                      for c in st.ranks)
        return dataclasses.replace(st, ranks=ranks)

    def jobs(self, budget: Budget = UNBOUNDED) -> list[str]:
        """The names of the jobs the coordinator holds, sorted."""
        self._commits.refresh(budget)
        return self._commits.read(lambda state: sorted(state.jobs))

    def snapshot_state(self) -> bytes:
        """The whole state, msgpack-encoded (for tests that check a call changed nothing)."""
        return self._commits.read(pack_snapshot)

    @property
    def failed(self) -> str | None:
        """Why the coordinator stopped acknowledging, or None."""
        return self._commits.failed

    def close(self) -> None:
        """Flushes what is queued, stops the writer and closes the store."""
        self._leases.close()
        self._commits.close()
        self.store.close()


def _commits_for(store: Store, state: State, rec: Recovered, snapshot_every: int, max_staleness_s: float,
                 timed: Callable[[float, int], None], changed: Changed) -> Commits:
    """The commit protocol of `store` (``croupier.server._commits.Commits``), picked here alone, holding `state` as
    recovered from `rec`; `max_staleness_s` bounds a watched shared store's reads, `timed(seconds, records)` is
    called after a single writer's group commits, `changed` under the protocol's lock after every apply, replay,
    rollback, failure and close."""
    if store.shared:
        return SharedCommits(store, state, rec, snapshot_every, changed, max_staleness_s)
    return WriterCommits(store, state, rec, snapshot_every, changed, timed)


def _deal_waits() -> NoReturn:
    """The deal of a grant answered at once: it would wait for the store (WouldWait)."""
    raise WouldWait("deal a grant")


def _share(spec: Spec, start: Cursor | None, world: int, rank: int, epoch: int,
           dealt: dict[tuple[int, int], int]) -> int:
    """A rank's batches in `epoch` as far as the coordinator knows them without computing: its
    steps when the plan knows them, else what it was dealt so far (0 when nothing was)."""
    if start is None:
        return 0
    p = plan_epoch(spec, start, world, epoch)
    if p is None:
        return 0
    known = p.known_steps(rank)
    return known if known is not None else dealt.get((epoch, rank), 0)


def _log_join(req: JoinRequest, events: list[Event]) -> None:
    """INFO lines for what a join changed: a job registered, a generation opened or started."""
    if not log.isEnabledFor(logging.INFO):
        return  # a spec's description costs a quarter of a millisecond: not made for a line nobody logs
    for ev in events:
        if isinstance(ev, JobRegistered):
            log.info("job %r registered: %s", ev.job, ev.spec.describe(), extra={"job": ev.job, "rank": req.rank})
        elif isinstance(ev, GenerationOpened):
            log.info("generation %d of job %r opened: world %d, incarnation %r", ev.generation, ev.job, ev.world, ev.incarnation,
                     extra={"job": ev.job, "generation": ev.generation, "rank": req.rank})
        elif isinstance(ev, GenerationStarted):
            log.info("generation %d of job %r started: all %d ranks joined, epoch %d", ev.generation, ev.job, req.world,
                     ev.start.epoch, extra={"job": ev.job, "generation": ev.generation, "rank": req.rank})
