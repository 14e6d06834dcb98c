"""`DistributedSampler` and `DistributedBatchSampler`: drop-ins for torch's, fed by a croupier coordinator."""

from __future__ import annotations

import array
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence, Sized
from typing import Any

import numpy as np
from torch.utils.data import BatchSampler, Sampler
from torch.utils.data.distributed import DistributedSampler as _TorchDistributedSampler

from croupier.client import _expander
from croupier.client._audit_log import AuditLog
from croupier.client._resolve import agree, dist_ready, resolve_job, resolve_world, track
from croupier.client._rpc import CoordinatorClient, LeaseReply, Security, Unreachable
from croupier.core.api import MAX_COUNT, MAX_LEASE_BATCHES, MAX_LEASE_INDICES, MAX_WORLD, Grant, JoinRequest
from croupier.core.checkpoint import from_state, to_state
from croupier.core.checks import check_int
from croupier.core.cursor import Cursor, bind, epoch_agrees, fresh, is_fresh, show
from croupier.core.errors import Aborted, CroupierError, NotFound
from croupier.core.plan import EpochPlan
from croupier.core.plans import PlanKind, kind_for, kind_of, plan_epoch
from croupier.core.spec import TOKEN_WINDOW, Spec

_DONE = object()
log = logging.getLogger("croupier")
#: How long state_dict waits for the coordinator to record a checkpoint before going on without it.
_REPORT_TIMEOUT_S = 5.0
#: How long a lease waits for the coordinator's answer before the rank computes it itself; and
#: that wait while the coordinator is not answering.
_ASK_S, _PROBE_S = 1.0, 0.25


def _dataset_size(dataset: Sized | int) -> int:
    if isinstance(dataset, bool):
        raise TypeError(f"dataset must be a sized object or an int (got {dataset!r})")
    if isinstance(dataset, (int, np.integer)):
        if dataset < 0:
            raise ValueError(f"dataset size must be >= 0 (got {int(dataset)})")
        return int(dataset)
    if isinstance(dataset, Sampler):
        # NOTE: frameworks that re-shard a loader rebuild its batch sampler around their own
        # sampler; read as a dataset, a sampler's len() is its shard, and training would
        # silently see only indices below it.
        raise TypeError(
            f"dataset is a {type(dataset).__module__}.{type(dataset).__name__}, a sampler, not a dataset: croupier's "
            "samplers deal the dataset themselves, so pass the dataset (or its size N). A framework that re-shards "
            "loaders rebuilt this sampler around its own (Lightning: see croupier.integrations.lightning)"
        )
    if not isinstance(dataset, Sized):
        raise TypeError(f"dataset must be a sized object or an int N (got {type(dataset).__name__}, which has no len())")
    return len(dataset)


class _Prefetcher:
    """Prepares batches of one rank in one epoch ahead of use, in a background thread, at most `depth` leases ahead.

    Every lease is asked of the coordinator, which fences replaced generations, as a grant: which
    batches of the generation's plan the rank takes (a few bytes), not their indices. The
    indices are computed from the plan by this process's lease helper process
    (`croupier.client._expander`: in a thread here the computation would contend for the GIL
    with the training loop; ``CROUPIER_EXPANDER=0`` computes here instead). When the coordinator
    does not answer within 1 s (0.25 s while it keeps not answering),
    the rank computes the lease from its plan, the same code the coordinator runs (its data
    cannot have changed: only a join changes it, and a join needs the coordinator), and asks
    again at the next lease; a lease refused as fenced stops it.
    """

    def __init__(self, client: CoordinatorClient, job: str, generation: int, rank: int, epoch: int, first: int,
                 lease_size: int, depth: int, plan: EpochPlan) -> None:
        self._q: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._args = (client, job, generation, rank, epoch)
        self._next = first
        self._lease_size = lease_size
        self._plan = plan
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
        plan, count = self._plan, self._lease_size
        missed = False  # the last ask went unanswered
        while not self._stop.is_set():
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
                if not missed:
                    log.warning("croupier: the coordinator of job %r does not answer; rank %d %s", job, rank,
                                "waits for it (its batches are dealt there)" if plan.coordinator_deals
                                else "trains on from its plan and asks again at every lease")
                missed = True
                if plan.coordinator_deals:
                    # An answer that comes at once (a refused connection, a failed store beside us)
                    # is asked again no sooner than a probe's wait later, not in a loop.
                    self._stop.wait(max(0.0, _PROBE_S - (time.monotonic() - asked)))
                    continue
                got = None
                self.ungranted += 1
            idx, sizes = _expander.lease(plan, rank, self._next, count, got)
            if got is not None and not plan.agrees(got, sizes):
                raise RuntimeError(
                    f"the coordinator granted {got.batches} batches (the last of {got.last_size}) from batch "
                    f"{self._next} of epoch {epoch}, but this rank's plan has {len(sizes)}: the client and the "
                    "coordinator compute different plans (another croupier release?)"
                )
            end = plan.ends(rank, self._next, count, len(sizes), got)
            self._next += len(sizes)
            if sizes:
                self._put(LeaseReply(idx, sizes, end, plan.known_samples(rank), checked=True))
            if end:
                return

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


