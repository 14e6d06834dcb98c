"""Epoch orders: pure maps from positions in [0, n) to dataset indices, one per permutation kind."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from croupier.core import feistel as _feistel
from croupier.core import mixture as _mixture
from croupier.core import shards as _shards
from croupier.core import stream as _stream
from croupier.core.spec import PERMUTATIONS, Spec

# A permutation maps (spec, epoch, positions, windows) -> indices. `windows` is the list of
# window boundaries the shuffle must stay inside: [0, n] for a global shuffle, or the
# rank parts' boundaries for scope="rank" (split first, then shuffle each part).
Permutation = Callable[[Spec, int, np.ndarray, np.ndarray], np.ndarray]


def _identity(spec: Spec, epoch: int, positions: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    return positions.astype(np.int64, copy=True)


@functools.lru_cache(maxsize=2)
def _torch_randperm(n: int, seed: int) -> np.ndarray:
    import torch

    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randperm(n, generator=g).numpy()


def _torch(spec: Spec, epoch: int, positions: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    # NOTE: bit-exact with torch's DistributedSampler, which seeds with seed + epoch. This is
    # the one order that is not random access: the whole randperm is built (and cached).
    out: np.ndarray = _torch_randperm(spec.n, spec.seed + epoch)[positions]
    return out


def _windowed(spec: Spec, positions: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each position: its part number, and the start and size of its shuffle window."""
    part = np.searchsorted(bounds, positions, side="right") - 1  # (len,)
    part_start = bounds[part]
    part_end = bounds[part + 1]
    buf = spec.buffer_size
    if buf is None or spec.permutation == "feistel":
        return part, part_start, part_end - part_start
    w_start = part_start + (positions - part_start) // buf * buf
    w_size = np.minimum(w_start + buf, part_end) - w_start
    return part, w_start, w_size


def _keyed_shuffle(spec: Spec, epoch: int, positions: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    part, w_start, w_size = _windowed(spec, positions, bounds)
    out = np.empty(positions.shape, dtype=np.int64)
    # Group by window: a batch touches one or two windows, a whole epoch a few hundred.
    starts, inverse = np.unique(w_start, return_inverse=True)
    for k, start in enumerate(starts):
        sel = inverse == k
        size = int(w_size[sel][0])
        key = _window_key(spec.seed, epoch, int(part[sel][0]), int(start))
        out[sel] = start + _feistel.permute(positions[sel] - start, size, _feistel.round_keys(key))
    return out


@functools.lru_cache(maxsize=256)
def _window_key(seed: int, epoch: int, part: int, start: int) -> int:
    return _feistel.derive_key(seed, epoch, part, start)


def _feistel_global(spec: Spec, epoch: int, positions: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    if len(bounds) == 2:  # one window: the fast path, no grouping
        key = _window_key(spec.seed, epoch, 0, 0)
        return _feistel.permute(positions, spec.n, _feistel.round_keys(key))
    return _keyed_shuffle(spec, epoch, positions, bounds)


#: Tells the bucket pack shuffle's keys apart from every other key croupier derives: the window
#: keys pass four parts below 2**64 (seed, epoch, part, start) and the round keys two, while the
#: pack keys pass this tag, which is above 2**64 (the bytes of "croupier/bucket"), as their fourth.
_BUCKET_TAG = int.from_bytes(b"croupier/bucket", "little")


@functools.lru_cache(maxsize=64)
def _bucket_window(spec: Spec, epoch: int, start: int) -> np.ndarray:
    """d9d's five steps for the window starting at `start`, keyed by (seed, epoch, window).

    1. the window's positions [start, start + buffer_size); 2. sorted by key; 3. cut into packs
    of pack_size; 4. the packs shuffled; 5. laid end to end.

    Both steps that order things are croupier's own, defined by this code on every machine and
    numpy build: the sort is a stable sort by key, ties by index (the total order of the pairs
    (key, index), what Python's ``sorted`` gives; numpy documents ``kind="stable"`` as stable),
    and the pack shuffle is the Feistel bijection of :mod:`croupier.core.feistel` on
    [0, number of packs), keyed by (seed, epoch, window number, bucket tag).
    """
    assert spec.buffer_size is not None and spec.pack_size is not None  # checked by Spec
    end = min(start + spec.buffer_size, spec.n)
    keys = spec.sort_keys[start:end]
    local = np.argsort(keys, kind="stable")  # sorted by key, ties by index
    packs = [local[i : i + spec.pack_size] for i in range(0, len(local), spec.pack_size)]
    num_packs = len(packs)
    key = _feistel.derive_key(spec.seed, epoch, start // spec.buffer_size, _BUCKET_TAG)
    order = _feistel.permute(np.arange(num_packs, dtype=np.int64), num_packs, _feistel.round_keys(key))
    return start + np.concatenate([packs[i] for i in order.tolist()]).astype(np.int64)


def _bucket(spec: Spec, epoch: int, positions: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    assert spec.buffer_size is not None
    buf = spec.buffer_size
    out = np.empty(positions.shape, dtype=np.int64)
    w_start = positions // buf * buf
    for start in np.unique(w_start):
        sel = w_start == start
        out[sel] = _bucket_window(spec, epoch, int(start))[positions[sel] - start]
    return out


def _shard_order(spec: Spec, epoch: int, positions: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    return _shards.order_positions(spec, epoch, positions)


def stream_of(spec: Spec) -> _stream.Stream:
    """The stream of a mixture's spec (``spec.sources`` set)."""
    assert spec.sources is not None and spec.weights is not None  # checked by the caller
    orders = _shards.source_orders(spec) if spec.shards is not None else ()
    return _stream.stream(spec.sources, spec.weights, spec.max_epochs or (), spec.seed, spec.permutation == "feistel",
                          spec.amendments or (), orders)


def mixture_order(spec: Spec, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dataset index, source, source epoch) of positions of a mixture's `epoch`: stream positions ``epoch * n + p``."""
    last = (epoch + 1) * spec.n - 1
    if last > _mixture.MAX_POSITION:
        raise ValueError(f"epoch {epoch} of {spec.n} samples ends at stream position {last}, past the mixture's "
                         f"last {_mixture.MAX_POSITION}")
    return stream_of(spec).indices(positions + epoch * spec.n)


#: The kernel of each order, by its name in ``croupier.core.spec.PERMUTATIONS`` (the one list of names).
KERNELS: dict[str, Permutation] = {
    "none": _identity,
    "torch": _torch,
    "feistel": _feistel_global,
    "window": _keyed_shuffle,
    "bucket": _bucket,
    "shards": _shard_order,
}

if tuple(KERNELS) != PERMUTATIONS:  # pragma: no cover - a kernel added here must be named in spec.py, and the other way round
    raise ImportError(f"croupier.core.permute has kernels {list(KERNELS)} but the spec names {list(PERMUTATIONS)}")


def position_of(spec: Spec, epoch: int, index: int) -> int | None:
    """The position of dataset index `index` in `epoch`'s order, for the orders whose inverse is at hand
    in O(1): ``none`` and ``feistel`` over one window of the whole epoch. None for the others (their
    inverse costs the order of a window or of the epoch)."""
    if spec.sources is not None or spec.scope != "global":
        return None
    if spec.permutation == "none":
        return index
    if spec.permutation == "feistel" and spec.buffer_size is None:
        keys = _feistel.round_keys(_window_key(spec.seed, epoch, 0, 0))
        return int(_feistel.unpermute(np.array([index], dtype=np.int64), spec.n, keys)[0])
    return None
