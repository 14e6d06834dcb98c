"""croupier under Grain (JAX): a sampler Grain's ``DataLoader`` accepts, resumable on another number of processes.

Grain's own samplers are deterministic, but the state of its ``DataLoader`` names positions of
one interleaving of processes and workers: it resumes on the same process count only. croupier's
order is a pure function of a spec and a position, so the sampler here computes every record of
every process from the spec, with no coordinator, and its state is croupier's topology-free
cursor (an epoch and the positions of its order not yet consumed)::

    import grain
    from croupier.integrations import grain as croupier_grain

    sampler = croupier_grain.CroupierSampler(len(source), shard_options=grain.sharding.ShardByJaxProcess(),
                                             seed=0, num_epochs=3)
    loader = croupier_grain.DataLoader(data_source=source, sampler=sampler, worker_count=2,
                                       operations=[grain.transforms.Batch(batch_size=32, drop_remainder=True)])
    it = iter(loader)
    croupier_grain.restore(it, checkpoint_dir)          # saved by any number of processes (or nothing there)
    for batch in it:
        ...
        croupier_grain.save(it, step_dir)               # every process, at the same step

How it deals. With ``S`` processes, process ``k`` takes its share of each epoch as croupier's
``DistributedSampler`` on ``S`` ranks would (one position in ``S``, ``tail`` for the remainder):
epoch after epoch, ``num_epochs`` of them, the first one from the resume point. Grain's
``DataLoader`` asks for ``sampler[j * S + k]``, the ``j``-th record of process ``k``, and
splits each process's records among its workers (worker ``w`` of ``W`` takes records
``w, w + W, ...``), which batch them; the process takes their batches in turn. Each record's
``rng`` (what Grain's ``RandomMap`` draws from) is seeded by croupier's per-sample seed of (seed,
epoch, dataset index): the same augmentation on any number of processes and workers, after any
resume.

What a checkpoint holds. Grain's iterator state says how many records each worker had read for
the batches the process took; from it and the spec, the iterator's ``get_state()`` computes which
positions of which epoch every process has consumed (processes of an SPMD job take the same
number of batches per step: checkpoint all of them at the same step) and stores croupier's
cursor (``croupier.core.checkpoint.to_state``), beside Grain's own state. Workers run ahead of one
another by at most one batch, so the consumed records are a prefix of the epoch plus at most
``W - 1`` batches; a resume deals exactly the rest, on any number of processes and workers, then
the next epochs whole. When those extra batches straddle an epoch's end, the state holds the
next epoch's cursor too.

The step. A JAX loop takes one batch per process per step, so the iterator counts the batches it
handed out since the job's start (a restored state names the step it was saved at) and its state
names that step (``Iterator.step``; ``save(..., step=)`` to name another): the state says where
the trainer was, as a sampler's ``state_dict(step=...)`` does. There is no coordinator here, so
no generation is named.

Saving and restoring. :func:`save` writes Grain's usual ``process_<i>-of-<n>.json`` files
(Grain's ``grain.checkpoint.CheckpointHandler`` writes the same); :func:`restore` reads the
files of whatever process count saved them, checks that they agree, and loads the state. Grain's
own handler restores only on the process count that saved.

Limits: operations that change the number of records (``FlatMap``) make Grain checkpoint
another way, and are refused; ``Filter`` is fine (a filtered record counts as read).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from grain import sharding as grain_sharding
from grain._src.core import transforms as grain_transforms
from grain._src.python.data_loader import DataLoader as _GrainDataLoader
from grain._src.python.record import RecordMetadata

from croupier.core.checkpoint import Taken, from_state, taken_of, to_state
from croupier.core.checks import check_choice, check_int
from croupier.core.cursor import Cursor, epoch_cursor, fresh
from croupier.core.mixture import sample_seeds
from croupier.core.order import FixedPlan, fixed_plan, order
from croupier.core.spec import Spec

__all__ = ["CroupierSampler", "DataLoader", "Iterator", "restore", "save"]

_FORMAT = 1
#: A process's records are worked out this many at a time (one numpy pass), and a few blocks kept.
_BLOCK = 512


class CroupierSampler:
    """A Grain sampler: croupier's order of ``num_records`` records, dealt to Grain's processes.

    Args:
        num_records: The data source's size.
        shard_options: Grain's sharding (``grain.sharding.ShardByJaxProcess()`` under JAX):
            ``shard_count`` processes, this one ``shard_index``. Its ``drop_remainder`` is not
            used: `tail` says what happens to an epoch's remainder.
        seed: The shuffle seed (every process must use the same).
        shuffle: Shuffle each epoch (croupier's ``feistel`` order); False: identity order.
        num_epochs: Epochs to deal, counting the ones before the resume point.
        tail: ``pad`` (repeat from the epoch's start, as torch's ``DistributedSampler``),
            ``drop`` or ``pad_last``, when the epoch's remainder does not divide by the process count.
        job: The job's name in the checkpoint state (a state of another job is refused).
    """

    def __init__(self, num_records: int, *, shard_options: grain_sharding.ShardOptions, seed: int = 0,
                 shuffle: bool = True, num_epochs: int = 1, tail: str = "pad", job: str = "grain") -> None:
        check_int("num_records", num_records, 1, None, ValueError)
        check_int("num_epochs", num_epochs, 1, None, ValueError)
        if not isinstance(shard_options, grain_sharding.ShardOptions):
            raise TypeError(f"shard_options must be a grain.sharding.ShardOptions (got {shard_options!r})")
        check_choice("tail", tail, ("pad", "drop", "pad_last"), "every process takes the same number of records")
        self.spec = Spec(n=num_records, seed=seed, permutation="feistel" if shuffle else "none", tail=tail)
        self.job = job
        self.num_epochs = num_epochs
        self._shard_options = shard_options  # Grain's DataLoader reads it from here when given none
        self._processes = shard_options.shard_count
        self._start: tuple[Cursor, ...] = (fresh(self.spec, 0),)
        self._cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._layout()

    # ---------------------------------------------------------------- where the records are

    @property
    def shard_options(self) -> grain_sharding.ShardOptions:
        return self._shard_options

    @property
    def start(self) -> tuple[Cursor, ...]:
        """Where dealing starts: the first epoch's cursor (and the next one's, when a state held two)."""
        return self._start

    def _layout(self) -> None:
        """Each dealt epoch's plan and where it begins in a process's records."""
        s = self._processes
        plans: list[FixedPlan] = []
        for epoch in range(self._start[0].epoch, self.num_epochs):
            # the epoch rule, from the last cursor given at or before this epoch (a state may hold two)
            start = [c for c in self._start if c.epoch <= epoch][-1]
            cursor = epoch_cursor(self.spec, start, s, epoch)
            assert cursor is not None  # never an epoch before its start
            plans.append(fixed_plan(self.spec, cursor, s))
        # Every process takes the same number of records of an epoch (tail pad, drop or pad_last).
        lengths = [int(p.n_r[0]) for p in plans]
        self._plans = plans
        self._cache = {}
        self._begins = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self._begins[-1]) * int(self._processes)

    def __getitem__(self, index: int) -> RecordMetadata:
        j, k = divmod(int(index), self._processes)
        if index < 0 or j >= self._begins[-1]:
            raise IndexError(f"record {index} is past the end of {len(self)} records")
        block, at = divmod(j, _BLOCK)
        cached = self._cache.get((k, block))
        if cached is None:
            cached = self._records(k, np.arange(block * _BLOCK, min((block + 1) * _BLOCK, int(self._begins[-1])),
                                                dtype=np.int64))
            if len(self._cache) >= 8:
                self._cache.pop(next(iter(self._cache)))
            self._cache[(k, block)] = cached
        _, keys, seeds = cached
        rng = np.random.Generator(np.random.Philox(key=int(seeds[at])))
        return RecordMetadata(index=int(index), record_key=int(keys[at]), rng=rng)

    def _records(self, k: int, local: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The epochs, dataset indices and per-sample seeds of process `k`'s records `local`, at once."""
        which = np.searchsorted(self._begins, local, side="right") - 1
        epochs = np.empty(local.shape, dtype=np.int64)
        keys = np.empty(local.shape, dtype=np.int64)
        for e in np.unique(which).tolist():
            sel = which == e
            p = self._plans[e]
            pos = p.positions(p.virtual(k, local[sel] - int(self._begins[e])))
            keys[sel] = order(self.spec, p.cursor.epoch, pos, p.cursor.base_world)
            epochs[sel] = p.cursor.epoch
        return epochs, keys, sample_seeds(self.spec.seed, np.zeros(local.shape, dtype=np.int64), epochs, keys)

    def record(self, index: int) -> tuple[int, int, int]:
        """(epoch, dataset index, per-sample seed) of Grain's `index`: the seed is
        ``croupier.core.mixture.sample_seed(seed, 0, epoch, dataset index)``, the same whoever deals it."""
        j, k = divmod(int(index), self._processes)
        epochs, keys, seeds = self._records(k, np.array([j], dtype=np.int64))
        return int(epochs[0]), int(keys[0]), int(seeds[0])

    def __repr__(self) -> str:
        starts = [(c.epoch, c.left) for c in self._start]
        return (f"CroupierSampler({self.spec.describe()}, num_epochs={self.num_epochs}, "
                f"processes={self._processes}, start={starts})")

    # ---------------------------------------------------------------- checkpoint state

    def consumed(self, grain_state: dict[str, Any]) -> tuple[Cursor, ...]:
        """Where every process is once each has read what this process read, by Grain's iterator state.

        Returns the cursor of the first epoch not finished, and the next epoch's when some of its
        records were read too (workers run ahead of one another by at most a batch).
        """
        s, k = self._processes, self._shard_options.shard_index
        workers = max(int(grain_state["worker_count"]), 1)
        seen = grain_state["last_seen_indices"]
        # Grain: last_seen[w] = k + w * S + (read[w] - 1) * W * S, read[w] = records worker w has read.
        read = [(int(seen[str(w)]) - k - w * s) // (workers * s) + 1 for w in range(workers)]
        low = min(read)
        prefix = workers * low  # records 0 .. prefix - 1 of every process: read
        extra = np.array([w + workers * m for w in range(workers) for m in range(low, read[w])], dtype=np.int64)
        out: list[Cursor] = []
        e = int(np.searchsorted(self._begins, prefix, side="right")) - 1
        if e >= len(self._plans):
            return (fresh(self.spec, self.num_epochs),)
        while e < len(self._plans):
            p = self._plans[e]
            begin, end = int(self._begins[e]), int(self._begins[e + 1])
            cursor = p.advance(min(max(prefix - begin, 0), end - begin))
            mine = extra[(extra >= begin) & (extra < end)] - begin
            if mine.size:
                v = np.concatenate([p.virtual(r, mine) for r in range(s)])  # every process read these records
                cursor = _without(cursor, p.positions(v[v < p.left]))
            if cursor.left or not out:
                out.append(cursor if cursor.left else fresh(self.spec, p.cursor.epoch + 1))
            if not extra.size or int(extra.max()) < end:
                break
            e += 1
        return tuple(out[:2])

    def start_at(self, cursors: Sequence[Cursor]) -> None:
        """Deals from `cursors` (consecutive epochs) on: what :meth:`Iterator.set_state` calls."""
        self._start = tuple(cursors)
        self._layout()


def _without(cursor: Cursor, positions: np.ndarray) -> Cursor:
    """`cursor` with `positions` (of its epoch) consumed."""
    gone = np.unique(positions).tolist()
    out: list[tuple[int, int]] = []
    for a, b in cursor.remaining:
        for x in gone:
            if a <= x < b:
                if a < x:
                    out.append((a, x))
                a = x + 1
        if a < b:
            out.append((a, b))
    return dataclasses.replace(cursor, remaining=tuple(out))


class DataLoader:
    """Grain's ``DataLoader`` over a :class:`CroupierSampler`, whose iterators checkpoint croupier's state.

    Takes Grain's arguments (``shard_options`` comes from the sampler); iterating it gives an
    :class:`Iterator`.
    """

    def __init__(self, *, data_source: Any, sampler: CroupierSampler, operations: Sequence[Any] = (),
                 worker_count: int = 0, worker_buffer_size: int = 1, read_options: Any = None) -> None:
        if not isinstance(sampler, CroupierSampler):
            raise TypeError(f"sampler must be a CroupierSampler (got {type(sampler).__name__})")
        for op in operations:
            if isinstance(op, grain_transforms.FlatMap):
                raise ValueError(f"operation {op!r} is a FlatMap: Grain then checkpoints by another state, which "
                                 "croupier cannot read; flatten the records before the sampler instead")
        if len(data_source) != sampler.spec.n:
            raise ValueError(f"the data source has {len(data_source)} records but the sampler was made for "
                             f"{sampler.spec.n}")
        self.data_source = data_source
        self.sampler = sampler
        self.operations = list(operations)
        self.worker_count = worker_count
        self.worker_buffer_size = worker_buffer_size
        self.read_options = read_options

    def _grain(self) -> _GrainDataLoader:
        return _GrainDataLoader(data_source=self.data_source, sampler=self.sampler, operations=self.operations,
                                worker_count=self.worker_count, worker_buffer_size=self.worker_buffer_size,
                                shard_options=self.sampler.shard_options, read_options=self.read_options)

    def __iter__(self) -> Iterator:
        return Iterator(self)


class Iterator:
    """An iterator of a croupier :class:`DataLoader`: Grain's, with a state any process count can load.

    ``get_state()`` / ``set_state()`` take bytes (JSON), as Grain's ``DataLoaderIterator`` does, so
    Grain's checkpoint handler saves it too; ``set_state`` must come before the first ``next()``.

    Attributes:
        step: The batches this process took since the job's start (a restored state's step, plus
            this iterator's): the trainer's step when it takes one batch a step. None after
            restoring a state that named no step. The state names it; assign it to name another.
    """

    def __init__(self, loader: DataLoader) -> None:
        self._loader = loader
        self._it: Any = None
        self.step: int | None = 0

    def _grain(self) -> Any:
        if self._it is None:
            self._it = iter(self._loader._grain())
        return self._it

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        batch = next(self._grain())
        if self.step is not None:
            self.step += 1
        return batch

    def start_prefetch(self) -> None:
        self._grain().start_prefetch()

    def get_state(self) -> bytes:
        sampler = self._loader.sampler
        grain_state = json.loads(self._grain().get_state().decode())
        cursors = sampler.consumed(grain_state)
        states = [to_state(sampler.job, sampler.spec, c, taken=Taken(self.step)) for c in cursors]
        return json.dumps({"croupier": {"format": _FORMAT, "cursors": states}, "grain": grain_state},
                          indent=1).encode()

    def set_state(self, state: bytes) -> None:
        if self._it is not None:
            raise RuntimeError("set_state() after the first next(): restore a croupier Grain iterator before reading it")
        d = json.loads(state.decode() if isinstance(state, bytes) else state)
        ours = d.get("croupier") if isinstance(d, dict) else None
        if not isinstance(ours, dict) or ours.get("format") != _FORMAT:
            raise ValueError("not a croupier Grain iterator state (no 'croupier' entry of format "
                             f"{_FORMAT}): a plain Grain DataLoader's state cannot be read on another process count")
        sampler = self._loader.sampler
        cursors = []
        for s in ours["cursors"]:
            c = from_state(sampler.job, sampler.spec, s)
            cursors.append(c if c is not None else fresh(sampler.spec, int(s["epoch"])))
        sampler.start_at(cursors)
        self.step = taken_of(ours["cursors"][0]).step if ours["cursors"] else None


def save(iterator: Iterator, directory: str | pathlib.Path, step: int | None = None) -> pathlib.Path:
    """Writes `iterator`'s state as Grain's handler does (``process_<i>-of-<n>.json``); returns the file.

    Args:
        step: The trainer's step the state names (default: the iterator's count, ``Iterator.step``);
            from then on the iterator counts on from it.
    """
    if step is not None:
        check_int("step", step, 0, None, ValueError)
        iterator.step = step
    k, s = iterator._loader.sampler.shard_options.shard_index, iterator._loader.sampler.shard_options.shard_count
    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    out = path / f"process_{k}-of-{s}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(iterator.get_state())
    tmp.replace(out)
    return out


def restore(iterator: Iterator, directory: str | pathlib.Path) -> bool:
    """Loads the state saved in `directory` by any number of processes; False when there is none.

    Raises:
        ValueError: the processes' files disagree (they were not saved at the same step), or a
            file is not a croupier state.
    """
    files = sorted(pathlib.Path(directory).glob("process_*-of-*.json"))
    if not files:
        return False
    states = {f.name: json.loads(f.read_text())["croupier"] for f in files}
    first = next(iter(states.values()))
    for name, s in states.items():
        if s != first:
            raise ValueError(f"{files[0].name} and {name} in {directory} name different positions: every process "
                             "must be checkpointed at the same step")
    iterator.set_state(files[0].read_bytes())
    return True