def _data_parallel_group(process_group: Any | None, device_mesh: Any | None, mesh_dim: str | int | None) -> Any | None:
    """The process group whose ranks deal the data: given, or the `mesh_dim` dimension of `device_mesh`."""
    if device_mesh is None:
        if mesh_dim is not None:
            raise ValueError(f"mesh_dim={mesh_dim!r} needs device_mesh=")
        return process_group
    if process_group is not None:
        raise ValueError("pass process_group= or device_mesh=, not both")
    if mesh_dim is None and device_mesh.ndim > 1:
        raise ValueError(f"device_mesh has {device_mesh.ndim} dimensions {device_mesh.mesh_dim_names}: name the "
                         "data-parallel one with mesh_dim=")
    return device_mesh.get_group(mesh_dim if mesh_dim is not None else 0)


def _first_of_its_rank(group: Any | None, rank: int) -> bool:
    """Whether this process is the lowest global rank among those that share its data-parallel rank.

    With a data-parallel group inside a larger mesh, several processes (a tensor-parallel group)
    receive the same batches; one of them writes the audit log. A collective over the whole job.
    """
    if group is None:
        return True
    import torch.distributed as dist

    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, rank)
    return ranks.index(rank) == dist.get_rank()


class _Base(Sampler[Any]):
    _lockstep = True  # dynamic dealing: a checkpoint credits every rank with this rank's count
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
            join_timeout = float(os.environ.get("CROUPIER_JOIN_TIMEOUT") or 600.0)
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
        self._entered = False  # an iteration of self._epoch has begun
        self._complete = False  # self._epoch is over: iterated to its end, or cut by the trainer
        self._exhausted = False  # this rank's leases of self._epoch ran out (all its items were handed out)
        self._ended_logged = False
        self._active: object | None = None  # the iterator allowed to yield
        self._prefetcher: _Prefetcher | None = None
        self._origin: str | None = None  # the loaded checkpoint state's origin, for the audit log
        self._token_used = ""
        self._audit_dir = audit_dir or os.environ.get("CROUPIER_AUDIT_DIR") or None
        self._audit: AuditLog | None = None
        self._audit_path: tuple[str, str, str, int] | None = None  # where this rank's audit log is, once joined

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
        req = JoinRequest(self.job, self.spec, token, num_replicas, rank, self._resume, self._hint)
        try:
            r = self._client.join_started(req, timeout=self._join_timeout)
        except Aborted as e:
            raise RuntimeError(
                f"rank {rank} of job {self.job!r} belongs to an incarnation that a newer one replaced ({e}); "
                "this process is a zombie: restart it from the last checkpoint"
            ) from None
        assert r.start is not None
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
                              epoch=r.start.epoch, dealing=self.spec.dealing)
            if self._cut_on_join is not None:
                self._audit.write(t="cut", epoch=self._cut_on_join[0], items=self._cut_on_join[1])
        if self._hint is not None and self._hint == r.start.epoch - 1:
            self._epoch = self._hint  # that epoch is complete: its iteration yields nothing
            self._complete = True
        self._yielded = 0

    def _plan(self, epoch: int) -> EpochPlan | None:
        world = self._resolve_world()[0]
        if self._start is None:  # before the join: what the generation will start from
            start = bind(self.spec, self._resume or fresh(self.spec, self._hint or 0), world)
            return plan_epoch(self.spec, start, world, epoch)
        return plan_epoch(self.spec, self._start, world, epoch)

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
        if self._complete:
            return True
        if not self._entered:
            return False
        if self._exhausted:
            return True
        rest = self._known_rest(self._epoch)
        return rest is not None and self._taken() >= rest

    def _log_end(self) -> None:
        if self._audit is not None and not self._ended_logged:
            self._audit.write(t="end", epoch=self._epoch)
        self._ended_logged = True

    def _next_epoch(self) -> None:
        if not self._complete:
            self._log_end()
        self._epoch += 1
        self._before = self._yielded = 0
        self._chunk = None
        self._entered = self._complete = self._ended_logged = self._exhausted = False

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
                self._complete = True
            self._stop_iteration()
            self._next_epoch()
            return
        raise ValueError(
            f"set_epoch({epoch}) contradicts the job's progress: this sampler is at epoch {self._epoch} "
            f"({'finished' if finished else f'{self.items_done} items in'}); the next epoch is {nxt}"
        )

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
        if self._entered and self._finished():  # the last iteration finished its epoch: this one goes on to the next
            self._next_epoch()
        # A new iterator goes on from the last item yielded.
        self._stop_iteration()
        self._active = it
        self._entered = True
        p = self._plan(self._epoch)
        if p is None:  # the epoch just before a fresh start: the checkpoint finished it
            return
        known = self._known_rest(self._epoch)
        if self._exhausted or known is not None and self._taken() >= known:  # nothing (left) for this rank
            self._log_end()
            return
        assert self._client is not None
        # A whole number of batches: the index sampler's unit is 1 with batch_size 1, the batch
        # sampler's unit is its batch_size.
        first_batch = self._yielded * self._unit // self.spec.batch_size
        pf = _Prefetcher(self._client, self.job, self._generation, self.rank, self._epoch, first_batch,
                         self._lease_ahead, self._prefetch, p)
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
                    self._exhausted = True
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

    # ---------------------------------------------------------------- state

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
        if step is not None:
            check_int("step", step, 0, None, ValueError)
        if self._empty:
            return {}
        if self._start is None:
            state = to_state(self.job, self.spec, self._resume or fresh(self.spec, self._hint or 0))
            if self._origin:
                state["origin"] = self._origin
            return state
        # NOTE: an independent worker's (lockstep=False) state is the union of every worker's
        # commits, which only the coordinator knows: its epoch being over for this worker says
        # nothing of the others' batches in flight.
        deals = self._kind.coordinator_deals
        own = deals and not self._lockstep
        if self._complete or consumed is None and self._finished() and not own:  # the epoch is over
            taken = self._taken() if deals else self._rest(self._epoch)
            return self._stamp(fresh(self.spec, self._epoch + 1), self._epoch + 1, 0, step,
                               (self._epoch, taken * self._unit // self.spec.batch_size))
        if deals:
            return self._dealt_state(consumed, step)
        items = self.items_done if consumed is None else check_int("consumed", consumed, 0, None, ValueError)
        before = self._items_before(self._epoch)
        if items < before:
            raise ValueError(f"consumed={items} items is before this generation's resume point in epoch {self._epoch} "
                             f"({before} items were taken before the checkpoint it resumed from)")
        p = self._plan(self._epoch)
        if p is None:
            return self._stamp(self._start, self._start.epoch, 0, step, None)
        positions = (items - before) * self._unit
        if positions % self.spec.batch_size:
            raise ValueError(f"consumed={items} items is not a whole number of lease batches of {self.spec.batch_size}")
        progress = (self._epoch, positions // self.spec.batch_size)
        cursor = p.advance(positions // self.spec.batch_size)
        if cursor.epoch != self._epoch:  # the epoch is complete
            return self._stamp(cursor, cursor.epoch, 0, step, progress)
        return self._stamp(cursor, self._epoch, items, step, progress)

    def _stamp(self, cursor: Cursor, epoch: int, items: int, step: int | None,
               progress: tuple[int, int] | None) -> dict[str, Any]:
        """The state of `cursor`, named after where this incarnation made it; logs it for the
        audit and records it at the coordinator (with how far the loop got, `progress`)."""
        state = to_state(self.job, self.spec, cursor)
        state["origin"] = f"{self._token_used}/{epoch}/{items}"
        if self._audit is not None:
            self._audit.ckpt(state["origin"], epoch, items)
        if self._client is not None and not self._client.closed:
            try:
                self._client.report(self.job, self._generation, self.rank, progress or (self._epoch, 0),
                                    (step, cursor, state["origin"]), timeout=_REPORT_TIMEOUT_S)
            except (CroupierError, Unreachable) as e:
                log.warning("croupier: rank %d of job %r could not record its checkpoint%s at the coordinator (%s); "
                            "the state dict alone resumes it", self.rank, self.job,
                            "" if step is None else f" of step {step}", e)
        return state

    def _dealt_state(self, consumed: int | None, step: int | None) -> dict[str, Any]:
        """Dynamic dealing's checkpoint state: the coordinator computes it from what it dealt.

        NOTE: only the coordinator knows which batches the other ranks were dealt, so this call
        needs it (a static job's state is computed here). Lockstep (the default): every rank is
        credited with as many batches as this rank's loop took, capped by what it was dealt; so
        take it on a rank still iterating the epoch (all of those give the same state), or, on a
        rank that ran out while the others step on (DDP's ``Join``), pass ``consumed=`` the
        loop's step in the epoch. ``lockstep=False``: this rank's own progress and the other
        ranks' last commits.
        """
        items = self.items_done if consumed is None else check_int("consumed", consumed, 0, None, ValueError)
        positions = items * self._unit
        if positions % self.spec.batch_size:
            raise ValueError(f"consumed={items} items is not a whole number of batches of {self.spec.batch_size}")
        assert self._client is not None
        origin = f"{self._token_used}/{self._epoch}/{items}"
        try:
            # NOTE: no timeout: like a join, this waits (retrying) for a coordinator that restarts
            cursor = self._client.report(self.job, self._generation, self.rank,
                                         (self._epoch, positions // self.spec.batch_size), (step, None, origin),
                                         own=not self._lockstep)
        except Unreachable as e:
            raise RuntimeError(
                f"rank {self.rank} of job {self.job!r} deals dynamically: its checkpoint state is computed by the "
                f"coordinator, which did not answer in time ({e}); try again once it is back"
            ) from None
        assert cursor is not None
        state = to_state(self.job, self.spec, cursor)
        state["origin"] = origin if cursor.epoch == self._epoch else f"{self._token_used}/{cursor.epoch}/0"
        if self._audit is not None:
            self._audit.ckpt(state["origin"], self._epoch, items)
        return state

    def commit(self, consumed: int | None = None) -> dict[str, Any]:
        """Dynamic dealing with independent workers: records this rank's progress as done and returns
        the job's state (``state_dict()`` with ``lockstep=False``; the same call for lockstep ranks)."""
        return self.state_dict(consumed)

    def resume_latest(self) -> bool:
        """Resumes from the latest checkpoint the job recorded at the coordinator, if any.

        For workers that keep no state of their own (dynamic dealing's ``lockstep=False``: the
        latest record is the union of every rank's commits). Call it on every rank of the new
        launch, before the first batch, once the previous launch's processes are gone (a record
        made between two ranks' calls would make them disagree, and the join refuses that).

        Returns:
            True when a record was loaded; False when the job has none (it starts from the beginning).
        """
        if self._start is not None:
            raise RuntimeError("resume_latest must come before the first batch")
        if self._empty:
            return False
        num_replicas, _ = self._resolve_world()
        self._agreed = agree(self._token, self._address, self.job, num_replicas)
        with CoordinatorClient(self._agreed[1], security=self._with_secret(self._agreed[2])) as c:
            try:
                spec, record = c.checkpoint(self.job, None)
            except NotFound:
                return False
        state = to_state(self.job, spec, record.cursor)
        if record.origin:
            state["origin"] = record.origin
        self.load_state_dict(state)
        return True

    def _with_secret(self, secret: str | None) -> Security:
        """This sampler's TLS and credential settings; the embedded coordinator's secret as the credential."""
        base = self._security if self._security is not None else Security.from_env()
        return dataclasses.replace(base, credential=secret) if secret else base

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
        check_int("step", step, 0, None, ValueError)
        if self._start is not None:
            raise RuntimeError(
                "resume_from_step must come before the first batch: this sampler already serves generation "
                f"{self._generation} of job {self.job!r}; make a new sampler in the restarted process"
            )
        if self._empty:
            return
        num_replicas, _ = self._resolve_world()
        self._agreed = agree(self._token, self._address, self.job, num_replicas)
        with CoordinatorClient(self._agreed[1], security=self._with_secret(self._agreed[2])) as c:
            try:
                spec, record = c.checkpoint(self.job, step)
            except NotFound as e:
                raise LookupError(
                    f"{e}. A relaunch finds its job's records under the same job name: pass job= or set CROUPIER_JOB "
                    f"(this sampler's job is {self.job!r})"
                ) from None
        state = to_state(self.job, spec, record.cursor)
        if record.origin:
            state["origin"] = record.origin
        self.load_state_dict(state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resumes from a checkpoint state (any world size); an empty dict means "from the start".

        A sampler whose job was not named (no ``job=``, no ``CROUPIER_JOB``) takes the job named
        in the state: resuming a checkpoint continues its job, whatever the new launch is called.

        Raises:
            ValueError: the state is malformed, or from another job or spec (both are shown).
            RuntimeError: this sampler has already started serving a generation.
        """
        if self._start is not None:
            raise RuntimeError(
                "load_state_dict must come before the first batch: this sampler already serves generation "
                f"{self._generation} of job {self.job!r}; make a new sampler in the restarted process"
            )
        if self._empty:
            if state_dict:
                raise ValueError(f"this sampler's dataset is empty (N = 0), so it has no state to load (got {state_dict!r})")
            return
        job = self.job
        if not self._job_named and isinstance(state_dict, Mapping) and isinstance(state_dict.get("job"), str):
            job = state_dict["job"]
        resume = from_state(job, self.spec, state_dict)
        if resume is not None and self._hint is not None and not epoch_agrees(self.spec, resume, self._hint):
            raise ValueError(
                f"set_epoch({self._hint}) was called before load_state_dict, but the checkpoint state resumes "
                f"{show(resume)}: call set_epoch with the checkpoint's epoch, or after load_state_dict"
            )
        self.job = job
        self._resume = resume
        self._origin = state_dict.get("origin") if resume is not None else None
        self._resume_items = _items_of(self._origin, resume)
        self._cut_on_join = None

    def close(self) -> None:
        """Stops background leasing and closes the connection."""
        if self._start is not None and self._finished() and not self._complete:
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
        d.update(_yielded=self._taken(), _chunk=None, _chunk_len=0, _client=None, _prefetcher=None, _active=None,
                 _audit=None, _group=None)
        return d

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _items_of(origin: Any, resume: Cursor | None) -> int | None:
    """The items the checkpointing rank had taken in the resumed epoch, from the state's origin."""
    if resume is None or not isinstance(origin, str):
        return None
    parts = origin.rsplit("/", 2)
    try:
        epoch, items = int(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        return None
    return items if epoch == resume.epoch and items >= 0 else None


def _make_spec(n: int, shuffle: bool, seed: int, tail: str, permutation: str | None, partition: str, batch_size: int,
               drop_last_batch: bool, even_batches: bool, scope: str, buffer_size: int | None, pack_size: int | None,
               lengths: Sequence[int] | np.ndarray | None, max_tokens: int | None = None, cost: str = "sum",
               token_window: int = TOKEN_WINDOW, dealing: str = "static") -> Spec:
    if permutation is None:
        permutation = kind_for(dealing, max_tokens).permutation(shuffle, lengths is not None)
    elif not shuffle and permutation != "none":
        raise ValueError(f"shuffle=False contradicts permutation={permutation!r}; leave permutation unset or use 'none'")
    kw: dict[str, Any] = dict(seed=seed, permutation=permutation, partition=partition, tail=tail, scope=scope,
                              buffer_size=buffer_size, pack_size=pack_size, batch_size=batch_size,
                              drop_last_batch=drop_last_batch, even_batches=even_batches, max_tokens=max_tokens,
                              cost=cost, token_window=token_window, dealing=dealing)
    if lengths is not None:
        arr = np.asarray(lengths)
        if arr.size != n:
            raise ValueError(f"lengths has {arr.size} entries but the dataset has {n} samples")
        if n == 0:
            return Spec(n=1, **{**kw, "max_tokens": None})
        return Spec.with_lengths(arr, **kw)
    if max_tokens is not None:
        raise ValueError(f"max_tokens={max_tokens} needs lengths= (each sample's token count)")
    # NOTE: an empty dataset (N = 0) has nothing to deal: its sampler never joins, and the spec
    # of one sample only checks the other settings.
    return Spec(n=max(n, 1), **kw)


class DistributedSampler(_Base, _TorchDistributedSampler[int]):
    """A drop-in for ``torch.utils.data.distributed.DistributedSampler`` that survives preemption and resizing.

    It is an instance of torch's ``DistributedSampler`` (frameworks that test ``isinstance`` leave
    its sharding alone) with torch's attributes and meanings: ``dataset``, ``num_replicas``,
    ``rank``, ``shuffle``, ``seed``, ``drop_last``, ``epoch`` (settable, as ``set_epoch``),
    ``num_samples`` (this rank's share of the epoch, as ``len()``) and ``total_size``
    (``num_samples * num_replicas``).

    Change one import line; then ``state_dict()`` / ``load_state_dict()`` resume at any step with
    any new world size, with no index trained twice or skipped, and epochs advance without
    ``set_epoch`` (calling it as torch's loop does is still fine).

    Args:
        dataset: Any sized object, or an int N.
        num_replicas: World size; default from torch.distributed, else WORLD_SIZE, else 1.
        rank: This rank; default from torch.distributed, else RANK, else 0.
        shuffle: Shuffle every epoch (a different order each epoch).
        seed: Shuffle seed, the same on every rank.
        drop_last: As torch: drop the tail so every rank gets the same count (True), or pad by
            repeating from the start of the order (False).
        address: HOST:PORT of a coordinator; default CROUPIER_ADDRESS, else an embedded one.
        job: The job's name. Default: ``CROUPIER_JOB``; else a name made of the launcher's run
            (``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``, else ``local``) and the spec's fingerprint,
            with ``.2``, ``.3``, ... for further samplers of the same spec in one process, so
            that train, val and test samplers, and successive experiments, never collide. A
            sampler whose job was not named takes the job of the state it loads.
        permutation: ``"torch"`` for torch's exact order (``randperm`` per epoch), ``"feistel"``
            (default when shuffling: O(1) memory, instant start at any size), ``"window"``,
            ``"bucket"`` (with ``lengths``), ``"none"``.
        partition: ``"strided"`` (torch), ``"chunked"`` (d9d) or ``"contiguous"`` (DGL).
        tail: Overrides ``drop_last``: ``"pad"``, ``"drop"``, ``"uneven"`` or ``"pad_last"``.
        token: Names this incarnation of the job's world (default: from torchrun / torch.distributed).
        lease_ahead: Indices leased per call to the coordinator.
        prefetch: Leases kept ready ahead of use.
        audit_dir: Write an audit log of what this rank receives under this directory, for
            ``croupier audit`` (default CROUPIER_AUDIT_DIR; off when neither is set).
        process_group: The data-parallel group, when the job is larger than its data-parallel
            world (tensor or pipeline parallelism): `num_replicas` and `rank` come from it, and
            every process of one data-parallel rank receives the same batches.
        device_mesh: Instead of `process_group`, a ``DeviceMesh`` and its data-parallel
            dimension `mesh_dim` (a name or an index).
        join_timeout: Seconds the first batch waits for the other ranks of its generation before
            raising ``TimeoutError`` naming them (default ``CROUPIER_JOIN_TIMEOUT``, else 600);
            while waiting, the ranks still missing are logged every 30 s.
        security: TLS and credential settings to reach the coordinator (:class:`Security`;
            default from ``CROUPIER_TLS_*`` and ``CROUPIER_CREDENTIAL``). A copy of the sampler
            (pickle, a DataLoader worker) carries them, secret included.

    ``dataset`` may be empty (N = 0): the sampler yields nothing, needs no coordinator, and its
    state is ``{}``. ``num_replicas`` and ``rank`` are resolved when first needed (``len()``, the
    first batch), so the sampler may be built before ``init_process_group``; a launcher that names
    a world of several processes but not this one's rank is an error, never a silent rank 0.
    """

    _unit = 1
    _per_batch = False

    def __init__(self, dataset: Sized | int, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, *, address: str | None = None,
                 job: str | None = None, permutation: str | None = None, partition: str = "strided",
                 tail: str | None = None, scope: str = "global", buffer_size: int | None = None,
                 pack_size: int | None = None, lengths: Sequence[int] | np.ndarray | None = None,
                 token: str | None = None, lease_ahead: int | None = None, prefetch: int = 2,
                 audit_dir: str | None = None, process_group: Any | None = None, device_mesh: Any | None = None,
                 mesh_dim: str | int | None = None, join_timeout: float | None = None,
                 security: Security | None = None, dealing: str = "static", lockstep: bool = True) -> None:
        n = _dataset_size(dataset)
        if tail is None:
            tail = kind_for(dealing).tail(drop_last, batches=False)
        spec = _make_spec(n, shuffle, seed, tail, permutation, partition, 1,
                          False, False, scope, buffer_size, pack_size, lengths, dealing=dealing)
        if lease_ahead is None:
            lease_ahead = kind_for(dealing).lease_indices
        self._lockstep = bool(lockstep)
        super().__init__(spec, n == 0, num_replicas, rank, address, job, token, lease_ahead, prefetch, audit_dir,
                         process_group, device_mesh, mesh_dim, join_timeout, security)
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.dataset = dataset  # type: ignore[assignment]  # torch's attribute; an int N is allowed here

    @property  # torch's attribute, computed here (it changes with a resume)
    def num_samples(self) -> int:  # type: ignore[override]
        """This rank's share of the current epoch (torch's meaning): what ``len()`` says."""
        return len(self)

    @property  # torch's attribute, computed here
    def total_size(self) -> int:  # type: ignore[override]
        """``num_samples * num_replicas``, as torch's ``DistributedSampler`` defines it."""
        return len(self) * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        # Chained in C: taking an index costs what taking one from torch's list does; Python runs
        # once per lease, and `_taken()` reads the position inside the lease from its iterator.
        return itertools.chain.from_iterable(self._leases(object()))

    def _leases(self, me: object) -> Iterator[Iterator[int]]:
        for lease in self._items(me):
            self._log_lease(lease)
            # NOTE: iterating an array makes each Python int as it is taken, in C: no list of the
            # lease's 65,536 ints is built at once, or freed at once (a few % of a trivial loop).
            items = array.array("q")
            items.frombytes(np.ascontiguousarray(lease.indices, dtype=np.int64).data.cast("B"))
            it = iter(items)
            self._chunk, self._chunk_len = it, len(items)
            yield it
            if self._active is me:  # the lease is used up (or the loop let go of this iterator)
                self._yielded += _position(it, len(items))
                self._chunk = None


def _position(it: Iterator[int], size: int) -> int:
    """How many items the iterator of an ``array.array`` of `size` items has handed out."""
    state = it.__reduce__()  # (iter, (array,), position), or (iter, ((),)) once exhausted
    return int(state[2]) if len(state) > 2 else size


class _IndexView(Sampler[int]):
    """A batch sampler's ``sampler`` attribute (torch's ``BatchSampler`` has one): this rank's
    indices of the current epoch, as a count. Iterate the batch sampler itself."""

    def __init__(self, owner: DistributedBatchSampler) -> None:
        self._owner = owner

    def __len__(self) -> int:
        o = self._owner
        return 0 if o._empty else o._indices_in(o.epoch)

    def __iter__(self) -> Iterator[int]:
        raise TypeError("a DistributedBatchSampler deals whole batches: iterate it, not its .sampler")

    def set_epoch(self, epoch: int) -> None:
        self._owner.set_epoch(epoch)


class DistributedBatchSampler(_Base, BatchSampler):
    """The same as :class:`DistributedSampler`, yielding lists of indices, for ``batch_sampler=``.

    An instance of torch's ``BatchSampler`` with its attributes ``batch_size``, ``drop_last`` and
    ``sampler`` (a view of this rank's indices: its ``len()`` counts them).

    Args:
        dataset: Any sized object, or an int N.
        batch_size: Indices per batch of this rank.
        drop_last: Drop this rank's last batch of an epoch when it is incomplete (torch's
            ``BatchSampler`` and DGL's meaning). The epoch's tail across ranks is ``tail``.
        tail: ``"pad"`` (default, as torch's DistributedSampler), ``"drop"``, ``"uneven"``, ``"pad_last"``.
        even_batches: Every rank gets the same number of batches (DGL ``drop_uneven_inputs``).
        Other arguments: as :class:`DistributedSampler`; ``lengths`` with ``permutation="bucket"``,
            ``buffer_size`` and ``pack_size`` gives d9d's length bucketing.
    """

    _unit: int
    _per_batch = True

    def __init__(self, dataset: Sized | int, batch_size: int | None = None, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0, drop_last: bool = False, *,
                 address: str | None = None, job: str | None = None, permutation: str | None = None,
                 partition: str = "strided", tail: str | None = None, even_batches: bool = False,
                 scope: str = "global", buffer_size: int | None = None, pack_size: int | None = None,
                 lengths: Sequence[int] | np.ndarray | None = None, token: str | None = None,
                 lease_ahead: int | None = None, prefetch: int = 2, audit_dir: str | None = None,
                 process_group: Any | None = None, device_mesh: Any | None = None,
                 mesh_dim: str | int | None = None, join_timeout: float | None = None,
                 security: Security | None = None, max_tokens: int | None = None, cost: str = "sum",
                 token_window: int = TOKEN_WINDOW, dealing: str = "static", lockstep: bool = True) -> None:
        n = _dataset_size(dataset)
        if batch_size is None and max_tokens is None:
            raise TypeError("DistributedBatchSampler needs batch_size=, or lengths= with max_tokens= for token-budget "
                            "batches")
        if batch_size is not None and max_tokens is not None:
            raise ValueError(f"batch_size={batch_size} and max_tokens={max_tokens}: token-budget batches size "
                             "themselves; leave batch_size unset")
        if tail is None:
            tail = kind_for(dealing, max_tokens).tail(drop_last, batches=True)
        spec = _make_spec(n, shuffle, seed, tail, permutation, partition, batch_size or 1, drop_last, even_batches,
                          scope, buffer_size, pack_size, lengths, max_tokens, cost, token_window, dealing)
        if lease_ahead is None:
            lease_ahead = kind_for(dealing, max_tokens).lease_batches
        self._lockstep = bool(lockstep)
        self._unit = batch_size or 1
        super().__init__(spec, n == 0, num_replicas, rank, address, job, token, lease_ahead, prefetch, audit_dir,
                         process_group, device_mesh, mesh_dim, join_timeout, security)
        # torch's attributes; batch_size is None for token-budget batches, whose sizes vary
        self.batch_size = batch_size  # type: ignore[assignment]
        self.drop_last = drop_last
        self.sampler = _IndexView(self)

    def __iter__(self) -> Iterator[list[int]]:
        return self._batches(object())

    def _batches(self, me: object) -> Iterator[list[int]]:
        # NOTE: a lease's indices become Python ints in one call, and each batch is a slice of
        # that list: per batch, a slice and a count, where slicing a numpy batch and converting
        # it costs several times more.
        for lease in self._items(me):
            items = lease.indices.tolist()
            sizes = lease.sizes
            # This rank's last batch of the epoch, if it is in this lease: its end is logged as
            # it is handed out. (Token-budget batches know it only once their plan got there.)
            known = self._known_rest(self._epoch)
            last = -1 if known is None else known - 1 - self._yielded
            o = 0
            for j, size in enumerate(sizes):
                b = items[o:o + size]
                o += size
                if self._audit is not None:
                    self._audit.batch(self._epoch, self._before + self._yielded, lease.indices[o - size:o])
                if j >= last if known is not None else self._ends_here():
                    self._log_end()
                self._yielded += 1
                yield b
                if self._active is not me:
                    return

    def _ends_here(self) -> bool:
        """Whether the batch about to be handed out is this rank's last of the epoch (when that is known yet)."""
        known = self._known_rest(self._epoch)
        return known is not None and self._yielded + 1 >= known

    def _indices_in(self, epoch: int) -> int:
        p = self._plan(epoch)
        return 0 if p is None else p.samples(self.rank) + self._items_before(epoch) * self.batch_size


def shards(dataset: Sized | int, num_replicas: int, *, epoch: int | None = None, state: Mapping[str, Any] | None = None,
           batch_size: int | None = None, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
           permutation: str | None = None, partition: str = "strided", tail: str | None = None,
           even_batches: bool = False, scope: str = "global", buffer_size: int | None = None,
           pack_size: int | None = None, lengths: Sequence[int] | np.ndarray | None = None) -> list[list[Any]]:
    """Every rank's share of one epoch, computed in this process with no coordinator and no world.

    For unit tests and notebooks: ``shards(ds, 4)[r]`` is what ``DistributedSampler(ds,
    num_replicas=4, rank=r)`` yields in that epoch (with the same settings), and with
    ``batch_size`` what ``DistributedBatchSampler(ds, batch_size, num_replicas=4, rank=r)`` yields.
    Building every rank's sampler in one process instead would wait in the join for ranks that
    only come later.

    Args:
        epoch: The epoch (default: the state's, else 0).
        state: A checkpoint state: the rest of its epoch, dealt to `num_replicas` ranks.
        batch_size: None for the index sampler's shares (lists of indices); else the batch
            sampler's (lists of batches), with its meaning of ``drop_last`` and ``tail``.
        Other arguments: as the samplers'.

    Raises:
        ValueError: a setting is out of range, or `epoch` contradicts `state`.
    """
    check_int("num_replicas", num_replicas, 1, MAX_WORLD + 1, ValueError)
    n = _dataset_size(dataset)
    if batch_size is None:
        spec = _make_spec(n, shuffle, seed, tail or ("drop" if drop_last else "pad"), permutation, partition, 1,
                          False, False, scope, buffer_size, pack_size, lengths)
    else:
        spec = _make_spec(n, shuffle, seed, tail or "pad", permutation, partition, batch_size, drop_last, even_batches,
                          scope, buffer_size, pack_size, lengths)
    if n == 0:
        return [[] for _ in range(num_replicas)]
    cursor = from_state(str(state.get("job")) if isinstance(state, Mapping) else "", spec, state) if state else None
    if cursor is None:
        cursor = fresh(spec, epoch or 0)
    elif epoch is not None and epoch != cursor.epoch:
        if not epoch_agrees(spec, cursor, epoch):
            raise ValueError(f"epoch={epoch} contradicts the state, which resumes {show(cursor)}")
    e = cursor.epoch if epoch is None else epoch
    p = plan_epoch(spec, bind(spec, cursor, num_replicas), num_replicas, e)
    out: list[list[Any]] = []
    for r in range(num_replicas):
        if p is None:
            out.append([])
            continue
        idx, sizes = p.lease(r, 0, p.steps(r))
        if batch_size is None:
            out.append(idx.tolist())
        else:
            out.append([b.tolist() for b in np.split(idx, np.cumsum(sizes)[:-1])] if sizes else [])
    return out
