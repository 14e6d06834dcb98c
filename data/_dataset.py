"""`ShardedDataset`: a map-style view of parquet or webdataset shards, local or in object storage, read through a node's cache."""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import operator
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from croupier.client import FILTERED
from croupier.core.checkpoint import from_state
from croupier.core.checks import check_bool, check_choice, check_int
from croupier.core.spec import Spec
from croupier.data._board import DemandBoard, Eviction, LeastRecentlyUsed, PlanDriven, seed_at
from croupier.data._cache import ShardCache
from croupier.data._formats import FORMATS, Reader
from croupier.data._index import IndexCache
from croupier.data._manifest import Manifest, Shard, ShardChanged
from croupier.data._ranges import Corrupt, FetchFailed, Ranges
from croupier.data._storage import Retry, Storage, transient

log = logging.getLogger("croupier.data")

ON_ERROR = ("raise", "skip")
#: What the node's cache evicts first: see :class:`croupier.data._board.PlanDriven` and ``LeastRecentlyUsed``.
EVICTIONS = ("plan", "lru")
#: The node's cache bound when none is given, in bytes.
DEFAULT_CACHE_BYTES = 16 * 2**30
#: Shards one process keeps open (each with its decoded row groups), the least recently read closed first.
OPEN_SHARDS = 256
#: Indices of a lease whose fetches :meth:`ShardedDataset.read_ahead` queues first (then 4 times as many, ...).
READ_AHEAD_FIRST = 64
#: Tries at opening a shard the cache fetched, should another process evict it before the open.
_OPEN_TRIES = 3


def default_cache_dir() -> str:
    """The node's cache folder when none is given: ``croupier-data`` in the system's temporary folder."""
    return os.path.join(tempfile.gettempdir(), "croupier-data")


class ShardError(RuntimeError):
    """A shard could not be read: missing, refused, unreadable after its retries, or corrupt.

    The message names the shard's path, what was wrong and the dataset indices it holds; so do the
    attributes (empty when rebuilt from the message alone, as a DataLoader worker's error is).

    Attributes:
        path: The shard's URL or path.
        reason: What was wrong (``missing``, ``refused``, ``unreadable``, ``corrupt``).
        indices: The dataset indices the shard holds.
    """

    def __init__(self, message: str, *, path: str = "", reason: str = "", indices: range = range(0)) -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason
        self.indices = indices


