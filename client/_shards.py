"""A sampler's spec from its arguments, and every rank's share of an epoch computed in one process (`shards`)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence, Sized
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from croupier.client._resolve import local_world_size
from croupier.core.api import MAX_WORLD
from croupier.core.checkpoint import from_state
from croupier.core.checks import check_bool, check_int
from croupier.core.cursor import bind, epoch_agrees, fresh, show
from croupier.core.mixture import parts_of
from croupier.core.registry import PlanKind, kind_for, plan_epoch, sized_batches
from croupier.core.schedule import Schedule
from croupier.core.spec import MAX_N, TOKEN_WINDOW, Spec


def dataset_size(dataset: Sized | int) -> int:
    """The samples of a sampler's `dataset` argument: its ``len()``, or the int N given in its place.

    Raises:
        TypeError: `dataset` is a sampler (a framework re-sharding the loader), or neither an int nor sized.
        ValueError: N is negative.
    """
    if isinstance(dataset, (int, np.integer)):  # a bool is refused here, as not an int
        return check_int("dataset size", dataset, 0)
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


def mixture_fields(dataset: Any, weights: Any, sources: Sequence[int] | None,
                   max_epochs: Sequence[int | None] | None) -> dict[str, Any]:
    """A spec's mixture fields (``sources``, ``weights``, ``max_epochs``) from a sampler's arguments; {} for no mixture.

    Args:
        weights: One weight per source (any positive scale), or a schedule: ``(sample, weights)``
            pairs, the first at sample 0, from which sample of the run on those weights hold.
        sources: Each source's size; default: the sizes of a ``ConcatDataset``'s datasets.
        max_epochs: Each source's cap in epochs of its own (None: none).
    """
    if weights is None:
        if sources is not None or max_epochs is not None:
            raise ValueError("sources= and max_epochs= describe a mixture: they need weights=")
        return {}
    if sources is None:
        sizes = getattr(dataset, "cumulative_sizes", None)
        if sizes is None:
            raise ValueError(f"weights= needs each source's size: pass sources=[size, ...], or a ConcatDataset of the "
                             f"sources (got a {type(dataset).__name__})")
        sources = [int(b - a) for a, b in zip([0, *sizes[:-1]], sizes)]
    sources = [check_int(f"sources[{i}]", x, 1, MAX_N + 1) for i, x in enumerate(sources)]
    try:
        schedule = [(0, list(weights))] if all(not isinstance(w, (tuple, list)) for w in weights) else [
            (c[0], list(c[1])) for c in weights]
    except (TypeError, IndexError, KeyError):
        raise ValueError(f"weights must be one weight per source or (sample, weights) pairs (got {weights!r})") from None
    changes = []
    for at, ws in schedule:
        if len(ws) != len(sources):
            raise ValueError(f"weights {ws!r} (from sample {at}) name {len(ws)} sources; there are {len(sources)}")
        changes.append((at, parts_of(ws)))
    caps = None
    if max_epochs is not None:
        if len(max_epochs) != len(sources):
            raise ValueError(f"max_epochs {list(max_epochs)!r} names {len(max_epochs)} sources; there are {len(sources)}")
        for i, m in enumerate(max_epochs):
            if m is not None:
                check_int(f"max_epochs[{i}]", m, 1, 2**40)
        caps = tuple(0 if m is None else int(m) for m in max_epochs)
    return {"sources": tuple(sources), "weights": tuple(changes), "max_epochs": caps}


def make_spec(n: int, shuffle: bool, seed: int, tail: str, permutation: str | None, partition: str, batch_size: int,
              drop_last_batch: bool, even_batches: bool, scope: str, buffer_size: int | None, pack_size: int | None,
              lengths: Sequence[int] | np.ndarray | None, max_tokens: int | None = None, cost: str = "sum",
              token_window: int = TOKEN_WINDOW, dealing: str = "static", mixture: dict[str, Any] | None = None,
              sharded: dict[str, Any] | None = None) -> Spec:
    """The spec of a sampler's (or `shards`') arguments over `n` samples, its permutation picked by its kind
    when not given; settings that do nothing beside the others are warned about.

    Raises:
        ValueError: settings that contradict each other (``shuffle=False`` with a permutation, `lengths` of the
            wrong size, `max_tokens` without `lengths`), or one the spec refuses.
    """
    check_bool("shuffle", shuffle)
    mixture = mixture or {}
    sharded = sharded or {}
    if sharded and not shuffle:
        raise ValueError("shard_sizes= asks for a shard order, which shuffles: leave shuffle=True, or drop shard_sizes= "
                         "to read in the stored order")
    if permutation is None:
        permutation = kind_for(dealing, max_tokens, bool(sharded)).permutation(shuffle, lengths is not None, bool(sharded))
    # NOTE: a seed beside shuffle=False does nothing but is not warned about: torch's sampler takes
    # both quietly, and loaders built as DistributedSampler(ds, shuffle=is_train, seed=seed) are common.
    if buffer_size is not None and permutation not in ("window", "bucket"):
        _no_effect(f"buffer_size={buffer_size!r}",
                   f"only permutation 'window' and 'bucket' have windows (got permutation={permutation!r})")
    if pack_size is not None and permutation != "bucket":
        _no_effect(f"pack_size={pack_size!r}", f"only permutation 'bucket' makes packs (got permutation={permutation!r})")
    elif not shuffle and permutation != "none":
        raise ValueError(f"shuffle=False contradicts permutation={permutation!r}; leave permutation unset or use 'none'")
    kw: dict[str, Any] = dict(seed=seed, permutation=permutation, partition=partition, tail=tail, scope=scope,
                              buffer_size=buffer_size, pack_size=pack_size, batch_size=batch_size,
                              drop_last_batch=drop_last_batch, even_batches=even_batches, max_tokens=max_tokens,
                              cost=cost, token_window=token_window, dealing=dealing, **mixture, **sharded)
    if lengths is not None:
        arr = np.asarray(lengths)
        space = sum(mixture["sources"]) if mixture else n
        if arr.size != space:
            raise ValueError(f"lengths has {arr.size} entries but the {'sources have' if mixture else 'dataset has'} "
                             f"{space} samples")
        if n == 0:
            return Spec(n=1, **{**kw, "max_tokens": None, "sources": None, "weights": None, "max_epochs": None})
        return Spec.with_lengths(arr, n=n, **kw)
    if max_tokens is not None:
        raise ValueError(f"max_tokens={max_tokens} needs lengths= (each sample's token count)")
    # NOTE: an empty dataset (N = 0) has nothing to deal: its sampler never joins, and the spec
    # of one sample only checks the other settings.
    if n == 0 and mixture:
        return Spec(n=1, **{**kw, "sources": None, "weights": None, "max_epochs": None})
    return Spec(n=max(n, 1), **kw)


def shard_fields(n: int, shard_sizes: Sequence[int] | np.ndarray | None, shard_window: int, lanes: int,
                 reader_group: int | None) -> dict[str, Any]:
    """A spec's shard-order fields (``shards``, ``shard_window``, ``lanes``, ``reader_group``) from a sampler's
    arguments; {} for no shard order.

    Args:
        shard_sizes: Each shard's sample count, in the dataset's order (they add up to its length).
        reader_group: Ranks per reader group (default: ``LOCAL_WORLD_SIZE``, a torchrun node's ranks, else 1).
    """
    if shard_sizes is None:
        if (shard_window, lanes, reader_group) != (32, 16, None):
            raise ValueError(f"shard_window, lanes and reader_group are settings of a shard order: they need "
                             f"shard_sizes= (got shard_window={shard_window}, lanes={lanes}, reader_group={reader_group})")
        return {}
    arr = np.asarray(shard_sizes)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"shard_sizes must be a non-empty 1-D sequence of ints (got dtype={arr.dtype}, shape={arr.shape})")
    if int(arr.sum()) != n:
        raise ValueError(f"shard_sizes add up to {int(arr.sum())} samples, but the dataset (its sources, for a mixture) "
                         f"has {n}")
    group = reader_group if reader_group is not None else local_world_size()
    return {"shards": arr.astype("<i8").tobytes(), "shard_window": shard_window, "lanes": lanes, "reader_group": group}


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
        even_batches: With `batch_size`: every rank gets the same number of batches.

    The other arguments are the samplers'.

    Raises:
        ValueError: a setting is out of range, or `epoch` contradicts `state`.
    """
    check_int("num_replicas", num_replicas, 1, MAX_WORLD + 1, ValueError)
    n = dataset_size(dataset)
    if batch_size is None:
        spec = make_spec(n, shuffle, seed, tail or ("drop" if drop_last else "pad"), permutation, partition, 1,
                         False, False, scope, buffer_size, pack_size, lengths)
    else:
        spec = make_spec(n, shuffle, seed, tail or "pad", permutation, partition, batch_size, drop_last, even_batches,
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


def step_schedule(spec: Spec, global_batch: int | None, rampup: Sequence[int] | None) -> Schedule:
    """The trainer's step schedule from the samplers' ``global_batch=`` and ``rampup=``.

    Raises:
        TypeError: `global_batch` is not an int, or `rampup` not three ints.
        ValueError: a value out of range (named); a global batch (or a ramp's level) that is not a
            whole number of this sampler's batches; `global_batch` with token-budget batches.
    """
    if global_batch is None:
        if rampup is not None:
            raise ValueError(f"rampup={rampup!r} needs global_batch= (the global batch it ramps up to)")
        return Schedule()
    g = check_int("global_batch", global_batch, 1, 2**62)
    ramp = None
    if rampup is not None:
        if isinstance(rampup, (str, bytes)) or not isinstance(rampup, Sequence) or len(rampup) != 3:
            raise TypeError(f"rampup must be (start, increment, steps) (got rampup={rampup!r})")
        ramp = (check_int("rampup start", rampup[0], 1, 2**62), check_int("rampup increment", rampup[1], 1, 2**62),
                check_int("rampup steps", rampup[2], 1, 2**62))
    if not sized_batches(spec):
        raise ValueError(f"global_batch={g}: token-budget batches have no fixed size, so a step is one batch of every "
                         "rank (leave global_batch and rampup unset)")
    schedule = Schedule(g, ramp)  # InvalidArgument (a ValueError) for a ramp that does not reach global_batch
    for first, _, level in schedule.levels():
        if level % spec.batch_size:
            raise ValueError(f"a global batch of {level} samples (from step {first}) is not a whole number of batches "
                             f"of batch_size={spec.batch_size}: a step takes whole batches of every rank")
    return schedule


def _no_effect(what: str, why: str) -> None:
    """Warns of a legal argument that changes nothing (pointing at the caller of the sampler's constructor)."""
    warnings.warn(f"croupier: {what} has no effect: {why}", UserWarning, stacklevel=4)


def check_sampler_args(kind: PlanKind, drop_last: bool, tail: str | None, lockstep: bool, batches: bool) -> None:
    """The samplers' own switches: bools, and the combinations that do nothing (warned)."""
    check_bool("drop_last", drop_last)
    check_bool("lockstep", lockstep)
    if not batches and drop_last and tail is not None and tail != "drop":
        _no_effect("drop_last=True", f"tail={tail!r} decides the epoch's tail")
    if kind.lockstep(lockstep) != lockstep:
        _no_effect("lockstep=False", f"it is a setting of dealing='dynamic'; a {kind.name} plan is dealt when the "
                                     "generation starts, and every rank's checkpoint is computed alike")
