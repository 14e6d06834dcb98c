"""`DistributedSampler` and `DistributedBatchSampler`: drop-ins for torch's, fed by a croupier coordinator."""

from __future__ import annotations

import operator
import os
import queue
import threading
from collections.abc import Iterator, Sequence, Sized
from typing import Any

import numpy as np
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler as _TorchDistributedSampler

from croupier.client._audit_log import AuditLog
from croupier.client._resolve import agree, resolve_job, resolve_world, track
from croupier.client._rpc import CoordinatorClient, LeaseReply
from croupier.core.api import MAX_COUNT, MAX_LEASE_BATCHES, MAX_LEASE_INDICES, JoinRequest
from croupier.core.checkpoint import from_state, to_state
from croupier.core.checks import check_int
from croupier.core.errors import Aborted, NotFound
from croupier.core.order import Cursor, Plan, bind, epoch_agrees, fresh, plan_epoch, show
from croupier.core.spec import Spec

_DONE = object()


def _dataset_size(dataset: Sized | int) -> int:
    if isinstance(dataset, bool):
        raise TypeError(f"dataset must be a sized object or an int (got {dataset!r})")
    if isinstance(dataset, (int, np.integer)):
        return int(dataset)
    if not isinstance(dataset, Sized):
        raise TypeError(f"dataset must be a sized object or an int N (got {type(dataset).__name__}, which has no len())")
    return len(dataset)


