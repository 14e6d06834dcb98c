"""A sampler's spec from its arguments, and every rank's share of an epoch computed in one process (`shards`)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence, Sized
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from croupier.core.api import MAX_WORLD
from croupier.core.checkpoint import from_state
from croupier.core.checks import check_bool, check_int
from croupier.core.cursor import bind, epoch_agrees, fresh, show
from croupier.core.plans import PlanKind, kind_for, plan_epoch
from croupier.core.spec import TOKEN_WINDOW, Spec


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


def _make_spec(n: int, shuffle: bool, seed: int, tail: str, permutation: str | None, partition: str, batch_size: int,
               drop_last_batch: bool, even_batches: bool, scope: str, buffer_size: int | None, pack_size: int | None,
               lengths: Sequence[int] | np.ndarray | None, max_tokens: int | None = None, cost: str = "sum",
               token_window: int = TOKEN_WINDOW, dealing: str = "static") -> Spec:
    check_bool("shuffle", shuffle)
    if permutation is None:
        permutation = kind_for(dealing, max_tokens).permutation(shuffle, lengths is not None)
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


def _no_effect(what: str, why: str) -> None:
    """Warns of a legal argument that changes nothing (pointing at the caller of the sampler's constructor)."""
    warnings.warn(f"croupier: {what} has no effect: {why}", UserWarning, stacklevel=4)


def _check_sampler_args(kind: PlanKind, drop_last: bool, tail: str | None, lockstep: bool, batches: bool) -> None:
    """The samplers' own switches: bools, and the combinations that do nothing (warned)."""
    check_bool("drop_last", drop_last)
    check_bool("lockstep", lockstep)
    if not batches and drop_last and tail is not None and tail != "drop":
        _no_effect("drop_last=True", f"tail={tail!r} decides the epoch's tail")
    if not lockstep and not kind.coordinator_deals:
        _no_effect("lockstep=False", f"it is a setting of dealing='dynamic'; a {kind.name} plan is dealt when the "
                                     "generation starts, and every rank's checkpoint is computed alike")
