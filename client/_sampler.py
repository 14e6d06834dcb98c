"""`DistributedSampler` and `DistributedBatchSampler`: drop-ins for torch's, fed by a croupier coordinator."""

from __future__ import annotations

import array
import itertools
from collections.abc import Iterator, Sequence, Sized
from typing import Any

import numpy as np
from torch.utils.data import BatchSampler, Sampler
from torch.utils.data.distributed import DistributedSampler as _TorchDistributedSampler

from croupier.client._base import SamplerBase
from croupier.client._link import given_incarnation
from croupier.client._rpc import Security
from croupier.client._sample import tagged
from croupier.client._shards import check_sampler_args, dataset_size, make_spec, mixture_fields, shard_fields, step_schedule
from croupier.core.checks import check_bool
from croupier.core.registry import kind_for
from croupier.core.spec import TOKEN_WINDOW


class DistributedSampler(SamplerBase, _TorchDistributedSampler[int]):
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
            with ``.2``, ``.3``, ... for further samplers of the same spec in use together in one
            process, so that train, val and test samplers, and successive experiments, never
            collide; a sampler made once the earlier one of its spec finished its epoch (or was
            closed) goes on with that one's job, so a sampler rebuilt every epoch is one job
            (unless its incarnation is given: then each has its own; docs/samplers.md, "Job
            names"). A sampler whose job was not named takes the job of
            the state it loads.
        permutation: ``"torch"`` for torch's exact order (``randperm`` per epoch), ``"feistel"``
            (default when shuffling: O(1) memory, instant start at any size), ``"window"``,
            ``"bucket"`` (with ``lengths``), ``"none"``.
        partition: ``"strided"`` (torch), ``"chunked"`` (d9d) or ``"contiguous"`` (DGL).
        tail: Overrides ``drop_last``: ``"pad"``, ``"drop"``, ``"uneven"`` or ``"pad_last"`` (a
            ``drop_last=True`` beside another tail warns: it does nothing).
        scope: ``"global"`` (default) shuffles the whole epoch, then deals it; ``"rank"`` splits
            first and shuffles within each rank's part (DGL ``DistributedItemSampler``; needs
            ``partition="chunked"`` or ``"contiguous"``).
        buffer_size: The window of ``permutation="window"`` (shuffle within windows of this many
            positions, DGL's buffer) and ``"bucket"`` (sort each window by length); None: one
            window. Warns with any other permutation, where it does nothing.
        pack_size: ``permutation="bucket"``: cut each sorted window into packs of this many
            samples and shuffle the packs (d9d's length bucketing). Warns with another permutation.
        lengths: Each sample's length (any int sequence of N values): the sort key of
            ``permutation="bucket"``, the default permutation when lengths are given.
        incarnation: Names this incarnation of the job's world (default: ``CROUPIER_INCARNATION``, else
            from torchrun / torch.distributed); every rank of a world gives the same one, a restart a new one.
        lease_ahead: Items per lease, in the unit ``len()`` counts (indices here, batches for
            :class:`DistributedBatchSampler`): how many one call to the coordinator asks for.
            Default: 65,536 (1,024 with ``dealing="dynamic"``, so that ranks share the tail).
        prefetch: Leases kept ready ahead of use.
        audit_dir: Write an audit log of what this rank receives under this directory, for
            ``croupier audit`` (default CROUPIER_AUDIT_DIR; off when neither is set).
        process_group: The data-parallel group, when the job is larger than its data-parallel
            world (tensor or pipeline parallelism): `num_replicas` and `rank` come from it, and
            every process of one data-parallel rank receives the same batches.
        device_mesh: Instead of `process_group`, a ``DeviceMesh``, with its data-parallel dimension
            in `mesh_dim`.
        mesh_dim: The data-parallel dimension of `device_mesh` (a name or an index).
        join_timeout: Seconds the first batch waits for the other ranks of its generation before
            raising ``TimeoutError`` naming them (default ``CROUPIER_JOIN_TIMEOUT``, else 600);
            while waiting, the ranks still missing are logged every 30 s.
        security: TLS and credential settings to reach the coordinator (:class:`Security`;
            default from ``CROUPIER_TLS_*`` and ``CROUPIER_CREDENTIAL``). A copy of the sampler
            (pickle, a DataLoader worker) carries them, secret included.
        dealing: ``"static"`` (default): when a generation starts, the rest of the epoch is dealt
            to its ranks by the partition, so a rank computes its own batches and trains on
            through a coordinator outage. ``"dynamic"``: the coordinator hands the next batches
            to whichever rank asks (stragglers take fewer; the tail is ``"uneven"``); a rank
            waits for the coordinator, and its checkpoint is computed there.
        lockstep: With ``dealing="dynamic"``: True (default) for data-parallel training, whose
            ranks step together (a checkpoint credits every rank with the caller's count);
            False for independent workers (inference, preprocessing) that each ``commit()``
            their own progress. Warns with static dealing, where it does nothing.
        weights: A weighted mixture of sources (docs/mixtures.md): one weight per source, or a
            schedule of ``(sample, weights)`` pairs (the first at sample 0) naming from which
            sample of the run on each set of weights holds. Indices are numbered as
            ``ConcatDataset`` numbers its datasets' samples; each source goes through epochs
            of its own (every sample once per source epoch), and an epoch of the sampler is
            ``len(dataset)`` samples of the mixture.
        sources: Each source's size (default: the sizes of the datasets of a ``ConcatDataset``).
        max_epochs: Each source's cap in epochs of its own, None for none; a source at its cap
            is dealt no more and its weight is shared out among the others in proportion.
        tag: Hand out each index as a :class:`croupier.client.Sample`, an int that also carries
            its source, source epoch and per-sample seed (for augmentations that must be the
            same after any resume, on any world size and with any ``num_workers``).
        token: The old name of `incarnation` (deprecated: warns; giving both is a ``TypeError``).
        global_batch: The trainer's global batch: samples per optimizer step over every rank
            (``croupier.core.schedule``), for the coordinator's step ledger (which samples each
            step trained). A step takes ``global_batch / (batch_size x world)`` batches of every
            rank (gradient accumulation); this sampler's batch is one index, so give the samples
            a step takes (the loader's batch size x world x accumulation). Default: one batch of
            every rank per step. Every rank gives the same; it may change with a restart.
        rampup: ``(start, increment, steps)``: the global batch starts at ``start`` samples and
            grows by ``increment`` every ``steps`` steps up to `global_batch` (Megatron's
            ``rampup_batch_size``, counted in steps). Needs `global_batch`.
        shard_sizes: A dataset stored in shards (parquet files or row groups, webdataset tars):
            each shard's sample count, in the dataset's order, indices numbered as
            ``ConcatDataset`` numbers them (``croupier.data``'s datasets give them). The epoch is
            then a shard-local order (docs/orders.md): the shards in a keyed order, cut into
            windows of `shard_window` shards whose samples are shuffled together, and each
            reader group of `reader_group` ranks reads its own windows, `lanes` at a time, so a
            shard is fetched by one node an epoch. With the batch sampler's ``dealing="dynamic"``
            the coordinator hands each reader group whole windows, then rows; with `max_tokens`
            the batches are token budgets over that order, and every node reads every shard once
            an epoch (docs/orders.md states the trade). Needs ``shuffle=True``.
        shard_window: Shards per window (default 32): more mixes more shards into a batch.
        lanes: Windows a reader group reads at once (default 16): about ``lanes x
            shard_window`` shards live in a node's cache.
        reader_group: Ranks per reader group, consecutive ranks sharing one cache (default:
            ``LOCAL_WORLD_SIZE``, a torchrun node's ranks, else 1). Part of the spec: every
            rank, and every later generation of the job, gives the same.

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
                 incarnation: str | None = None, lease_ahead: int | None = None, prefetch: int = 2,
                 audit_dir: str | None = None, process_group: Any | None = None, device_mesh: Any | None = None,
                 mesh_dim: str | int | None = None, join_timeout: float | None = None,
                 security: Security | None = None, dealing: str = "static", lockstep: bool = True,
                 weights: Any = None, sources: Sequence[int] | None = None,
                 max_epochs: Sequence[int | None] | None = None, tag: bool = False, token: str | None = None,
                 global_batch: int | None = None, rampup: Sequence[int] | None = None,
                 shard_sizes: Sequence[int] | np.ndarray | None = None, shard_window: int = 32, lanes: int = 16,
                 reader_group: int | None = None) -> None:
        n = dataset_size(dataset)
        mixture = mixture_fields(dataset, weights, sources, max_epochs)
        sharded = shard_fields(sum(mixture["sources"]) if mixture else n, shard_sizes, shard_window, lanes, reader_group)
        kind = kind_for(dealing, None, bool(sharded))
        check_sampler_args(kind, drop_last, tail, lockstep, batches=False)
        self._tag = check_bool("tag", tag)
        if tail is None:
            tail = kind.tail(drop_last, batches=False)
        spec = make_spec(n, shuffle, seed, tail, permutation, partition, 1,
                         False, False, scope, buffer_size, pack_size, lengths, dealing=dealing,
                         mixture=mixture, sharded=sharded)
        if lease_ahead is None:
            lease_ahead = kind.lease_indices
        self._lockstep = bool(lockstep)
        super().__init__(spec, n == 0, num_replicas, rank, address, job, given_incarnation(incarnation, token),
                         lease_ahead, prefetch, audit_dir, process_group, device_mesh, mesh_dim, join_timeout, security,
                         step_schedule(spec, global_batch, rampup))
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
        self._note_callers()
        # Chained in C: taking an index costs what taking one from torch's list does; Python runs
        # once per lease, and `_taken()` reads the position inside the lease from its iterator.
        return itertools.chain.from_iterable(self._leases(object()))

    def _leases(self, me: object) -> Iterator[Iterator[int]]:
        for lease in self._items(me):
            self._log_lease(lease)
            # NOTE: iterating an array makes each Python int as it is taken, in C: no list of the
            # lease's 65,536 ints is built at once, or freed at once (a few % of a trivial loop).
            items: Sequence[int]
            if lease.tags is not None:
                items = tagged(lease.indices, lease.tags)
            else:
                items = array.array("q")
                items.frombytes(np.ascontiguousarray(lease.indices, dtype=np.int64).data.cast("B"))
            it = iter(items)
            self._progress = self._progress.hand_out(it, len(items))
            yield it
            if self._active is me:  # the lease is used up (or the loop let go of this iterator)
                self._progress = self._progress.chunk_done()


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


class DistributedBatchSampler(SamplerBase, BatchSampler):
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
        max_tokens: Token-budget batches instead of ``batch_size``: each batch is as many samples
            as fit in this budget by `cost`, given each sample's token count in ``lengths``
            (formed within windows of `token_window` positions of the epoch's order, shuffled by
            batch). Leave ``batch_size`` unset.
        cost: What a batch costs against `max_tokens`: ``"sum"`` (its lengths added up) or
            ``"padded"`` (its longest length times its size, what a padded tensor holds).
        token_window: Positions of the epoch's order one packing window holds (default 4,096).
        lease_ahead: Batches per lease (``len()``'s unit here). Default: 256 (16 with
            `max_tokens`, 2 with ``dealing="dynamic"``).
        global_batch: The trainer's global batch: samples per optimizer step over every rank, a
            multiple of ``batch_size x world`` (the quotient is the gradient accumulation: batches
            of every rank per step). Default: one batch of every rank per step. Not with `max_tokens`.

    The other arguments are :class:`DistributedSampler`'s; ``lengths`` with
    ``permutation="bucket"``, ``buffer_size`` and ``pack_size`` gives d9d's length bucketing.
    """

    _unit: int
    _per_batch = True

    def __init__(self, dataset: Sized | int, batch_size: int | None = None, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0, drop_last: bool = False, *,
                 address: str | None = None, job: str | None = None, permutation: str | None = None,
                 partition: str = "strided", tail: str | None = None, even_batches: bool = False,
                 scope: str = "global", buffer_size: int | None = None, pack_size: int | None = None,
                 lengths: Sequence[int] | np.ndarray | None = None, incarnation: str | None = None,
                 lease_ahead: int | None = None, prefetch: int = 2, audit_dir: str | None = None,
                 process_group: Any | None = None, device_mesh: Any | None = None,
                 mesh_dim: str | int | None = None, join_timeout: float | None = None,
                 security: Security | None = None, max_tokens: int | None = None, cost: str = "sum",
                 token_window: int = TOKEN_WINDOW, dealing: str = "static", lockstep: bool = True,
                 weights: Any = None, sources: Sequence[int] | None = None,
                 max_epochs: Sequence[int | None] | None = None, tag: bool = False, token: str | None = None,
                 global_batch: int | None = None, rampup: Sequence[int] | None = None,
                 shard_sizes: Sequence[int] | np.ndarray | None = None, shard_window: int = 32, lanes: int = 16,
                 reader_group: int | None = None) -> None:
        n = dataset_size(dataset)
        self._tag = check_bool("tag", tag)
        if batch_size is None and max_tokens is None:
            raise TypeError("DistributedBatchSampler needs batch_size=, or lengths= with max_tokens= for token-budget "
                            "batches")
        if batch_size is not None and max_tokens is not None:
            raise ValueError(f"batch_size={batch_size} and max_tokens={max_tokens}: token-budget batches size "
                             "themselves; leave batch_size unset")
        mixture = mixture_fields(dataset, weights, sources, max_epochs)
        sharded = shard_fields(sum(mixture["sources"]) if mixture else n, shard_sizes, shard_window, lanes, reader_group)
        kind = kind_for(dealing, max_tokens, bool(sharded))
        check_sampler_args(kind, drop_last, tail, lockstep, batches=True)
        if tail is None:
            tail = kind.tail(drop_last, batches=True)
        spec = make_spec(n, shuffle, seed, tail, permutation, partition, batch_size or 1, drop_last, even_batches,
                         scope, buffer_size, pack_size, lengths, max_tokens, cost, token_window, dealing,
                         mixture, sharded)
        if lease_ahead is None:
            lease_ahead = kind.lease_batches
        self._lockstep = bool(lockstep)
        self._unit = batch_size or 1
        super().__init__(spec, n == 0, num_replicas, rank, address, job, given_incarnation(incarnation, token),
                         lease_ahead, prefetch, audit_dir, process_group, device_mesh, mesh_dim, join_timeout, security,
                         step_schedule(spec, global_batch, rampup))
        # torch's attributes; batch_size is None for token-budget batches, whose sizes vary
        self.batch_size = batch_size  # type: ignore[assignment]
        self.drop_last = drop_last
        self.sampler = _IndexView(self)

    def __iter__(self) -> Iterator[list[int]]:
        self._note_callers()
        return self._batches(object())

    def _batches(self, me: object) -> Iterator[list[int]]:
        # NOTE: a lease's indices become Python ints in one call, and each batch is a slice of
        # that list: per batch, a slice and a count, where slicing a numpy batch and converting
        # it costs several times more. The lease's batches are handed out through a list's
        # iterator, whose position counts them (one transition of the progress per lease).
        for lease in self._items(me):
            items: list[int] = lease.indices.tolist() if lease.tags is None else tagged(lease.indices, lease.tags)
            offsets = list(itertools.accumulate(lease.sizes, initial=0))
            batches = [items[a:b] for a, b in itertools.pairwise(offsets)]
            p = self._progress
            epoch, done = p.epoch, p.before + p.yielded  # the lease's first batch's item number
            # This rank's last batch of the epoch, if it is in this lease: its end is logged as
            # it is handed out. (Token-budget batches know it only once their plan got there.)
            known = self._known_rest(epoch)
            last = -1 if known is None else known - 1 - p.yielded
            it = iter(batches)
            self._progress = p.hand_out(it, len(batches))
            for j, b in enumerate(it):
                if self._audit is not None:
                    self._audit.batch(epoch, done + j, lease.indices[offsets[j]:offsets[j + 1]])
                if j >= last if known is not None else self._ends_here(p.yielded + j):
                    self._log_end()
                yield b
                if self._active is not me:
                    return
            self._progress = self._progress.chunk_done()

    def _ends_here(self, yielded: int) -> bool:
        """Whether the batch about to be handed out, after `yielded` of this generation, is this rank's
        last of the epoch (when that is known yet)."""
        known = self._known_rest(self._progress.epoch)
        return known is not None and yielded + 1 >= known

    def _indices_in(self, epoch: int) -> int:
        """This rank's indices in `epoch` (what ``len(self.sampler)`` says), those taken before a resume included.

        NOTE: token-budget batches (``max_tokens``) vary in size, so the batches taken before a
        resumed checkpoint do not say how many indices they held: those count as an even share of
        the positions consumed before it.
        """
        p = self._epoch_plan(epoch)
        if p is None:
            return 0
        before = self._items_before(epoch)
        if before and self.batch_size is None:
            start = self._start if self._start is not None else self._progress.resume
            assert start is not None  # items before: a resumed epoch
            return p.samples(self.rank) + (self.spec.n - start.left) // self.num_replicas
        return p.samples(self.rank) + before * (self.batch_size or 1)