class _Prefetcher:
    """Leases batches of one rank in one epoch ahead of use, in a background thread, at most `depth` leases ahead."""

    def __init__(self, client: CoordinatorClient, job: str, generation: int, rank: int, epoch: int, first: int,
                 lease_size: int, depth: int) -> None:
        self._q: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._args = (client, job, generation, rank, epoch)
        self._next = first
        self._lease_size = lease_size
        self._thread = threading.Thread(target=self._run, name=f"croupier-lease-r{rank}-e{epoch}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        client, job, gen, rank, epoch = self._args
        try:
            while not self._stop.is_set():
                lease = client.lease(job, gen, rank, epoch, self._next, self._lease_size)
                self._next += len(lease.sizes)
                self._put(lease)
                if lease.end_of_epoch:
                    break
        except BaseException as e:  # handed to the consumer, which raises it
            self._put(e)
        self._put(_DONE)

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
    """What both samplers share: spec, resolution, join, epochs, leases and the checkpoint state."""

    _unit: int  # positions per item this sampler yields: 1 for indices, batch_size for batches
    _per_batch: bool  # yields batches (lists) rather than indices

    def __init__(self, spec: Spec, num_replicas: int | None, rank: int | None, address: str | None, job: str | None,
                 token: str | None, lease_ahead: int, prefetch: int, audit_dir: str | None,
                 process_group: Any | None = None, device_mesh: Any | None = None,
                 mesh_dim: str | int | None = None) -> None:
        self.spec = spec
        self._group = _data_parallel_group(process_group, device_mesh, mesh_dim)
        self.num_replicas, self.rank = resolve_world(num_replicas, rank, self._group)
        self.job = resolve_job(job)
        self._address = address
        self._token = token
        if lease_ahead < 1 or prefetch < 1:
            raise ValueError(f"lease_ahead and prefetch must be >= 1 (got lease_ahead={lease_ahead}, prefetch={prefetch})")
        if lease_ahead > MAX_LEASE_BATCHES or lease_ahead * spec.batch_size > MAX_LEASE_INDICES:
            raise ValueError(
                f"lease_ahead={lease_ahead} batches of {spec.batch_size} is more than one lease serves "
                f"(at most {MAX_LEASE_BATCHES} batches and {MAX_LEASE_INDICES} indices)"
            )
        self._lease_ahead = lease_ahead
        self._prefetch = prefetch
        self._client: CoordinatorClient | None = None
        self._resume: Cursor | None = None  # from load_state_dict
        self._hint: int | None = None  # from set_epoch before the first batch
        self._generation = 0
        self._start: Cursor | None = None  # the generation's resume point, once joined
        self._epoch = 0  # the epoch being (or last) iterated
        self._yielded = 0  # items of self._epoch yielded, up to the start of the chunk in hand
        self._chunk: Iterator[int] | None = None  # the index sampler's chunk being yielded
        self._chunk_len = 0
        self._complete = False  # self._epoch has been iterated to its end
        self._active: object | None = None  # the iterator allowed to yield
        self._prefetcher: _Prefetcher | None = None
        self._origin: str | None = None  # the loaded checkpoint state's origin, for the audit log
        self._token_used = ""
        self._audit_dir = audit_dir or os.environ.get("CROUPIER_AUDIT_DIR") or None
        self._audit: AuditLog | None = None

    # ---------------------------------------------------------------- joining

    def _join(self) -> None:
        if self._start is not None:
            return
        token, address = agree(self._token, self._address, self.job, self.num_replicas)
        self._client = CoordinatorClient(address)
        track(self)
        req = JoinRequest(self.job, self.spec, token, self.num_replicas, self.rank, self._resume, self._hint)
        try:
            r = self._client.join_started(req)
        except Aborted as e:
            raise RuntimeError(
                f"rank {self.rank} of job {self.job!r} belongs to an incarnation that a newer one replaced ({e}); "
                "this process is a zombie: restart it from the last checkpoint"
            ) from None
        assert r.start is not None
        self._generation, self._start = r.generation, r.start
        self._token_used = token
        self._epoch = r.start.epoch
        if self._audit_dir and _first_of_its_rank(self._group, self.rank):
            self._audit = AuditLog(self._audit_dir, self.job, token, self.rank)
            self._audit.start(job=self.job, token=token, generation=r.generation, world=self.num_replicas,
                              rank=self.rank, n=self.spec.n, tail=self.spec.tail, partition=self.spec.partition,
                              unit=self._unit, origin=self._origin, epoch=r.start.epoch)
        if self._hint is not None and self._hint == r.start.epoch - 1:
            self._epoch = self._hint  # that epoch is complete: its iteration yields nothing
        self._yielded = 0
        self._complete = False

    def _plan(self, epoch: int) -> Plan | None:
        if self._start is None:  # before the join: what the generation will start from
            start = bind(self.spec, self._resume or fresh(self.spec, self._hint or 0), self.num_replicas)
            return plan_epoch(self.spec, start, self.num_replicas, epoch)
        return plan_epoch(self.spec, self._start, self.num_replicas, epoch)

    # ---------------------------------------------------------------- epochs

    def set_epoch(self, epoch: int) -> None:
        """Accepted for drop-in compatibility; epochs advance by themselves.

        Raises:
            ValueError: `epoch` contradicts the job's progress (the checkpoint loaded, or the
                epochs this sampler has already been through).
        """
        check_int("epoch", epoch, 0, MAX_COUNT, ValueError)
        if self._start is None:
            if self._resume is not None and not epoch_agrees(self.spec, self._resume, epoch):
                raise ValueError(
                    f"set_epoch({epoch}) contradicts the checkpoint state loaded, which resumes epoch "
                    f"{self._resume.epoch} with {self._resume.left} of {self.spec.n} positions left"
                )
            self._hint = epoch
            return
        nxt = self._epoch + 1 if self._complete else self._epoch
        if epoch == nxt or (epoch == self._epoch and self._complete):
            return
        raise ValueError(
            f"set_epoch({epoch}) contradicts the job's progress: this sampler is at epoch {self._epoch} "
            f"({'finished' if self._complete else f'{self.items_done} items in'}); the next epoch is {nxt}"
        )

    @property
    def items_done(self) -> int:
        """Items (indices, or batches for the batch sampler) of the current epoch yielded so far."""
        if self._chunk is None:
            return self._yielded
        # NOTE: the index sampler hands out a chunk through a list iterator, at C speed; how far
        # it got is what the iterator has left, read only when someone asks.
        return self._yielded + self._chunk_len - operator.length_hint(self._chunk)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration goes through."""
        if self._complete:
            return self._epoch + 1
        if self._start is not None:
            return self._epoch
        if self._resume is None:
            return self._hint or 0
        if self._hint is not None and epoch_agrees(self.spec, self._resume, self._hint):
            return self._hint  # the epoch the checkpoint finished: its iteration yields nothing
        return self._resume.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        # torch's loops and frameworks sometimes assign sampler.epoch: the same as set_epoch.
        self.set_epoch(value)

    # ---------------------------------------------------------------- iteration

    def _items(self, it: object) -> Iterator[np.ndarray]:
        """Batches of positions' indices for the active iterator `it`; counts them as yielded."""
        self._join()
        if self._complete:
            self._epoch += 1
            self._yielded = 0
            self._complete = False
        self._yielded, self._chunk = self.items_done, None  # a new iterator goes on from the last item yielded
        self._active = it
        if self._prefetcher is not None:
            self._prefetcher.close()
        p = self._plan(self._epoch)
        if p is None:  # an epoch the checkpoint had already finished
            self._complete = True
            return
        assert self._client is not None
        # A whole number of batches: the index sampler's unit is 1 with batch_size 1, the batch
        # sampler's unit is its batch_size.
        first_batch = self._yielded * self._unit // self.spec.batch_size
        pf = _Prefetcher(self._client, self.job, self._generation, self.rank, self._epoch, first_batch,
                         self._lease_ahead, self._prefetch)
        self._prefetcher = pf
        try:
            while True:
                try:
                    lease = pf.get()
                except (Aborted, NotFound) as e:
                    raise RuntimeError(
                        f"rank {self.rank} of job {self.job!r} was fenced off: a newer generation of the job "
                        f"replaced generation {self._generation} ({e}). Restart this process from the last checkpoint."
                    ) from None
                if lease is None:
                    break
                # The index sampler takes a whole lease at once; the batch sampler one batch at a time.
                for b in (lease.batches if self._per_batch else [lease.indices]):
                    if self._audit is not None:
                        self._audit.batch(self._epoch, self._yielded, b)
                    yield b
                    if self._active is not it:
                        return
            self._complete = True
            if self._audit is not None:
                self._audit.write(t="end", epoch=self._epoch)
        finally:
            pf.close()

    # ---------------------------------------------------------------- state

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The checkpoint state: a small, topology-free dict naming where the job is in its data.

        Save it with the model; loading it into a sampler of any world size resumes there.

        Args:
            consumed: With a plain ``DataLoader`` and ``num_workers > 0``, which reads the sampler
                ahead, pass how many items (indices, or batches for the batch sampler) this rank's
                loop has taken in the current epoch. ``StatefulDataLoader`` and ``num_workers=0``
                need nothing: the sampler has yielded exactly what the loop took.
        """
        if self._start is None:
            state = to_state(self.job, self.spec, self._resume or fresh(self.spec, self._hint or 0))
            if self._origin:
                state["origin"] = self._origin
            return state
        if self._complete and consumed is None:
            return self._stamp(to_state(self.job, self.spec, fresh(self.spec, self._epoch + 1)), self._epoch + 1, 0)
        items = self.items_done if consumed is None else consumed
        check_int("consumed", items, 0, None, ValueError)
        p = self._plan(self._epoch)
        if p is None:
            return self._stamp(to_state(self.job, self.spec, self._start), self._start.epoch, 0)
        positions = items * self._unit
        if positions % self.spec.batch_size:
            raise ValueError(f"consumed={items} items is not a whole number of lease batches of {self.spec.batch_size}")
        cursor = p.advance(positions // self.spec.batch_size)
        if cursor.epoch != self._epoch:  # the epoch is complete
            return self._stamp(to_state(self.job, self.spec, cursor), cursor.epoch, 0)
        return self._stamp(to_state(self.job, self.spec, cursor), self._epoch, items)

    def _stamp(self, state: dict[str, Any], epoch: int, items: int) -> dict[str, Any]:
        """Names the state after where this incarnation made it, and logs it for the audit."""
        state["origin"] = f"{self._token_used}/{epoch}/{items}"
        if self._audit is not None:
            self._audit.ckpt(state["origin"], epoch, items)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resumes from a checkpoint state (any world size); an empty dict means "from the start".

        Raises:
            ValueError: the state is malformed, or from another job or spec (both are shown).
            RuntimeError: this sampler has already started serving a generation.
        """
        if self._start is not None:
            raise RuntimeError(
                "load_state_dict must come before the first batch: this sampler already serves generation "
                f"{self._generation} of job {self.job!r}; make a new sampler in the restarted process"
            )
        resume = from_state(self.job, self.spec, state_dict)
        if resume is not None and self._hint is not None and not epoch_agrees(self.spec, resume, self._hint):
            raise ValueError(
                f"set_epoch({self._hint}) was called before load_state_dict, but the checkpoint state resumes "
                f"{show(resume)}: call set_epoch with the checkpoint's epoch, or after load_state_dict"
            )
        self._resume = resume
        self._origin = state_dict.get("origin") if resume is not None else None

    def close(self) -> None:
        """Stops background leasing and closes the connection."""
        if self._prefetcher is not None:
            self._prefetcher.close()
        if self._client is not None:
            self._client.close()
        if self._audit is not None:
            self._audit.close()


def _make_spec(n: int, shuffle: bool, seed: int, tail: str, permutation: str | None, partition: str, batch_size: int,
               drop_last_batch: bool, even_batches: bool, scope: str, buffer_size: int | None, pack_size: int | None,
               lengths: Sequence[int] | np.ndarray | None) -> Spec:
    if permutation is None:
        permutation = ("bucket" if lengths is not None else "feistel") if shuffle else "none"
    elif not shuffle and permutation != "none":
        raise ValueError(f"shuffle=False contradicts permutation={permutation!r}; leave permutation unset or use 'none'")
    kw: dict[str, Any] = dict(seed=seed, permutation=permutation, partition=partition, tail=tail, scope=scope,
                              buffer_size=buffer_size, pack_size=pack_size, batch_size=batch_size,
                              drop_last_batch=drop_last_batch, even_batches=even_batches)
    if lengths is not None:
        arr = np.asarray(lengths)
        if arr.size != n:
            raise ValueError(f"lengths has {arr.size} entries but the dataset has {n} samples")
        return Spec.with_lengths(arr, **kw)
    return Spec(n=n, **kw)


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
        job: The job's name; default CROUPIER_JOB, else TORCHELASTIC_RUN_ID, else "default".
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
    """

    _unit = 1
    _per_batch = False

    def __init__(self, dataset: Sized | int, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, *, address: str | None = None,
                 job: str | None = None, permutation: str | None = None, partition: str = "strided",
                 tail: str | None = None, scope: str = "global", buffer_size: int | None = None,
                 pack_size: int | None = None, lengths: Sequence[int] | np.ndarray | None = None,
                 token: str | None = None, lease_ahead: int = 16384, prefetch: int = 2,
                 audit_dir: str | None = None, process_group: Any | None = None, device_mesh: Any | None = None,
                 mesh_dim: str | int | None = None) -> None:
        n = _dataset_size(dataset)
        spec = _make_spec(n, shuffle, seed, tail or ("drop" if drop_last else "pad"), permutation, partition, 1,
                          False, False, scope, buffer_size, pack_size, lengths)
        super().__init__(spec, num_replicas, rank, address, job, token, lease_ahead, prefetch, audit_dir,
                         process_group, device_mesh, mesh_dim)
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
        return self._indices(object())

    def _indices(self, me: object) -> Iterator[int]:
        for chunk in self._items(me):
            items = chunk.tolist()
            it = iter(items)
            self._chunk, self._chunk_len = it, len(items)
            yield from it
            if self._active is me:
                self._yielded += len(items)
                self._chunk = None

    def __len__(self) -> int:
        p = self._plan(self.epoch)
        return 0 if p is None else p.samples(self.rank)


class DistributedBatchSampler(_Base):
    """The same as :class:`DistributedSampler`, yielding lists of indices, for ``batch_sampler=``.

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

    def __init__(self, dataset: Sized | int, batch_size: int, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, *, address: str | None = None,
                 job: str | None = None, permutation: str | None = None, partition: str = "strided",
                 tail: str = "pad", even_batches: bool = False, scope: str = "global",
                 buffer_size: int | None = None, pack_size: int | None = None,
                 lengths: Sequence[int] | np.ndarray | None = None, token: str | None = None,
                 lease_ahead: int = 64, prefetch: int = 2, audit_dir: str | None = None,
                 process_group: Any | None = None, device_mesh: Any | None = None,
                 mesh_dim: str | int | None = None) -> None:
        n = _dataset_size(dataset)
        spec = _make_spec(n, shuffle, seed, tail, permutation, partition, batch_size, drop_last, even_batches, scope,
                          buffer_size, pack_size, lengths)
        self._unit = batch_size
        super().__init__(spec, num_replicas, rank, address, job, token, lease_ahead, prefetch, audit_dir,
                         process_group, device_mesh, mesh_dim)
        self.batch_size, self.drop_last = batch_size, drop_last

    def __iter__(self) -> Iterator[list[int]]:
        return _Batches(self)

    def __len__(self) -> int:
        p = self._plan(self.epoch)
        return 0 if p is None else int(p.nb_r[self.rank])


class _Batches(Iterator[list[int]]):
    def __init__(self, sampler: DistributedBatchSampler) -> None:
        self._sampler = sampler
        self._gen: Iterator[np.ndarray] | None = None

    def __next__(self) -> list[int]:
        s = self._sampler
        if self._gen is None:
            self._gen = s._items(self)
        b = next(self._gen).tolist()
        s._yielded += 1
        return b  # type: ignore[no-any-return]
