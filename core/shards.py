"""Shard-local orders: an epoch read shard by shard, in windows of shards whose samples are shuffled together.

A dataset in shards (parquet files or row groups, webdataset tars, MDS shards) is numbered as
``ConcatDataset`` numbers its parts: shard ``s`` holds indices ``offsets[s] .. offsets[s] + sizes[s] - 1``.
This module is the order, a pure function:

The order (:func:`order_positions`, the ``shards`` permutation)
    Epoch ``e``'s shards are put in a keyed order (a Feistel bijection of [0, S)), cut into
    **windows** of ``spec.shard_window`` consecutive shards, and the samples of each window are
    permuted by a keyed Feistel bijection of the window's samples. Position ``p`` of the epoch is
    found in O(log S) (two binary searches over the epoch's table) with O(S) memory: 16 bytes a
    shard (each slot's first index and the running sample count), no O(N) array anywhere.

How a generation deals the positions of this order is a way of dealing of its own:
:mod:`croupier.core.shard_layout` (static dealing: each reader group its own pieces, read by
``spec.lanes`` heads), :mod:`croupier.core.shard_deals` (dynamic dealing: the coordinator hands a
reader group whole windows, then rows), or the token plan of :mod:`croupier.core.tokens` (token
budgets over this order's positions; docs/orders.md states what that costs in locality).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from croupier.core import feistel as _feistel
from croupier.core.spec import Spec

__all__ = ["ShardOrder", "order_positions", "shard_of", "shard_sizes", "source_orders"]

#: Tells the shard order's keys apart from every other key croupier derives (the bytes of "croupier/shards").
_SHARD_TAG = int.from_bytes(b"croupier/shards", "little")
_WINDOW_TAG = _SHARD_TAG + 1
_SOURCE_TAG = _SHARD_TAG + 2


# --------------------------------------------------------------------------- the order


def shard_sizes(spec: Spec) -> np.ndarray:
    """The samples of each shard, in the dataset's order; (S,) int64."""
    assert spec.shards is not None  # checked by Spec
    return np.frombuffer(spec.shards, dtype="<i8")


