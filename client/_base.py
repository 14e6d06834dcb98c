"""What both samplers share: spec, world, join, epochs and iteration over leases."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from croupier.client._amender import Amender, Amending
from croupier.client._audit_log import AuditLog, mixture_record, resumed_record
from croupier.client._checkpointer import Checkpointer, Checkpointing, Session
from croupier.client._epoch import EpochProgress
from croupier.client._guard import check_callers
from croupier.client._link import Link
from croupier.client._prefetch import Prefetcher
from croupier.client._resolve import JobSlot, check_holds, release, resolve_job, track
from croupier.client._rpc import CoordinatorClient, LeaseReply, Security
from croupier.client._world import World, data_parallel_group, first_of_its_rank
from croupier.core import settings
from croupier.core.amend import Amendment
from croupier.core.api import MAX_COUNT, MAX_LEASE_BATCHES, MAX_LEASE_INDICES, JoinRequest
from croupier.core.checks import check_int, check_seconds
from croupier.core.cursor import Cursor, bind, epoch_agrees, fresh, is_fresh
from croupier.core.errors import Aborted, NotFound
from croupier.core.plan import EpochPlan
from croupier.core.registry import PlanKind, kind_of, plan_epoch
from croupier.core.schedule import Schedule
from croupier.core.spec import Spec

log = logging.getLogger("croupier")
_ONE_BATCH = Schedule()  # the default step schedule: one batch of every rank per step


def _refuse_torchft() -> None:
    """Refuses a sampler in a torchft job (``TORCHFT_LIGHTHOUSE`` set): there, each replica group is a
    world of its own to torch.distributed, so every group would be dealt the whole epoch, and a step
    torchft throws away would count as trained. ``croupier.integrations.torchft.StepLoader`` deals
    by the quorum and the committed steps instead."""
    lighthouse = os.environ.get("TORCHFT_LIGHTHOUSE")
    if lighthouse:
        raise RuntimeError(
            f"TORCHFT_LIGHTHOUSE is set ({lighthouse!r}): under torchft each replica "
            "group is its own torch.distributed world, so this sampler would deal every group the whole epoch "
            "(each sample trained once per group) and count aborted steps as trained; use "
            "croupier.integrations.torchft.StepLoader, which deals each step by its quorum and the committed steps")


def _none_before(start: Cursor) -> int:
    """:meth:`SamplerBase._taken_before` of a plan the coordinator deals: none (a rank counts its items from its
    generation's start)."""
    return 0


class SamplerBase(Checkpointing, Amending, Sampler[Any]):
    """What both samplers share: spec, resolution, join, epochs, leases and the checkpoint state.

    Counting: an *item* is what the sampler yields (an index, or a batch for the batch sampler).
    ``len()`` is this rank's items in the whole current epoch; ``items_done`` counts the items of
    the current epoch handed out so far, from the epoch's start (after a resume, the items this
    rank had taken before the checkpoint count too), and ``state_dict(consumed=)`` takes the same
    count.
    """

    _lockstep = True  # dynamic dealing: a checkpoint credits every rank with this rank's count
    _tag = False  # hand out Samples (index, source, source epoch, seed) instead of ints
    _unit: int  # positions per item this sampler yields: 1 for indices, batch_size for batches
    _per_batch: bool  # yields batches (lists) rather than indices
    _job_slot: JobSlot | None = None  # the derived job name this sampler holds (None: its job was given)
    read_ahead: Callable[[np.ndarray], object] | None = None  # told each lease's indices as prepared (_prefetch)

    def __init__(self, spec: Spec, empty: bool, num_replicas: int | None, rank: int | None, address: str | None,
                 job: str | None, incarnation: str | None, lease_ahead: int, prefetch: int, audit_dir: str | None,
                 process_group: Any | None = None, device_mesh: Any | None = None,
                 mesh_dim: str | int | None = None, join_timeout: float | None = None,
                 security: Security | None = None, schedule: Schedule = _ONE_BATCH) -> None:
        _refuse_torchft()
        self.spec = spec
        self._schedule = schedule  # the trainer's step schedule, sent with the join
        self._kind: PlanKind = kind_of(spec)
        self._empty = empty  # N = 0: nothing to deal, no coordinator needed
        self._world = World(num_replicas, rank, data_parallel_group(process_group, device_mesh, mesh_dim))
        self._start: Cursor | None = None  # the generation's resume point, once joined
        check_int("prefetch", prefetch, 1)
        check_int("lease_ahead", lease_ahead, 1, min(MAX_LEASE_BATCHES, MAX_LEASE_INDICES // spec.batch_size) + 1,
                  why=f"one lease serves at most {MAX_LEASE_BATCHES} batches and {MAX_LEASE_INDICES} indices "
                      f"(batches of {spec.batch_size} here)")
        if join_timeout is None:
            join_timeout = settings.get_float("CROUPIER_JOIN_TIMEOUT")
        join_timeout = check_seconds("join_timeout", join_timeout)
        self._join_timeout = join_timeout
        self._lease_ahead = lease_ahead
        self._prefetch = prefetch
        # NOTE: the job's name is resolved once every argument is checked: a sampler refused holds no name.
        fixed = incarnation is not None or settings.get("CROUPIER_INCARNATION") is not None
        self.job, self._job_named, self._job_slot = resolve_job(job, spec, self, fixed)
        self._link = Link(address, incarnation, security)
        self._amendments: tuple[Amendment, ...] = ()  # a mixture's: the loaded state's, then the generation's
        self._generation = 0
        self._progress = EpochProgress()  # where this sampler is in its epochs; replaced by its transitions
        self._active: object | None = None  # the iterator allowed to yield
        self._prefetcher: Prefetcher | None = None
        self._audit_dir = audit_dir or settings.get("CROUPIER_AUDIT_DIR")
        self._audit: AuditLog | None = None
        self._audit_path: tuple[str, str, str, int] | None = None  # where this rank's audit log is, once joined
        self._checkpointer = Checkpointer(self, empty=empty, unit=self._unit, kind=self._kind, lockstep=self._lockstep)
        self._amender = Amender(self)

    # ---------------------------------------------------------------- what the checkpointer and the amender ask

    def _session(self) -> Session | None:
        if self._start is None:
            return None
        return Session(self._generation, self._start, self._link.incarnation, self._link.client, self._audit)

    def _loaded(self, job: str, spec: Spec, amendments: tuple[Amendment, ...], progress: EpochProgress) -> None:
        self.job, self.spec, self._amendments, self._progress = job, spec, amendments, progress

    def _coordinator(self) -> CoordinatorClient:
        return self._link.for_records(self.job, self._world.resolve()[0])

    def _connected(self) -> CoordinatorClient | None:
        return self._link.connected()

    # ---------------------------------------------------------------- world

    @property  # torch's attribute; resolved when first needed, so a sampler may be built before init_process_group
    def num_replicas(self) -> int:
        """World size of the data-parallel group: given, else torch.distributed's, else the launcher's."""
        return self._world.resolve()[0]

    @num_replicas.setter
    def num_replicas(self, value: int) -> None:
        self._set_world(value, None)

    @property  # torch's attribute, resolved as num_replicas
    def rank(self) -> int:
        """This process's rank in the data-parallel group."""
        return self._world.resolve()[1]

    @rank.setter
    def rank(self, value: int) -> None:
        self._set_world(None, value)

    def _set_world(self, num_replicas: int | None, rank: int | None) -> None:
        if self._start is not None:
            raise RuntimeError(f"num_replicas and rank are fixed once the sampler has joined job {self.job!r}")
        self._world.set(num_replicas, rank)

    # ---------------------------------------------------------------- joining

    def _join(self) -> None:
        if self._start is not None:
            if self._link.client is None:  # a copy (pickle, deepcopy) of a joined sampler reconnects here
                self._link.reopen()
                track(self)
                if self._audit_path is not None:
                    self._audit = AuditLog(*self._audit_path)
            return
        num_replicas, rank = self._world.resolve()
        self._world.check_still()
        client, incarnation = self._link.open(self.job, num_replicas)
        track(self)
        p, taken = self._progress, self._checkpointer.taken
        # the step and generation of the checkpoint loaded go with its resume point (a state loaded and
        # cut by set_epoch before the join resumes at the next epoch's start, at the same step)
        step, parent = (taken.step, taken.generation) if p.resume is not None else (None, None)
        req = JoinRequest(self.job, self.spec, incarnation, num_replicas, rank, p.resume, p.hint, self._amendments,
                          step, parent, self._schedule)
        try:
            r = client.join_started(req, timeout=self._join_timeout)
        except Aborted as e:
            raise RuntimeError(
                f"rank {rank} of job {self.job!r} belongs to an incarnation that a newer one replaced ({e}); "
                "this process is a zombie: restart it from the last checkpoint"
            ) from None
        assert r.start is not None
        if r.spec is not None and r.spec != self.spec:  # this rank's sources are grown: the job's spec deals
            self.spec = r.spec
        self._amendments = r.amendments
        self._generation, self._start = r.generation, r.start
        # the epoch just before the start, if set_epoch named it, is complete: its iteration yields nothing
        self._progress = p = p.join(self.spec, r.start, self._taken_before(r.start))
        if self._audit_dir and first_of_its_rank(self._world.group, rank):
            self._audit_path = (self._audit_dir, self.job, incarnation, rank)
            self._audit = AuditLog(*self._audit_path)
            # NOTE: the audit record's key stays "token" (the log's format; croupier audit reads it)
            self._audit.start(job=self.job, token=incarnation, generation=r.generation, world=num_replicas,
                              rank=rank, n=self.spec.n, tail=self.spec.tail, partition=self.spec.partition,
                              unit=self._kind.item_unit(self._unit), origin=self._checkpointer.origin,
                              resumed=resumed_record(taken, self._checkpointer.resumed), epoch=r.start.epoch,
                              dealing=self.spec.dealing, **mixture_record(self.spec, self._amendments))
            if p.cut_on_join is not None:
                self._audit.write(t="cut", epoch=p.cut_on_join[0], items=p.cut_on_join[1])

    @property
    def _dealing_spec(self) -> Spec:
        """The spec the orders are computed from: the job's, under its amendments (a mixture's history)."""
        return self.spec.amended(self._amendments) if self._amendments else self.spec

    def _epoch_plan(self, epoch: int) -> EpochPlan | None:
        """The plan of `epoch` for this sampler's generation (None: the epoch just before a fresh start)."""
        world = self._world.resolve()[0]
        if self._start is None:  # before the join: what the generation will start from
            p = self._progress
            start = bind(self.spec, p.resume or fresh(self.spec, p.hint or 0), world)
            return plan_epoch(self._dealing_spec, start, world, epoch)
        return plan_epoch(self._dealing_spec, self._start, world, epoch)

    def _rest(self, epoch: int) -> int:
        """Items this rank gets in `epoch` from this generation (all of them, unless it resumed inside it).

        With token-budget batches this packs the whole epoch the first time (O(N), then cached);
        with dynamic dealing it is an estimate: this rank's even share of what is left.
        """
        p = self._epoch_plan(epoch)
        if p is None:
            return 0
        return p.steps(self.rank) if self._per_batch else p.samples(self.rank)

    def _known_rest(self, epoch: int) -> int | None:
        """:meth:`_rest` when it is known without computing the epoch: None for dynamic dealing, and
        for token-budget batches until the rank's leases reached the epoch's end."""
        p = self._epoch_plan(epoch)
        if p is None:
            return 0
        return None if p.known_steps(self.rank) is None else self._rest(epoch)

    def _items_before(self, epoch: int) -> int:
        """Items of `epoch` this rank had taken before this generation began (its resumed share)."""
        if self._start is not None:
            return self._progress.before if epoch == self._start.epoch else 0
        resume = self._progress.resume
        if resume is not None and epoch == resume.epoch:
            return self._taken_before(resume)
        return 0

    def _taken_before(self, start: Cursor) -> int:
        """Items of `start`'s epoch taken before `start`, as the checkpointing rank counted them.

        NOTE: the state's items name that count, so that ``len()`` after a resume is what the
        trainer's own restored batch counter expects, whatever the world was. A rank that loaded
        no state (one added by a scale-up), or a state without items, counts the positions
        already dealt in this world's items; for a resume at the same world size that is the
        same number.
        """
        if is_fresh(self.spec, start):
            return 0
        # a plan the coordinator deals counts a rank's items from its generation's start: none before it
        return self._kind.either(computed=self._counted_before, dealt=_none_before)(start)

    def _counted_before(self, start: Cursor) -> int:
        """:meth:`_taken_before` of a plan the ranks compute: the state's count, or the positions dealt."""
        p = self._progress
        if p.resume is not None and p.resume_items is not None and p.resume.epoch == start.epoch:
            return p.resume_items
        return (self.spec.n - start.left) // (self.num_replicas * self._unit)

    # ---------------------------------------------------------------- epochs

    def _finished(self) -> bool:
        """The current epoch is over: its last item was handed out, or the trainer moved on."""
        p = self._progress
        return p.finished(None if p.settled() else self._known_rest(p.epoch))

    def _log_end(self) -> None:
        p = self._progress
        if not p.end_logged:
            self._progress = p.end_written()
            if self._audit is not None:
                self._audit.write(t="end", epoch=p.epoch)

    def _next_epoch(self) -> None:
        if not self._progress.over:
            self._log_end()
        self._progress = self._progress.next_epoch()

    def set_epoch(self, epoch: int) -> None:
        """Accepted for drop-in compatibility; epochs advance by themselves.

        ``set_epoch(e + 1)`` while epoch ``e`` is not finished (a loop that stopped early and moves
        on, e.g. a trainer's batch limit) starts epoch ``e + 1`` as torch's sampler does; the rest
        of ``e`` is not trained, and the audit log says the trainer cut it.

        Raises:
            ValueError: `epoch` goes back before the job's progress (the checkpoint loaded, or the
                epochs this sampler has already been through), or skips an epoch.
        """
        check_int("epoch", epoch, 0, MAX_COUNT, ValueError)
        if self._empty:
            self._progress = self._progress.at(epoch)
            return
        if self._start is None:
            resume = self._progress.resume
            if resume is not None and not epoch_agrees(self.spec, resume, epoch):
                if epoch == resume.epoch + 1:  # the loop moves on from a resumed epoch at once: cut the rest
                    taken = self._taken_before(resume)
                    log.warning("croupier: set_epoch(%d) cuts epoch %d of job %r after %d items: the rest is not trained",
                                epoch, resume.epoch, self.job, taken)
                    self._progress = self._progress.cut_resumed(fresh(self.spec, epoch), taken)
                    return
                else:
                    raise ValueError(
                        f"set_epoch({epoch}) contradicts the checkpoint state loaded, which resumes epoch "
                        f"{resume.epoch} with {resume.left} of {self.spec.n} positions left"
                    )
            self._progress = self._progress.name_epoch(epoch)
            return
        finished = self._finished()
        current = self._progress.epoch
        nxt = current + 1 if finished else current
        if epoch == current:  # the epoch in hand (if it is finished, the next iteration goes on to the next)
            return
        if epoch == current + 1:
            if not finished:  # the loop stopped early and moves on: cut the rest of the epoch
                done = self.items_done
                log.warning("croupier: set_epoch(%d) cuts epoch %d of job %r after %d of %d items: the rest is not "
                            "trained", epoch, current, self.job, done, len(self))
                if self._audit is not None:
                    self._audit.write(t="cut", epoch=current, items=done)
                self._progress = self._progress.cut()
            self._stop_iteration()
            self._next_epoch()
            return
        raise ValueError(
            f"set_epoch({epoch}) contradicts the job's progress: this sampler is at epoch {current} "
            f"({'finished' if finished else f'{self.items_done} items in'}); the next epoch is {nxt}"
        )

    @property
    def generation(self) -> int:
        """The generation of the job this sampler serves (numbered by the coordinator); 0 before its first batch."""
        return self._generation

    @property
    def incarnation(self) -> str:
        """The incarnation this sampler joined its generation as (the ``incarnation`` argument, else the
        launcher's, agreed by every rank; the origins of its checkpoints name it); "" before its first batch."""
        return self._link.incarnation

    @property
    def items_resumed(self) -> int:
        """Items (indices, or batches for the batch sampler) of the current epoch that were taken before
        the checkpoint this sampler resumed from: where the loop's count of the epoch starts (0 unless
        the epoch was resumed)."""
        if self._empty:
            return 0
        return self._items_before(self.epoch if self._start is None else self._progress.epoch)

    @property
    def items_done(self) -> int:
        """Items (indices, or batches for the batch sampler) of the current epoch handed out so far,
        counted from the epoch's start (the items taken before a resumed checkpoint count)."""
        if self._empty:
            return 0
        if self._start is None:
            return self._items_before(self.epoch)
        return self._items_before(self._progress.epoch) + self._progress.taken()

    @property
    def epoch(self) -> int:
        """The epoch the next iteration goes through."""
        p = self._progress
        if self._empty:
            return p.epoch
        if self._start is not None:
            return p.epoch + 1 if self._finished() else p.epoch
        if p.resume is None:
            return p.hint or 0
        if p.hint is not None and epoch_agrees(self.spec, p.resume, p.hint):
            return p.hint  # the epoch the checkpoint finished: its iteration yields nothing
        return p.resume.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        # torch's loops and frameworks sometimes assign sampler.epoch: the same as set_epoch.
        self.set_epoch(value)

    def __len__(self) -> int:
        """This rank's items in the whole current epoch (torch's meaning), resumed or not.

        After a resume inside an epoch, the items this rank had taken before the checkpoint count
        (as the trainer's own batch counter does); iterating yields the rest.
        """
        if self._empty:
            return 0
        e = self.epoch
        return self._items_before(e) + self._rest(e)

    # ---------------------------------------------------------------- iteration

    def _stop_iteration(self) -> None:
        self._progress = self._progress.stop()
        self._active = None
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def _items(self, it: object) -> Iterator[LeaseReply]:
        """The leases of the active iterator `it`, in order; the caller hands out their items and counts them."""
        if self._empty:
            return
        check_holds(self)
        self._join()
        if self._progress.entered and self._finished():  # the last iteration finished its epoch: on to the next
            self._next_epoch()
        # A new iterator goes on from the last item yielded.
        self._stop_iteration()
        self._active = it
        self._progress = self._progress.enter()
        epoch = self._progress.epoch
        p = self._epoch_plan(epoch)
        if p is None:  # the epoch just before a fresh start: the checkpoint finished it
            return
        known = self._known_rest(epoch)
        if self._progress.exhausted or known is not None and self._progress.taken() >= known:  # nothing (left) here
            self._log_end()
            return
        assert self._link.client is not None
        # A whole number of batches: the index sampler's unit is 1 with batch_size 1, the batch
        # sampler's unit is its batch_size.
        first_batch = self._progress.yielded * self._unit // self.spec.batch_size
        pf = Prefetcher(self._link.client, self.job, self._generation, self.rank, epoch, first_batch,
                        self._lease_ahead, self._prefetch, p, self._tag, self.read_ahead,
                        ramp=first_batch == 0 and self._start is not None and epoch == self._start.epoch)
        self._prefetcher = pf
        try:
            while True:
                pf.progress = (epoch, self._progress.taken() * self._unit // self.spec.batch_size)
                try:
                    lease = pf.get()
                except (Aborted, NotFound) as e:
                    raise RuntimeError(
                        f"rank {self.rank} of job {self.job!r} was fenced off: a newer generation of the job "
                        f"replaced generation {self._generation} ({e}). Restart this process from the last checkpoint."
                    ) from None
                if lease is None:
                    self._progress = self._progress.exhaust()
                    self._log_end()
                    break
                yield lease
                if self._active is not it:
                    return
        finally:
            pf.close()

    def _note_callers(self) -> None:
        """At each ``iter()``: a known wrapper that reads this sampler ahead of the loop (``_guard``) is noted."""
        cp = self._checkpointer
        cp.read_ahead = check_callers(self._start is None, self._progress.resume is not None) or cp.read_ahead

    def _log_lease(self, lease: LeaseReply) -> None:
        """Writes a lease taken by the index sampler to the audit log, as one record: the audit
        counts how many of its items were handed out from the checkpoints' item counts."""
        if self._audit is not None:
            p = self._progress
            self._audit.batch(p.epoch, p.before + p.yielded, lease.indices)

    def _done_with_job(self) -> bool:
        """It joined and finished its epoch: a later sampler of its spec may go on with its derived job."""
        return self._start is not None and self._finished()

    def __del__(self) -> None:
        slot = self._job_slot
        if slot is not None and not slot.released:
            slot.collected(self._done_with_job())

    def close(self) -> None:
        """Stops background leasing and closes the connection."""
        release(self._job_slot)
        if self._start is not None and self._finished() and not self._progress.over:
            self._log_end()
        if self._prefetcher is not None:
            self._prefetcher.close()
        self._link.close()
        if self._audit is not None:
            self._audit.close()

    # ---------------------------------------------------------------- copies

    def __getstate__(self) -> dict[str, Any]:
        """A copy (pickle, deepcopy) carries where the sampler is, not its connection or threads.

        It reconnects to the same coordinator and generation at its first batch; the
        data-parallel group is not carried (the world it resolved is).
        """
        d = self.__dict__.copy()
        d.update(_progress=self._progress.stop(), _link=self._link.for_copy(), _prefetcher=None, _active=None, _audit=None,
                 _world=self._world if self._empty else self._world.for_copy())
        return d

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

