"""What both samplers share: spec, world, join, epochs and iteration over leases."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

from torch.utils.data import Sampler

from croupier.client import _amending, _checkpointing
from croupier.client._audit_log import AuditLog, mixture_record
from croupier.client._prefetch import _Prefetcher
from croupier.client._progress import EpochLife
from croupier.client._resolve import agree, dist_ready, resolve_job, resolve_world, track
from croupier.client._rpc import CoordinatorClient, LeaseReply, Security
from croupier.client._world import _data_parallel_group, _first_of_its_rank
from croupier.core import settings
from croupier.core.amend import Amendment
from croupier.core.api import MAX_COUNT, MAX_LEASE_BATCHES, MAX_LEASE_INDICES, MAX_WORLD, JoinRequest
from croupier.core.checks import check_int
from croupier.core.cursor import Cursor, bind, epoch_agrees, fresh, is_fresh
from croupier.core.errors import Aborted, NotFound
from croupier.core.plan import EpochPlan
from croupier.core.plans import PlanKind, kind_of, plan_epoch
from croupier.core.spec import Spec

log = logging.getLogger("croupier")


class _Base(Sampler[Any]):
    _lockstep = True  # dynamic dealing: a checkpoint credits every rank with this rank's count
    _tag = False  # hand out Samples (index, source, source epoch, seed) instead of ints
    """What both samplers share: spec, resolution, join, epochs, leases and the checkpoint state.

    Counting: an *item* is what the sampler yields (an index, or a batch for the batch sampler).
    ``len()`` is this rank's items in the whole current epoch; ``items_done`` counts the items of
    the current epoch handed out so far, from the epoch's start (after a resume, the items this
    rank had taken before the checkpoint count too), and ``state_dict(consumed=)`` takes the same
    count.
    """

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
        self.job, self._job_named = resolve_job(job, spec)
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
        self._resume: Cursor | None = None  # from load_state_dict
        self._amendments: tuple[Amendment, ...] = ()  # a mixture's: the loaded state's, then the generation's
        self._resume_items: int | None = None  # items of the resumed epoch taken before the checkpoint (origin)
        self._cut_on_join: tuple[int, int] | None = None  # (epoch, items) cut by set_epoch before the join
        self._hint: int | None = None  # from set_epoch before the first batch
        self._generation = 0
        self._start: Cursor | None = None  # the generation's resume point, once joined
        self._epoch = 0  # the epoch being (or last) iterated
        self._before = 0  # items of self._epoch taken before this generation began
        self._yielded = 0  # items of self._epoch yielded by this generation, up to the chunk in hand
        self._chunk: Iterator[int] | None = None  # the index sampler's chunk being yielded
        self._chunk_len = 0
        self._life = EpochLife()  # the life of self._epoch
        self._active: object | None = None  # the iterator allowed to yield
        self._prefetcher: _Prefetcher | None = None
        self._read_ahead: str | None = None  # a known wrapper that reads this sampler ahead of the loop (_guard)
        self._origin: str | None = None  # the loaded checkpoint state's origin, for the audit log
        self._token_used = ""
        self._audit_dir = audit_dir or settings.get("CROUPIER_AUDIT_DIR")
        self._audit: AuditLog | None = None
        self._audit_path: tuple[str, str, str, int] | None = None  # where this rank's audit log is, once joined

    # ---------------------------------------------------------------- checkpointing (croupier.client._checkpointing)

    state_dict = _checkpointing.state_dict
    load_state_dict = _checkpointing.load_state_dict
    resume_latest = _checkpointing.resume_latest
    resume_from_step = _checkpointing.resume_from_step
    commit = _checkpointing.commit
    # a mixture's changes (croupier.client._amending)
    set_weights = _amending.set_weights
    grow = _amending.grow
    skip = _amending.skip

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
        req = JoinRequest(self.job, self.spec, token, num_replicas, rank, self._resume, self._hint, self._amendments)
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
        self._epoch = r.start.epoch
        self._before = self._taken_before(r.start)
        if self._audit_dir and _first_of_its_rank(self._group, rank):
            self._audit_path = (self._audit_dir, self.job, token, rank)
            self._audit = AuditLog(*self._audit_path)
            self._audit.start(job=self.job, token=token, generation=r.generation, world=num_replicas,
                              rank=rank, n=self.spec.n, tail=self.spec.tail, partition=self.spec.partition,
                              unit=self._unit if self._kind.fixed_batches else 0, origin=self._origin,
                              epoch=r.start.epoch, dealing=self.spec.dealing, **mixture_record(self.spec, self._amendments))
            if self._cut_on_join is not None:
                self._audit.write(t="cut", epoch=self._cut_on_join[0], items=self._cut_on_join[1])
        if self._hint is not None and self._hint == r.start.epoch - 1:
            self._epoch = self._hint  # that epoch is complete: its iteration yields nothing
            self._life.skip()
        self._yielded = 0

    @property
    def _dealing_spec(self) -> Spec:
        """The spec the orders are computed from: the job's, under its amendments (a mixture's history)."""
        return self.spec.amended(self._amendments) if self._amendments else self.spec

    def _plan(self, epoch: int) -> EpochPlan | None:
        world = self._resolve_world()[0]
        if self._start is None:  # before the join: what the generation will start from
            start = bind(self.spec, self._resume or fresh(self.spec, self._hint or 0), world)
            return plan_epoch(self._dealing_spec, start, world, epoch)
        return plan_epoch(self._dealing_spec, self._start, world, epoch)

    def _rest(self, epoch: int) -> int:
        """Items this rank gets in `epoch` from this generation (all of them, unless it resumed inside it).

        With token-budget batches this packs the whole epoch the first time (O(N), then cached);
        with dynamic dealing it is an estimate: this rank's even share of what is left.
        """
        p = self._plan(epoch)
        if p is None:
            return 0
        return p.steps(self.rank) if self._per_batch else p.samples(self.rank)

    def _known_rest(self, epoch: int) -> int | None:
        """:meth:`_rest` when it is known without computing the epoch: None for dynamic dealing, and
        for token-budget batches until the rank's leases reached the epoch's end."""
        p = self._plan(epoch)
        if p is None:
            return 0
        return None if p.known_steps(self.rank) is None else self._rest(epoch)

    def _items_before(self, epoch: int) -> int:
        """Items of `epoch` this rank had taken before this generation began (its resumed share)."""
        if self._start is not None:
            return self._before if epoch == self._start.epoch else 0
        if self._resume is not None and epoch == self._resume.epoch:
            return self._taken_before(self._resume)
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
        if self._resume is not None and self._resume_items is not None and self._resume.epoch == start.epoch:
            return self._resume_items
        return (self.spec.n - start.left) // (self.num_replicas * self._unit)

    # ---------------------------------------------------------------- epochs

    def _taken(self) -> int:
        """Items of the current epoch yielded by this generation."""
        if self._chunk is None:
            return self._yielded
        # NOTE: the index sampler hands out a chunk through an array iterator, at C speed; how far
        # it got is the iterator's position, read only when someone asks.
        return self._yielded + _position(self._chunk, self._chunk_len)

    def _finished(self) -> bool:
        """The current epoch is over: its last item was handed out, or the trainer moved on."""
        life = self._life
        if life.over or not life.entered or life.exhausted:
            return life.finished(0, None)
        return life.finished(self._taken(), self._known_rest(self._epoch))

    @property
    def _complete(self) -> bool:
        """The current epoch ended other than by its leases running out (see ``EpochLife.over``)."""
        return self._life.over

    def _log_end(self) -> None:
        if self._life.log_end() and self._audit is not None:
            self._audit.write(t="end", epoch=self._epoch)

    def _next_epoch(self) -> None:
        if not self._life.over:
            self._log_end()
        self._epoch += 1
        self._before = self._yielded = 0
        self._chunk = None
        self._life.next_epoch()

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
            self._epoch = epoch
            return
        if self._start is None:
            resume = self._resume
            if resume is not None and not epoch_agrees(self.spec, resume, epoch):
                if epoch == resume.epoch + 1:  # the loop moves on from a resumed epoch at once: cut the rest
                    taken = self._taken_before(resume)
                    self._cut_on_join = (resume.epoch, taken)
                    log.warning("croupier: set_epoch(%d) cuts epoch %d of job %r after %d items: the rest is not trained",
                                epoch, resume.epoch, self.job, taken)
                    self._resume = fresh(self.spec, epoch)
                    self._resume_items = None
                else:
                    raise ValueError(
                        f"set_epoch({epoch}) contradicts the checkpoint state loaded, which resumes epoch "
                        f"{resume.epoch} with {resume.left} of {self.spec.n} positions left"
                    )
            self._hint = epoch
            return
        finished = self._finished()
        nxt = self._epoch + 1 if finished else self._epoch
        if epoch == self._epoch:  # the epoch in hand (if it is finished, the next iteration goes on to the next)
            return
        if epoch == self._epoch + 1:
            if not finished:  # the loop stopped early and moves on: cut the rest of the epoch
                done = self.items_done
                log.warning("croupier: set_epoch(%d) cuts epoch %d of job %r after %d of %d items: the rest is not "
                            "trained", epoch, self._epoch, self.job, done, len(self))
                if self._audit is not None:
                    self._audit.write(t="cut", epoch=self._epoch, items=done)
                self._life.cut()
            self._stop_iteration()
            self._next_epoch()
            return
        raise ValueError(
            f"set_epoch({epoch}) contradicts the job's progress: this sampler is at epoch {self._epoch} "
            f"({'finished' if finished else f'{self.items_done} items in'}); the next epoch is {nxt}"
        )

    @property
    def items_resumed(self) -> int:
        """Items (indices, or batches for the batch sampler) of the current epoch that were taken before
        the checkpoint this sampler resumed from: where the loop's count of the epoch starts (0 unless
        the epoch was resumed)."""
        if self._empty:
            return 0
        return self._items_before(self.epoch if self._start is None else self._epoch)

    @property
    def items_done(self) -> int:
        """Items (indices, or batches for the batch sampler) of the current epoch handed out so far,
        counted from the epoch's start (the items taken before a resumed checkpoint count)."""
        if self._empty:
            return 0
        if self._start is None:
            return self._items_before(self.epoch)
        return self._items_before(self._epoch) + self._taken()

    @property
    def epoch(self) -> int:
        """The epoch the next iteration goes through."""
        if self._empty:
            return self._epoch
        if self._start is not None:
            return self._epoch + 1 if self._finished() else self._epoch
        if self._resume is None:
            return self._hint or 0
        if self._hint is not None and epoch_agrees(self.spec, self._resume, self._hint):
            return self._hint  # the epoch the checkpoint finished: its iteration yields nothing
        return self._resume.epoch

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
        self._yielded, self._chunk = self._taken(), None
        self._active = None
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def _items(self, it: object) -> Iterator[LeaseReply]:
        """The leases of the active iterator `it`, in order; the caller hands out their items and counts them."""
        if self._empty:
            return
        self._join()
        if self._life.entered and self._finished():  # the last iteration finished its epoch: this one goes on to the next
            self._next_epoch()
        # A new iterator goes on from the last item yielded.
        self._stop_iteration()
        self._active = it
        self._life.enter()
        p = self._plan(self._epoch)
        if p is None:  # the epoch just before a fresh start: the checkpoint finished it
            return
        known = self._known_rest(self._epoch)
        if self._life.exhausted or known is not None and self._taken() >= known:  # nothing (left) for this rank
            self._log_end()
            return
        assert self._client is not None
        # A whole number of batches: the index sampler's unit is 1 with batch_size 1, the batch
        # sampler's unit is its batch_size.
        first_batch = self._yielded * self._unit // self.spec.batch_size
        pf = _Prefetcher(self._client, self.job, self._generation, self.rank, self._epoch, first_batch,
                         self._lease_ahead, self._prefetch, p, self._tag)
        self._prefetcher = pf
        try:
            while True:
                pf.progress = (self._epoch, self._taken() * self._unit // self.spec.batch_size)
                try:
                    lease = pf.get()
                except (Aborted, NotFound) as e:
                    raise RuntimeError(
                        f"rank {self.rank} of job {self.job!r} was fenced off: a newer generation of the job "
                        f"replaced generation {self._generation} ({e}). Restart this process from the last checkpoint."
                    ) from None
                if lease is None:
                    self._life.exhaust()
                    self._log_end()
                    break
                yield lease
                if self._active is not it:
                    return
        finally:
            pf.close()

    def _log_lease(self, lease: LeaseReply) -> None:
        """Writes a lease taken by the index sampler to the audit log, as one record: the audit
        counts how many of its items were handed out from the checkpoints' item counts."""
        if self._audit is not None:
            self._audit.batch(self._epoch, self._before + self._yielded, lease.indices)

    def _with_secret(self, secret: str | None) -> Security:
        """This sampler's TLS and credential settings; the embedded coordinator's secret as the credential."""
        base = self._security if self._security is not None else Security.from_env()
        return dataclasses.replace(base, credential=secret) if secret else base

    def close(self) -> None:
        """Stops background leasing and closes the connection."""
        if self._start is not None and self._finished() and not self._life.over:
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
        d.update(_life=dataclasses.replace(self._life), _yielded=self._taken(), _chunk=None, _chunk_len=0, _client=None,
                 _prefetcher=None, _active=None,
                 _audit=None, _group=None)
        return d

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _position(it: Iterator[int], size: int) -> int:
    """How many items the iterator of an ``array.array`` of `size` items has handed out."""
    state = it.__reduce__()  # (iter, (array,), position), or (iter, ((),)) once exhausted
    return int(state[2]) if len(state) > 2 else size
