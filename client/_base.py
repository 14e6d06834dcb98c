"""What both samplers share: spec, world, join, epochs and iteration over leases."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch.utils.data import Sampler

from croupier.client._amender import Amender
from croupier.client._audit_log import AuditLog, mixture_record
from croupier.client._checkpointer import Checkpointer, Session
from croupier.client._epoch import EpochProgress
from croupier.client._guard import check_callers
from croupier.client._prefetch import _Prefetcher
from croupier.client._resolve import agree, check_holds, dist_ready, release, resolve_job, resolve_world, track
from croupier.client._rpc import CoordinatorClient, LeaseReply, Security
from croupier.client._world import _data_parallel_group, _first_of_its_rank
from croupier.core import settings
from croupier.core.amend import Amendment
from croupier.core.api import MAX_COUNT, MAX_LEASE_BATCHES, MAX_LEASE_INDICES, MAX_WORLD, JoinRequest
from croupier.core.checks import check_int
from croupier.core.cursor import Cursor, bind, epoch_agrees, fresh, is_fresh
from croupier.core.errors import Aborted, NotFound
from croupier.core.plan import EpochPlan
from croupier.core.registry import PlanKind, kind_of, plan_epoch
from croupier.core.spec import Spec

log = logging.getLogger("croupier")


class _Base(Sampler[Any]):
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

    def __init__(self, spec: Spec, empty: bool, num_replicas: int | None, rank: int | None, address: str | None,
                 job: str | None, token: str | None, lease_ahead: int, prefetch: int, audit_dir: str | None,
                 process_group: Any | None = None, device_mesh: Any | None = None,
                 mesh_dim: str | int | None = None, join_timeout: float | None = None,
                 security: Security | None = None) -> None:
        self.spec = spec
        self._kind: PlanKind = kind_of(spec)
        self._empty = empty  # N = 0: nothing to deal, no coordinator needed
        self._group = _data_parallel_group(process_group, device_mesh, mesh_dim)
        for name, v in (("num_replicas", num_replicas), ("rank", rank)):
            if v is not None:
                check_int(name, v, 0 if name == "rank" else 1, MAX_WORLD + 1, ValueError)
        self._given = (num_replicas, rank)
        self._world: tuple[int, int] | None = None  # (num_replicas, rank) once resolved
        self._world_from_dist = False
        if num_replicas is not None and rank is not None:
            self._resolve_world()
        self._start: Cursor | None = None  # the generation's resume point, once joined
        self.job, self._job_named = resolve_job(job, spec, self)
        self._address = address
        self._token = token
        if lease_ahead < 1 or prefetch < 1:
            raise ValueError(f"lease_ahead and prefetch must be >= 1 (got lease_ahead={lease_ahead}, prefetch={prefetch})")
        if lease_ahead > MAX_LEASE_BATCHES or lease_ahead * spec.batch_size > MAX_LEASE_INDICES:
            raise ValueError(
                f"lease_ahead={lease_ahead} batches of {spec.batch_size} is more than one lease serves "
                f"(at most {MAX_LEASE_BATCHES} batches and {MAX_LEASE_INDICES} indices)"
            )
        if join_timeout is None:
            join_timeout = settings.get_float("CROUPIER_JOIN_TIMEOUT")
        if not join_timeout > 0:
            raise ValueError(f"join_timeout must be > 0 seconds (got {join_timeout!r})")
        self._join_timeout = join_timeout
        self._lease_ahead = lease_ahead
        self._agreed: tuple[str, str, str | None] | None = None  # (token, address, secret) agreed before the join
        self._security = security
        self._security_used: Security | None = None
        self._prefetch = prefetch
        self._client: CoordinatorClient | None = None
        self._address_used = ""  # the coordinator this sampler joined, to reconnect after a copy
        self._amendments: tuple[Amendment, ...] = ()  # a mixture's: the loaded state's, then the generation's
        self._generation = 0
        self._progress = EpochProgress()  # where this sampler is in its epochs; replaced by its transitions
        self._active: object | None = None  # the iterator allowed to yield
        self._prefetcher: _Prefetcher | None = None
        self._token_used = ""
        self._audit_dir = audit_dir or settings.get("CROUPIER_AUDIT_DIR")
        self._audit: AuditLog | None = None
        self._audit_path: tuple[str, str, str, int] | None = None  # where this rank's audit log is, once joined
        self._checkpointer = Checkpointer(self, empty=empty, unit=self._unit, lockstep=self._lockstep,
                                          coordinator_deals=self._kind.coordinator_deals)
        self._amender = Amender(self)

    # ---------------------------------------------------------------- checkpointing (croupier.client._checkpointer)

    def state_dict(self, consumed: int | None = None, *, step: int | None = None) -> dict[str, Any]:
        """The checkpoint state: a small, topology-free dict naming where the job is in its data.

        Save it with the model; loading it into a sampler of any world size resumes there. Once
        the sampler has joined, the state is also recorded at the coordinator (durably, before
        this returns), with `step` if given: :meth:`resume_from_step` finds it there, for a
        trainer that keeps only its step. When the coordinator does not answer, a warning says
        so and the state is returned all the same (it alone suffices to resume).

        Args:
            consumed: With a loader that reads the sampler ahead (a plain ``DataLoader`` with
                ``num_workers > 0``, Accelerate's), pass how many items (indices, or batches for
                the batch sampler) this rank's loop has taken in the current epoch, counted from
                the epoch's start as ``len()`` counts them (a trainer's batch index + 1, times the
                batch size for the index sampler). ``StatefulDataLoader`` and ``num_workers=0``
                need nothing: the sampler has handed out exactly what the loop took.
                With dynamic dealing, count from this generation's start (its resume) instead:
                a rank's batches there are its own, not a share of the epoch.
            step: The trainer's global step at this checkpoint (the number of optimizer steps
                taken since the job's start, as the HF Trainer's ``global_step``, Lightning's
                ``global_step`` or torchtitan's ``step`` count it), naming the coordinator's record.
        """
        return self._checkpointer.state_dict(consumed, step=step)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resumes from a checkpoint state (any world size); an empty dict means "from the start".

        A sampler whose job was not named (no ``job=``, no ``CROUPIER_JOB``) takes the job named
        in the state: resuming a checkpoint continues its job, whatever the new launch is called.

        Raises:
            ValueError: the state is malformed, or from another job or spec (both are shown).
            RuntimeError: this sampler has already started serving a generation.
        """
        self._checkpointer.load(state_dict, self._job_named)

    def resume_latest(self) -> bool:
        """Resumes from the latest checkpoint the job recorded at the coordinator, if any.

        For workers that keep no state of their own (dynamic dealing's ``lockstep=False``: the
        latest record is the union of every rank's commits). Call it on every rank of the new
        launch, before the first batch, once the previous launch's processes are gone (a record
        made between two ranks' calls would make them disagree, and the join refuses that).

        Returns:
            True when a record was loaded; False when the job has none (it starts from the beginning).
        """
        return self._checkpointer.resume(None, "resume_latest")

    def resume_from_step(self, step: int) -> None:
        """Resumes from the checkpoint the job recorded at training step `step` (any world size).

        For a trainer that keeps its global step but not the sampler's state: every rank's
        ``state_dict(step=s)`` recorded the state at the coordinator, and this loads it, exactly
        as ``load_state_dict`` would load the saved dict. Call it on every rank, where
        ``load_state_dict`` would go: after ``init_process_group`` and before the first batch.

        The job must be found again: name it (``job=`` or ``CROUPIER_JOB``) or keep the launch's
        run id (torchrun ``--rdzv-id``, the same Slurm job), and keep the coordinator (an address,
        or the embedded one's store under ``CROUPIER_STATE_DIR`` on global rank 0's host; a job of
        one process keeps no records across restarts).

        Rolling back past several checkpoints is allowed: the records of later steps stay until
        the job records a checkpoint at or before their step again, which replaces them.

        Raises:
            LookupError: the coordinator has no record of `step` for this job (the message lists
                the steps it has).
            ValueError: the record is of another spec; a malformed step.
            RuntimeError: this sampler has already started serving a generation.
        """
        self._checkpointer.resume(step, "resume_from_step")

    def commit(self, consumed: int | None = None) -> dict[str, Any]:
        """Dynamic dealing with independent workers: records this rank's progress as done and returns
        the job's state (``state_dict()`` with ``lockstep=False``; the same call for lockstep ranks)."""
        return self.state_dict(consumed)

    # ---------------------------------------------------------------- a mixture's changes (croupier.client._amender)

    def set_weights(self, weights: Sequence[float]) -> Amendment:
        """Records new weights for the job's mixture, one per source (any positive scale).

        They hold from the first sample the job's next generation deals (a restart, a resize or a
        rollback starts one), on every rank at once, until the end of the run: the spec's schedule of
        weights ends there. Each source's epochs go on across the change. Call it on one rank.

        Returns:
            The amendment as the coordinator recorded it (``at`` None: pending).

        Raises:
            ValueError: bad weights, or a job that deals no mixture (the message says which).
            RuntimeError: the sampler has not joined its coordinator yet (iterate it first, or use
                ``croupier amend``).
        """
        return self._amender.set_weights(weights)

    def grow(self, source: int, size: int) -> Amendment:
        """Records that `source` now has `size` samples (shards appended to it).

        The new samples are dealt from that source's next source epoch after the job's next generation
        starts: the source epoch in progress finishes with the samples it began with, so none of its
        samples is dealt twice or left out. Indices are then numbered as a ``ConcatDataset`` of the
        grown sources numbers them; a sampler may be made on the grown dataset (its sources' new sizes).

        Raises:
            ValueError: a source that is not one of the job's, a size that is not larger, a spec with
                lengths (token budgets), or a job that deals no mixture.
            RuntimeError: the sampler has not joined its coordinator yet.
        """
        return self._amender.grow(source, size)

    def skip(self, indices: Iterable[int]) -> Amendment:
        """Takes samples out of the job for good (found corrupt): no rank of the job's next generation,
        or of any later one, deals them; ``croupier audit`` counts them as skipped, not missing.

        `indices` are dataset indices as this sampler hands them out. They hold from the first sample
        the next generation deals, in the source epoch in progress too; with ``tail="pad_last"`` a job
        resumed inside an epoch holds them from the next epoch (a pad copies the epoch's last position,
        which may have been dealt already), so a corrupt sample found mid-epoch there must also be
        passed over by the dataset until that epoch ends.

        Raises:
            ValueError: an index out of range or skipped already, a skip that would leave a source
                empty, or a job that deals no mixture.
            RuntimeError: the sampler has not joined its coordinator yet.
        """
        return self._amender.skip(indices)

    # ---------------------------------------------------------------- what the checkpointer and the amender ask

    def _session(self) -> Session | None:
        if self._start is None:
            return None
        return Session(self._generation, self._start, self._token_used, self._client, self._audit)

    def _loaded(self, job: str, spec: Spec, amendments: tuple[Amendment, ...], progress: EpochProgress) -> None:
        self.job, self.spec, self._amendments, self._progress = job, spec, amendments, progress

    def _coordinator(self) -> CoordinatorClient:
        num_replicas, _ = self._resolve_world()
        self._agreed = agree(self._token, self._address, self.job, num_replicas)
        return CoordinatorClient(self._agreed[1], security=self._with_secret(self._agreed[2]))

    def _connected(self) -> CoordinatorClient | None:
        return None if self._client is None or self._client.closed else self._client

    # ---------------------------------------------------------------- world

    def _resolve_world(self) -> tuple[int, int]:
        """`num_replicas` and `rank`, resolved the first time anything needs them (not at construction)."""
        if self._world is None:
            self._world_from_dist = dist_ready()
            self._world = resolve_world(self._given[0], self._given[1], self._group)
        return self._world

    @property  # torch's attribute; resolved when first needed, so a sampler may be built before init_process_group
    def num_replicas(self) -> int:
        """World size of the data-parallel group: given, else torch.distributed's, else the launcher's."""
        return self._resolve_world()[0]

    @num_replicas.setter
    def num_replicas(self, value: int) -> None:
        self._set_world(value, None)

    @property  # torch's attribute, resolved as num_replicas
    def rank(self) -> int:
        """This process's rank in the data-parallel group."""
        return self._resolve_world()[1]

    @rank.setter
    def rank(self, value: int) -> None:
        self._set_world(None, value)

    def _set_world(self, num_replicas: int | None, rank: int | None) -> None:
        if self._start is not None:
            raise RuntimeError(f"num_replicas and rank are fixed once the sampler has joined job {self.job!r}")
        w, r = self._given
        self._given = (num_replicas if num_replicas is not None else w, rank if rank is not None else r)
        self._world = None

    def _check_world_still(self) -> None:
        """A world resolved before torch.distributed was initialised must match the one it has now."""
        if self._world_from_dist or self._given[0] is not None and self._given[1] is not None:
            return
        dist = dist_ready()
        if not dist:
            return
        now = resolve_world(self._given[0], self._given[1], self._group)
        if now != self._world:
            raise RuntimeError(
                f"this sampler took num_replicas={self._world[0] if self._world else None}, "
                f"rank={self._world[1] if self._world else None} before torch.distributed was initialised, but "
                f"torch.distributed now says num_replicas={now[0]}, rank={now[1]}: build the sampler (or call len() "
                "on it) after init_process_group, or pass num_replicas= and rank="
            )

    # ---------------------------------------------------------------- joining

    def _join(self) -> None:
        if self._start is not None:
            if self._client is None:  # a copy (pickle, deepcopy) of a joined sampler reconnects here
                self._client = CoordinatorClient(self._address_used, security=self._security_used)
                track(self)
                if self._audit_path is not None:
                    self._audit = AuditLog(*self._audit_path)
            return
        num_replicas, rank = self._resolve_world()
        self._check_world_still()
        token, address, secret = self._agreed or agree(self._token, self._address, self.job, num_replicas)
        self._security_used = self._with_secret(secret)
        self._client = CoordinatorClient(address, security=self._security_used)
        self._address_used = address
        track(self)
        p = self._progress
        req = JoinRequest(self.job, self.spec, token, num_replicas, rank, p.resume, p.hint, self._amendments)
        try:
            r = self._client.join_started(req, timeout=self._join_timeout)
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
        self._token_used = token
        # the epoch just before the start, if set_epoch named it, is complete: its iteration yields nothing
        self._progress = p = p.join(r.start.epoch, self._taken_before(r.start))
        if self._audit_dir and _first_of_its_rank(self._group, rank):
            self._audit_path = (self._audit_dir, self.job, token, rank)
            self._audit = AuditLog(*self._audit_path)
            self._audit.start(job=self.job, token=token, generation=r.generation, world=num_replicas,
                              rank=rank, n=self.spec.n, tail=self.spec.tail, partition=self.spec.partition,
                              unit=self._unit if self._kind.fixed_batches else 0, origin=self._checkpointer.origin,
                              epoch=r.start.epoch, dealing=self.spec.dealing, **mixture_record(self.spec, self._amendments))
            if p.cut_on_join is not None:
                self._audit.write(t="cut", epoch=p.cut_on_join[0], items=p.cut_on_join[1])

    @property
    def _dealing_spec(self) -> Spec:
        """The spec the orders are computed from: the job's, under its amendments (a mixture's history)."""
        return self.spec.amended(self._amendments) if self._amendments else self.spec

    def _epoch_plan(self, epoch: int) -> EpochPlan | None:
        """The plan of `epoch` for this sampler's generation (None: the epoch just before a fresh start)."""
        world = self._resolve_world()[0]
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

        NOTE: the state's origin names that count, so that ``len()`` after a resume is what the
        trainer's own restored batch counter expects, whatever the world was. A rank that loaded
        no state (one added by a scale-up), or a state without an origin, counts the positions
        already dealt in this world's items; for a resume at the same world size that is the
        same number.
        """
        if is_fresh(self.spec, start) or self._kind.coordinator_deals:
            return 0  # a plan the coordinator deals counts a rank's items from its generation's start
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
        assert self._client is not None
        # A whole number of batches: the index sampler's unit is 1 with batch_size 1, the batch
        # sampler's unit is its batch_size.
        first_batch = self._progress.yielded * self._unit // self.spec.batch_size
        pf = _Prefetcher(self._client, self.job, self._generation, self.rank, epoch, first_batch,
                         self._lease_ahead, self._prefetch, p, self._tag)
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

    def _with_secret(self, secret: str | None) -> Security:
        """This sampler's TLS and credential settings; the embedded coordinator's secret as the credential."""
        base = self._security if self._security is not None else Security.from_env()
        return dataclasses.replace(base, credential=secret) if secret else base

    def _done_with_job(self) -> bool:
        """It joined and finished its epoch: a later sampler of its spec may go on with its derived job."""
        return self._start is not None and self._finished()

    def close(self) -> None:
        """Stops background leasing and closes the connection."""
        release(self)
        if self._start is not None and self._finished() and not self._progress.over:
            self._log_end()
        if self._prefetcher is not None:
            self._prefetcher.close()
        if self._client is not None:
            self._client.close()
        if self._audit is not None:
            self._audit.close()

    # ---------------------------------------------------------------- copies

    def __getstate__(self) -> dict[str, Any]:
        """A copy (pickle, deepcopy) carries where the sampler is, not its connection or threads.

        It reconnects to the same coordinator and generation at its first batch; the
        data-parallel group is not carried (the world it resolved is).
        """
        if self._group is not None and not self._empty:
            self._resolve_world()
        d = self.__dict__.copy()
        d.update(_progress=self._progress.stop(), _client=None, _prefetcher=None, _active=None, _audit=None,
                 _group=None)
        return d

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