class ShardedDataset:
    """A map-style dataset over shards: ``ds[i]`` is row ``i - offsets[s]`` of shard s (as torch's
    ConcatDataset numbers samples), decoded, then passed through `transform`.

    Drive it with a croupier sampler built on its shard sizes
    (``DistributedSampler(ds, shard_sizes=ds.shard_sizes, ...)``) and a DataLoader; it is picklable, and
    each DataLoader worker opens the shards it reads itself. Local files are read in place; shards in
    object storage are fetched into the node's cache (``cache_dir``, shared by the node's ranks and workers,
    at most `cache_bytes`) and read from there: a parquet file by row group (its footer from the shard's
    index, each row group a ranged read of its bytes when a row of it is first asked for), a tar whole.
    Hand the sampler's upcoming indices to :meth:`read_ahead` (``sampler.read_ahead = ds.read_ahead``) and
    the row groups they need are fetched while the ones before them train.

    Args:
        shards: A :class:`Manifest` (its shards as recorded; each is checked against the store, see
            `verify`), or what :meth:`Manifest.build` takes: a folder, a glob, a file or a list of files,
            local paths or fsspec URLs (``s3://``, ``gs://``, ``file://``).
        transform: Called on each decoded sample; its result is what ``ds[i]`` returns.
        format: The shards' format (``parquet`` or ``webdataset``); default: from each file's suffix.
        storage_options: The file systems' options (credentials, ``client_kwargs={"endpoint_url": ...}``
            for S3), as fsspec takes them.
        cache_dir: The node's cache folder: fetched shards under ``shards/``, shard indices under ``index/``.
            Default :func:`default_cache_dir`.
        cache_bytes: The bound on the fetched shards held in ``cache_dir``, in bytes; at least the largest
            shard in object storage (best, a few shards for each process of the node that reads).
        on_error: ``"raise"``: a shard that cannot be read raises :class:`ShardError`. ``"skip"``: each of
            its samples is ``croupier.client.FILTERED`` (counted as filtered by the packing stage and its
            audit log, never missing), and a warning names the shard once per process.
        retry: How transient read errors are retried (default :class:`Retry`'s).
        decode: Decode a tar's members by extension (text, ints, JSON); else each member's bytes.
        verify: With a manifest, check at once that no shard changed (one listing per folder); a shard is
            checked again whenever it is fetched.
        prefetch_threads: Threads fetching what :meth:`prefetch` and :meth:`read_ahead` name.
        range_reads: Read parquet shards in object storage by row group (ranged reads of the groups a read
            needs); False: fetch each shard whole, its MD5 checked against the etag where the store gives one.
        eviction: What the node's cache evicts first when it needs room. ``"plan"``: the shards the plan needs
            no more this epoch (every row read by the node), then those no lease announced to
            :meth:`read_ahead` needs (least recently used first), then those needed furthest in the future;
            ``"lru"``: the least recently used.

    Raises:
        ShardChanged: a shard is not what the manifest recorded (a ValueError naming its path and both values).
        ValueError: an argument is out of its range, or a shard in object storage is larger than `cache_bytes`.
    """

    def __init__(self, shards: Manifest | str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
                 transform: Callable[[Any], Any] | None = None, format: str | None = None,
                 storage_options: Mapping[str, Any] | None = None, cache_dir: str | os.PathLike[str] | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, on_error: str = "raise", retry: Retry | None = None,
                 decode: bool = True, verify: bool = True, prefetch_threads: int = 4,
                 range_reads: bool = True, eviction: str = "plan") -> None:
        self.on_error = check_choice("on_error", on_error, ON_ERROR)
        self.eviction = check_choice("eviction", eviction, EVICTIONS)
        self.range_reads = check_bool("range_reads", range_reads)
        self.transform = transform
        self.decode = decode
        self.prefetch_threads = check_int("prefetch_threads", prefetch_threads, 1)
        self.cache_dir = os.fspath(cache_dir) if cache_dir is not None else default_cache_dir()
        self._storage = Storage(storage_options, retry)
        if isinstance(shards, Manifest):
            self.manifest = shards
            if verify:
                self._verify()
        else:
            self.manifest = Manifest.find_or_build(shards, format=format, storage_options=storage_options,
                                                   cache_dir=self.cache_dir, retry=retry)
        self._sizes = self.manifest.sizes
        self._offsets = tuple(itertools.accumulate(self._sizes, initial=0))  # (shards + 1,)
        self._local = tuple(self._storage.is_local(s.path) for s in self.manifest.shards)
        self._remote = ~np.asarray(self._local, dtype=bool)  # (shards,) the shards read through the cache
        self._board: DemandBoard | None = None
        policy: Eviction = LeastRecentlyUsed()
        if self.eviction == "plan" and self._remote.any():
            self._board = DemandBoard(os.path.join(self.cache_dir, "plan"), self.manifest.fingerprint, self._sizes)
            policy = PlanDriven(self._board, {shard.key: s for s, shard in enumerate(self.manifest.shards)})
        self.cache = ShardCache(os.path.join(self.cache_dir, "shards"), cache_bytes, policy)
        largest = max((s for s, local in zip(self.manifest.shards, self._local) if not local),
                      key=lambda s: s.bytes, default=None)
        if largest is not None and largest.bytes > cache_bytes:
            raise ValueError(f"cache_bytes={cache_bytes} is smaller than shard {largest.path} ({largest.bytes} bytes): "
                             f"the cache must hold the largest shard in object storage")
        self._index = IndexCache(self.cache_dir)
        self._ranges = Ranges(self.manifest, self._storage, self.cache, self._index)
        self._fresh()

    def _fresh(self) -> None:
        """This process's own state: open readers, shards skipped, the prefetch threads."""
        self._pid = os.getpid()
        self._readers: OrderedDict[int, Reader] = OrderedDict()
        self._skipped: dict[int, ShardError] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        own = {"_pid", "_readers", "_skipped", "_executor", "_executor_lock"}
        return {k: v for k, v in self.__dict__.items() if k not in own}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fresh()

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """The samples of each shard, in the manifest's order: the sampler's ``shard_sizes``."""
        return self._sizes

    @property
    def offsets(self) -> tuple[int, ...]:
        """The dataset index of each shard's first row, and the dataset's size last (``len(shards) + 1`` values)."""
        return self._offsets

    def __len__(self) -> int:
        return self._offsets[-1]

    def shard_of(self, index: int) -> tuple[int, int]:
        """The (shard, row) of dataset index `index`.

        Raises:
            IndexError: `index` is not in ``[0, len(self))``.
        """
        i = operator.index(index)
        if not 0 <= i < len(self):
            raise IndexError(f"dataset index {i} is not in [0, {len(self)})")
        s = bisect.bisect_right(self._offsets, i) - 1
        return s, i - self._offsets[s]

    def indices(self, shard: int) -> range:
        """The dataset indices shard `shard` holds."""
        return range(self._offsets[shard], self._offsets[shard + 1])

    def __getitem__(self, index: int) -> Any:
        """Sample `index`, decoded and transformed; ``croupier.client.FILTERED`` for a sample of a shard skipped
        (``on_error="skip"``).

        Raises:
            IndexError: `index` is out of range.
            ShardError: its shard cannot be read (``on_error="raise"``).
            ShardChanged: its shard is not what the manifest recorded.
        """
        sample = self._get(index)
        if self._board is not None:
            shard = self.shard_of(index)[0]
            if self._remote[shard]:
                self._board.consumed(np.array([shard]), np.ones(1, dtype=np.int64))
        return sample

    def _get(self, index: int) -> Any:
        """``ds[index]``, not recorded on the demand board."""
        s, r = self.shard_of(index)
        reader = self._reader(s)
        if reader is None:
            return FILTERED
        try:
            sample = reader.row(r)
        except ShardChanged:
            self._close(s)
            raise
        except FetchFailed as e:
            self._close(s)
            self._fail(s, e.error)
            return FILTERED
        except Exception as e:
            self._close(s)
            self._discard(s)
            self._fail(s, Corrupt(e))
            return FILTERED
        return sample if self.transform is None else self.transform(sample)

    def prefetch(self, shards: Iterable[int]) -> list[Future[None]]:
        """Starts fetching `shards` whole into the node's cache in background threads (a shard held already, or
        local, is done at once). A failed fetch is not raised here: the read of the shard reports it.

        Returns:
            One future per shard, done when the shard is in the cache or its fetch failed (its exception).
        """
        out: list[Future[None]] = []
        for s in shards:
            s = check_int("shard", s, 0, len(self._sizes))
            if self._local[s]:
                done: Future[None] = Future()
                done.set_result(None)
                out.append(done)
            else:
                out.append(self._pool().submit(self._fetch, s, None))
        return out

    def read_ahead(self, indices: Sequence[int] | np.ndarray) -> list[Future[None]]:
        """Starts fetching what reading `indices` (the sampler's upcoming ones, in the order they come) needs
        into the node's cache, in background threads: in stages (the first READ_AHEAD_FIRST indices, then 4
        times as many, and so on), each stage's shards in the order of their first index, and of a parquet
        shard in object storage only the row groups those indices fall in. Local shards and what
        the cache holds already cost nothing. A failed fetch is not raised here: the read reports it.

        Give it to the sampler (``sampler.read_ahead = ds.read_ahead``): the sampler calls it with each lease
        of indices it prepares, ahead of the training loop, so a lease's shards are fetched while the one
        before it trains. The cache must hold what a few leases read (``lease_ahead x batch_size`` indices a
        lease, ``prefetch`` leases prepared ahead of the one in use), or read-ahead evicts what is still to
        be read.

        Returns:
            One future per shard in object storage and stage, done when its pieces are in the cache or a fetch
            failed.

        Raises:
            IndexError: an index is not in ``[0, len(self))`` (nothing is fetched then).
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and not (0 <= int(idx.min()) and int(idx.max()) < len(self)):
            bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
            raise IndexError(f"read_ahead: dataset index {bad} is not in [0, {len(self)})")
        if self._board is not None and idx.size:
            shards, rows, at = self._demand(idx)
            self._board.announce(shards, rows, at, idx.size)  # before the fetches: their room spares these
        # NOTE: in stages of growing length (READ_AHEAD_FIRST indices, then 4 times as many, ...), each stage's
        # fetches queued before the next's: a lease's first batches (a resumed rank's first batch among them)
        # wait for their own row groups only, not for those of the whole lease.
        out = []
        start, stage = 0, READ_AHEAD_FIRST
        while start < idx.size:
            part = idx[start:start + stage]
            out += [self._pool().submit(self._fetch, s, rows) for s, rows in self._by_shard(part) if not self._local[s]]
            start, stage = start + stage, 4 * stage
        return out

    def resume(self, spec: Spec, state: Mapping[str, Any]) -> bool:
        """Seeds the node's demand board at the checkpoint `state` the sampler resumes from (True if this call seeded it):
        each shard counts as read the rows the epoch consumed before it, so a shard whose last rows are read after the
        resume is finished (evicted first) as in a run never stopped. Call it in every reading process once the sampler
        loaded `state`, before the loop (``ds.resume(sampler.spec, state)``): the node's first call seeds, the others
        change nothing. No board (``eviction="lru"``, all shards local), another order or a mixture, no state: a no-op.

        Raises:
            TypeError: `spec` is not a :class:`croupier.core.spec.Spec` (``sampler.spec``).
            ValueError: the spec's shards are not this dataset's, or `state` is not the spec's.
        """
        if not isinstance(spec, Spec):
            raise TypeError(f"resume: spec must be a croupier Spec, the sampler's spec (got {type(spec).__name__})")
        if spec.shards is not None and spec.shards != np.asarray(self._sizes, dtype="<i8").tobytes():
            raise ValueError(f"resume: the spec's {len(spec.shards) // 8} shards of {spec.n} samples are not this dataset's "
                             f"{len(self._sizes)} of {len(self)}: build the sampler with shard_sizes=ds.shard_sizes")
        cursor = from_state(str(state.get("job")) if isinstance(state, Mapping) else "", spec, state) if state else None
        return self._board is not None and cursor is not None and seed_at(self._board, spec, cursor)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The samples of a batch (what a DataLoader's worker asks for): what they need that the node's cache
        does not hold is fetched first, a shard a thread (`prefetch_threads`) at once, then the rows are read.

        Raises:
            As ``ds[i]`` does.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size > 1 and 0 <= int(idx.min()) and int(idx.max()) < len(self):  # else the reads raise
            self._own()
            missing = [(s, rows) for s, rows in self._by_shard(idx)
                       if not self._local[s] and s not in self._skipped and not self._held(s, rows)]
            futures = [self._pool().submit(self._fetch, s, rows) for s, rows in missing] if len(missing) > 1 else []
            for f in futures:
                f.exception()  # a failed fetch: the read of its row reports it
            if len(missing) == 1:
                with contextlib.suppress(Exception):  # as above
                    self._fetch(*missing[0])
        out = [self._get(i) for i in indices]
        if self._board is not None and idx.size:
            shards, rows, _ = self._demand(idx)
            self._board.consumed(shards, rows)
        return out

    def close(self) -> None:
        """Closes this process's open shards and stops its prefetch threads."""
        for s in list(self._readers):
            self._close(s)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------------ reading a shard

    def _pool(self) -> ThreadPoolExecutor:
        self._own()
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.prefetch_threads, thread_name_prefix="croupier-prefetch")
            return self._executor

    def _own(self) -> None:
        """Starts this process's own state after a fork (a DataLoader worker shares no open file with its parent)."""
        if self._pid != os.getpid():
            self._fresh()

    def _reader(self, s: int) -> Reader | None:
        self._own()
        if s in self._skipped:
            return None
        reader = self._readers.get(s)
        if reader is not None:
            self._readers.move_to_end(s)
            return reader
        try:
            reader = self._open(s)
        except ShardChanged:
            raise
        except Exception as e:
            self._fail(s, e)
            return None
        self._readers[s] = reader
        while len(self._readers) > OPEN_SHARDS:
            self._close(next(iter(self._readers)))
        return reader

    def _close(self, s: int) -> None:
        reader = self._readers.pop(s, None)
        if reader is not None:
            reader.close()

    def _open(self, s: int) -> Reader:
        shard = self.manifest.shards[s]
        fmt = FORMATS[shard.format]
        if self._ranged(s):
            full = self._ranges.index(s)
            self._ranges.pieces(s, full)
            return fmt.open_pieces(full, shard.bytes, lambda k: self._ranges.read(s, k), self.decode)
        index = self._index.get(shard.key)
        if self._local[s]:
            shard.check(self._storage.stat(shard.path))
            try:
                return fmt.open(self._storage.local_path(shard.path), index, self.decode)
            except (FileNotFoundError, PermissionError):
                raise
            except Exception as e:
                raise Corrupt(e) from e
        for tried in range(1, _OPEN_TRIES + 1):
            path = self._ensure(s)
            try:
                return fmt.open(path, index, self.decode)
            except FileNotFoundError:
                if tried == _OPEN_TRIES:  # evicted again and again: the cache is too small for the readers
                    raise
            except Exception as e:
                self._discard(s)
                raise Corrupt(e) from e
        raise AssertionError("unreachable")

    def _ranged(self, s: int) -> bool:
        """Whether shard `s` is read by pieces: in object storage, of a format read so, with range reads on."""
        return self.range_reads and not self._local[s] and FORMATS[self.manifest.shards[s].format].ranged

    def _by_shard(self, idx: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """Each shard of dataset indices `idx` (in range) with its rows among them, the shards in the order of
        their first index."""
        shard = np.searchsorted(np.asarray(self._offsets, dtype=np.int64), idx, side="right") - 1  # (len,)
        _, first = np.unique(shard, return_index=True)
        out = []
        for at in np.sort(first).tolist():
            s = int(shard[at])
            out.append((s, np.unique(idx[shard == s] - self._offsets[s])))
        return out

    def _demand(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The shards in the cache that dataset indices `idx` (in range) fall in, the indices in each, and the
        place in `idx` of each one's first."""
        shard = np.searchsorted(np.asarray(self._offsets, dtype=np.int64), idx, side="right") - 1  # (len,)
        uniq, first, count = np.unique(shard, return_index=True, return_counts=True)
        keep = self._remote[uniq]
        return uniq[keep], count[keep].astype(np.int64), first[keep].astype(np.int64)

    def _held(self, s: int, rows: np.ndarray) -> bool:
        """Whether the node's cache holds what reading `rows` of shard `s` needs (as far as this process knows)."""
        return self._ranges.ready(s, rows) if self._ranged(s) else self.cache.holds(self.manifest.shards[s].key)

    def _fetch(self, s: int, rows: np.ndarray | None) -> None:
        """Fetches into the cache what reading `rows` of shard `s` (None: every row) needs."""
        if self._ranged(s):
            self._ranges.ensure(s, self._ranges.wanted(s, rows))
        else:
            self._ensure(s)

    def _discard(self, s: int) -> None:
        """Drops shard `s`'s copy (or the copies of its pieces) from the cache: one found corrupt."""
        if self._local[s]:
            return
        self.cache.discard(self.manifest.shards[s].key)
        self._ranges.discard(s)

    def _ensure(self, s: int) -> str:
        """The local path of shard `s`, fetched into the cache if need be (checked against the manifest first)."""
        shard: Shard = self.manifest.shards[s]

        def fetch(dest: str) -> None:
            shard.check(self._storage.stat(shard.path))
            self._storage.fetch(shard.path, dest, shard.bytes, shard.etag)

        return self.cache.ensure(shard.key, shard.bytes, fetch)

    def _fail(self, s: int, e: Exception) -> None:
        """Reports shard `s` unreadable for `e`: raises :class:`ShardError` (``on_error="raise"``), or records the
        shard as skipped in this process."""
        if isinstance(e, ShardChanged):
            raise e
        shard, rng = self.manifest.shards[s], self.indices(s)
        if isinstance(e, Corrupt):
            reason, e = "corrupt", e.error
        elif isinstance(e, FileNotFoundError):
            reason = "missing"
        elif isinstance(e, PermissionError):
            reason = "refused"
        elif transient(e):
            reason = f"unreadable after {self._storage.retry.attempts} tries"
        else:
            reason = "unreadable"
        err = ShardError(f"shard {s} ({shard.path}, {shard.format}) is {reason}: {type(e).__name__}: {e}; it holds "
                         f"dataset indices {rng.start} to {rng.stop - 1} ({len(rng)} samples)",
                         path=shard.path, reason=reason.split()[0], indices=rng)
        if self.on_error == "raise":
            raise err from e
        if s not in self._skipped:
            log.warning("%s: on_error='skip', its samples are FILTERED", err)
        self._skipped[s] = err

    def _verify(self) -> None:
        """Refuses a manifest's shard that changed: one listing per folder of shards."""
        by_parent: dict[tuple[int, str], list[Shard]] = {}
        for shard in self.manifest.shards:
            fs, path = self._storage.fs(shard.path)
            by_parent.setdefault((id(fs), fs._parent(path)), []).append(shard)
        for shards in by_parent.values():
            listing = self._storage.listing(shards[0].path)
            for shard in shards:
                now = listing.get(self._storage.fs(shard.path)[1])
                if now is not None:  # a missing shard is reported when it is read (on_error)
                    shard.check(now)