@functools.lru_cache(maxsize=128)  # one a dataset, or a sharded source of a mixture
def _offsets(sizes: bytes) -> np.ndarray:
    """Each shard's first index; (S + 1,) with the total last."""
    out = np.zeros(len(sizes) // 8 + 1, dtype=np.int64)
    np.cumsum(np.frombuffer(sizes, dtype="<i8"), out=out[1:])
    out.flags.writeable = False
    return out


def shard_of(spec: Spec, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(shard, row) of dataset indices."""
    idx = np.asarray(indices, dtype=np.int64)
    off = _offsets(spec.shards or b"")
    shard = np.searchsorted(off, idx, side="right") - 1
    return shard, idx - off[shard]


@dataclasses.dataclass(frozen=True)
class ShardOrder:
    """The shard order of one dataset (or one source of a mixture): shards in a keyed order each epoch,
    windows of `window` shards, each window's samples in a keyed order. A pure bijection of [0, n)
    an epoch, with its inverse."""

    sizes: bytes  # each shard's sample count, little-endian int64
    seed: int
    window: int

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The indices (numbered within this dataset) of positions of `epoch`'s order.

        A position's window is found by binary search, its place in the window by the window's keyed
        Feistel bijection, and its slot (a shard in the epoch's order) by a second binary search.
        """
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size == 0:
            return np.zeros(pos.shape, dtype=np.int64)
        first, cum = _epoch_table(self, epoch)
        w, s = self.window, first.size
        win = np.searchsorted(cum[::w], pos, side="right") - 1  # (len,) each position's window
        lo = cum[win * w]
        size = cum[np.minimum(win * w + w, s)] - lo  # (len,) samples of each position's window
        out = np.empty(pos.shape, dtype=np.int64)
        # NOTE: windows of one size share a Feistel domain: one pass with a key per element covers them
        # all (a batch touches about one window per reading head).
        one_size = size.min() == size.max()
        for n in ([int(size.flat[0])] if one_size else np.unique(size).tolist()):
            sel = slice(None) if one_size else size == n
            q = lo[sel] + _feistel.permute(pos[sel] - lo[sel], int(n), self._keys(epoch, win[sel]))
            slot = np.searchsorted(cum, q, side="right") - 1
            out[sel] = first[slot] + (q - cum[slot])
        return out

    def positions(self, epoch: int, indices: np.ndarray) -> np.ndarray:
        """The inverse of :meth:`indices`: the positions of `epoch`'s order that hold `indices`."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size == 0:
            return np.zeros(idx.shape, dtype=np.int64)
        off = _offsets(self.sizes)
        s = off.size - 1
        shard = np.searchsorted(off, idx, side="right") - 1
        slot = _feistel.unpermute(shard, s, _feistel.round_keys(self._shard_key(epoch)))  # inverse shard order
        _, cum = _epoch_table(self, epoch)
        win = slot // self.window
        lo = cum[win * self.window]
        size = cum[np.minimum(win * self.window + self.window, s)] - lo
        q = cum[slot] + (idx - off[shard]) - lo  # the place in the window, after its shuffle
        out = np.empty(idx.shape, dtype=np.int64)
        for n in np.unique(size).tolist():
            sel = size == n
            out[sel] = lo[sel] + _feistel.unpermute(q[sel], int(n), self._keys(epoch, win[sel], full=True))
        return out

    def window_starts(self, epoch: int) -> np.ndarray:
        """The first position of each of `epoch`'s windows, ascending; (ceil(S / window),)."""
        starts: np.ndarray = _epoch_table(self, epoch)[1][:-1:self.window]
        return starts

    def _shard_key(self, epoch: int) -> int:
        return _feistel.derive_key(self.seed, epoch, _SHARD_TAG)

    def _keys(self, epoch: int, wins: np.ndarray, full: bool = False) -> np.ndarray:
        """The round keys of each element's window: (ROUNDS,) when one window (unless `full`), else (ROUNDS, len)."""
        uniq, inv = _distinct(wins)
        keys = np.stack([_window_keys(self.seed, epoch, int(k)) for k in uniq.tolist()], axis=1)  # (ROUNDS, windows)
        return keys[:, 0] if uniq.size == 1 and not full else keys[:, inv]


# NOTE: one table a dataset and epoch in use: a mixture of sharded sources holds one a source (16 bytes a
# shard; a single dataset of 1e5 shards: 1.6 MB), and a lease of a mixture touches every source.
@functools.lru_cache(maxsize=128)
def _epoch_table(order: ShardOrder, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """The epoch's shards in their keyed order: each slot's first index (S,) and the samples before each
    slot (S + 1,). 16 bytes a shard."""
    sizes = np.frombuffer(order.sizes, dtype="<i8")
    s = sizes.size
    perm = _feistel.permute(np.arange(s, dtype=np.int64), s, _feistel.round_keys(order._shard_key(epoch)))  # (S,)
    first = _offsets(order.sizes)[:-1][perm]  # (S,) the first index of each slot's shard
    cum = np.zeros(s + 1, dtype=np.int64)
    np.cumsum(sizes[perm], out=cum[1:])
    first.flags.writeable = False
    cum.flags.writeable = False
    return first, cum


def order_positions(spec: Spec, epoch: int, positions: np.ndarray) -> np.ndarray:
    """Dataset indices of positions of `epoch`'s shard order (the ``shards`` permutation's kernel)."""
    assert spec.shards is not None  # checked by Spec
    return ShardOrder(spec.shards, spec.seed, spec.shard_window).indices(epoch, positions)


def source_orders(spec: Spec) -> tuple[ShardOrder, ...]:
    """Each source's shard order, for a mixture over sharded sources: its shards (the sources' sizes
    cut the spec's shards, as ``ConcatDataset`` numbers them) and a seed of its own."""
    assert spec.shards is not None and spec.sources is not None  # checked by Spec
    sizes = shard_sizes(spec)
    cut = np.searchsorted(_offsets(spec.shards), np.cumsum([0, *spec.sources]))  # (sources + 1,) shard bounds
    return tuple(ShardOrder(sizes[a:b].astype("<i8").tobytes(), _feistel.derive_key(spec.seed, k, _SOURCE_TAG),
                            spec.shard_window) for k, (a, b) in enumerate(zip(cut[:-1].tolist(), cut[1:].tolist())))


def _distinct(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct values, sorted; each value's place among them) of a flat int array."""
    flat = values.reshape(-1)
    lo, hi = int(flat.min()), int(flat.max())
    if hi - lo <= 4 * flat.size + 64:  # a narrow range (a lease's windows): a table beats sorting
        seen = np.zeros(hi - lo + 1, dtype=bool)
        seen[flat - lo] = True
        uniq = np.flatnonzero(seen)
        place = np.zeros(hi - lo + 1, dtype=np.int64)
        place[uniq] = np.arange(uniq.size)
        return uniq + lo, place[flat - lo]
    uniq, inv = np.unique(flat, return_inverse=True)
    return uniq, inv.reshape(-1)


@functools.lru_cache(maxsize=4096)
def _window_keys(seed: int, epoch: int, window: int) -> np.ndarray:
    return _feistel.round_keys(_feistel.derive_key(seed, epoch, window, _WINDOW_TAG))
