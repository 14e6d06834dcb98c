"""Shard-local orders: an epoch read shard by shard, in windows of shards whose samples are shuffled together.

A dataset in shards (parquet files or row groups, webdataset tars, MDS shards) is numbered as
``ConcatDataset`` numbers its parts: shard ``s`` holds indices ``offsets[s] .. offsets[s] + sizes[s] - 1``.
This module is the order, a pure function:

The order (:func:`order_positions`, the ``shards`` permutation)
    Epoch ``e``'s shards are put in a keyed order (a Feistel bijection of [0, S)), cut into
    **windows** of ``spec.shard_window`` consecutive shards, and the samples of each window are
    permuted by a keyed Feistel bijection of the window's samples. Position ``p`` of the epoch is
    found in O(log S) (two binary searches over the epoch's table) with O(S) memory: each slot's
    first index and the running sample count, 8 bytes a shard below 2**32 samples (uint32), 16
    above; no O(N) array anywhere. One position takes a plain-Python path (:meth:`ShardOrder.index`),
    many a vectorised one; both are the same bijection.

How a generation deals the positions of this order is a way of dealing of its own:
:mod:`croupier.core.shard_layout` (static dealing: each reader group its own pieces, read by
``spec.lanes`` heads), :mod:`croupier.core.shard_deals` (dynamic dealing: the coordinator hands a
reader group whole windows, then rows), or the token plan of :mod:`croupier.core.tokens` (token
budgets over this order's positions; docs/orders.md states what that costs in locality).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from croupier.core import feistel as _feistel
from croupier.core.spec import Spec

if TYPE_CHECKING:
    from croupier.core.cursor import Cursor

__all__ = ["ShardOrder", "consumed_rows", "has_own_shard_order", "order_positions", "shard_of", "shard_sizes",
           "source_orders"]

#: Tells the shard order's keys apart from every other key croupier derives (the bytes of "croupier/shards").
_SHARD_TAG = int.from_bytes(b"croupier/shards", "little")
_WINDOW_TAG = _SHARD_TAG + 1
_SOURCE_TAG = _SHARD_TAG + 2


# --------------------------------------------------------------------------- the order


def shard_sizes(spec: Spec) -> np.ndarray:
    """The samples of each shard, in the dataset's order; (S,) int64."""
    assert spec.shards is not None  # checked by Spec
    return np.frombuffer(spec.shards, dtype="<i8")


def _dtype(total: int) -> np.dtype[Any]:
    """The narrowest of uint32 and int64 holding [0, `total`]: a shard's table costs half below 2**32 samples."""
    return np.dtype(np.uint32 if total < 2**32 else np.int64)


@functools.lru_cache(maxsize=128)  # one a dataset, or a sharded source of a mixture
def _offsets(sizes: bytes) -> np.ndarray:
    """Each shard's first index; (S + 1,) with the total last, in :func:`_dtype` of the total."""
    counts = np.frombuffer(sizes, dtype="<i8")
    out = np.zeros(counts.size + 1, dtype=_dtype(int(counts.sum())))
    np.cumsum(counts, out=out[1:], dtype=out.dtype)
    out.flags.writeable = False
    return out


def shard_of(spec: Spec, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(shard, row) of dataset indices."""
    idx = np.asarray(indices, dtype=np.int64)
    off = _offsets(spec.shards or b"")
    shard = np.searchsorted(off, idx.astype(off.dtype), side="right") - 1  # the table's dtype: no O(S) cast
    return shard, idx - off[shard].astype(np.int64)


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
        Feistel bijection, and its slot (a shard in the epoch's order) by a second binary search. One
        position takes :meth:`index` (plain Python: numpy's per-call cost is most of the work).
        """
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size == 0:
            return np.zeros(pos.shape, dtype=np.int64)
        if pos.size == 1:
            return np.full(pos.shape, self.index(epoch, int(pos.flat[0])), dtype=np.int64)
        table = _epoch_table(self, epoch)
        flat = pos.reshape(-1)
        win = np.searchsorted(table.wins, flat, side="right") - 1  # (len,) each position's window
        lo = table.wins[win]
        size = table.wins[win + 1] - lo  # (len,) samples of each position's window
        # NOTE: windows of one size share a Feistel domain: one pass with a key per element covers them
        # all (a batch touches about one window per reading head).
        q = np.empty(flat.shape, dtype=np.int64)  # (len,) each position's place in the epoch after its window's shuffle
        one_size = size.min() == size.max()
        for n in ([int(size[0])] if one_size else np.unique(size).tolist()):
            sel = slice(None) if one_size else size == n
            q[sel] = lo[sel] + _feistel.permute(flat[sel] - lo[sel], int(n), self._keys(epoch, win[sel]))
        slot = np.searchsorted(table.cum, q.astype(table.cum.dtype), side="right") - 1  # (len,) each one's slot
        out: np.ndarray = (table.first[slot] + (q - table.cum[slot])).astype(np.int64, copy=False)
        return out.reshape(pos.shape)

    def index(self, epoch: int, position: int) -> int:
        """:meth:`indices` of one position, in plain Python: the same bijection (O(log S), no numpy call)."""
        table = _epoch_table(self, epoch)
        wins, cum = table.wins_at, table.cum_at
        win = bisect.bisect_right(wins, position) - 1
        lo = wins[win]
        n = wins[win + 1] - lo
        q = lo if n == 1 else lo + _feistel.walk_one(position - lo, n, _window_rounds(self.seed, epoch, win, n))
        slot = bisect.bisect_right(cum, q) - 1
        return int(table.first_at[slot] + (q - cum[slot]))

    def positions(self, epoch: int, indices: np.ndarray) -> np.ndarray:
        """The inverse of :meth:`indices`: the positions of `epoch`'s order that hold `indices`."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size == 0:
            return np.zeros(idx.shape, dtype=np.int64)
        off = _offsets(self.sizes)
        s = off.size - 1
        shard = np.searchsorted(off, idx.astype(off.dtype), side="right") - 1
        slot = _feistel.unpermute(shard, s, _feistel.round_keys(self._shard_key(epoch)))  # inverse shard order
        table = _epoch_table(self, epoch)
        win = slot // self.window
        lo = table.wins[win]
        size = table.wins[win + 1] - lo
        q = table.cum[slot] + (idx - off[shard]) - lo  # the place in the window, after its shuffle
        out = np.empty(idx.shape, dtype=np.int64)
        for n in np.unique(size).tolist():
            sel = size == n
            out[sel] = lo[sel] + _feistel.unpermute(q[sel], int(n), self._keys(epoch, win[sel], full=True))
        return out

    def window_starts(self, epoch: int) -> np.ndarray:
        """The first position of each of `epoch`'s windows, ascending; (ceil(S / window),)."""
        starts: np.ndarray = _epoch_table(self, epoch).wins[:-1]
        return starts

    def _shard_key(self, epoch: int) -> int:
        return _feistel.derive_key(self.seed, epoch, _SHARD_TAG)

    def _keys(self, epoch: int, wins: np.ndarray, full: bool = False) -> np.ndarray:
        """The round keys of each element's window: (ROUNDS,) when one window (unless `full`), else (ROUNDS, len)."""
        uniq, inv = _distinct(wins)
        keys = np.stack([_window_keys(self.seed, epoch, int(k)) for k in uniq.tolist()], axis=1)  # (ROUNDS, windows)
        return keys[:, 0] if uniq.size == 1 and not full else keys[:, inv]


@dataclasses.dataclass(frozen=True)
class _Table:
    """One epoch of one shard order: its shards in their keyed order (slots) and its windows.

    Held: ``first`` and ``cum`` (a shard each), in the narrowest of uint32 and int64 that holds the
    dataset's total (8 bytes a shard below 2**32 samples, 16 above), and ``wins`` (int64, a window
    each). The ``*_at`` views read them as Python ints (for :meth:`ShardOrder.index`), copying nothing.
    """

    first: np.ndarray  # (S,) the first index of each slot's shard
    cum: np.ndarray  # (S + 1,) the samples before each slot
    wins: np.ndarray  # (W + 1,) the samples before each window (cum at every window's first slot), the total last
    first_at: memoryview
    cum_at: memoryview
    wins_at: memoryview


# NOTE: one table a dataset and epoch in use: a mixture of sharded sources holds one a source (8 bytes a
# shard below 2**32 samples; a single dataset of 1e5 shards: 0.8 MB), and a lease of a mixture touches
# every source.
@functools.lru_cache(maxsize=128)
def _epoch_table(order: ShardOrder, epoch: int) -> _Table:
    """The epoch's shards in their keyed order: each slot's first index and the samples before each slot."""
    sizes = np.frombuffer(order.sizes, dtype="<i8")
    s = sizes.size
    perm = _feistel.permute(np.arange(s, dtype=np.int64), s, _feistel.round_keys(order._shard_key(epoch)))  # (S,)
    off = _offsets(order.sizes)
    first = off[:-1][perm]  # (S,) the first index of each slot's shard, in the offsets' dtype
    cum = np.zeros(s + 1, dtype=off.dtype)
    np.cumsum(sizes[perm], out=cum[1:], dtype=off.dtype)
    del perm
    wins = np.append(cum[:-1:order.window], cum[-1]).astype(np.int64)  # (W + 1,)
    for a in (first, cum, wins):
        a.flags.writeable = False
    return _Table(first, cum, wins, first.data, cum.data, wins.data)


def order_positions(spec: Spec, epoch: int, positions: np.ndarray) -> np.ndarray:
    """Dataset indices of positions of `epoch`'s shard order (the ``shards`` permutation's kernel)."""
    assert spec.shards is not None  # checked by Spec
    return ShardOrder(spec.shards, spec.seed, spec.shard_window).indices(epoch, positions)


def has_own_shard_order(spec: Spec) -> bool:
    """Whether `spec` deals one dataset in a shard order of its own: shard sizes, the ``shards`` permutation, no
    mixture (a mixture's positions are the mixture's, not one dataset's)."""
    return spec.shards is not None and spec.permutation == "shards" and spec.sources is None


def consumed_rows(spec: Spec, cursor: Cursor) -> np.ndarray:
    """The rows of each shard that `cursor`'s epoch consumed: its positions outside ``cursor.remaining``,
    counted by the shard that holds them; (S,) int64, in the dataset's shard order.

    A window with no position left counts its shards whole and one with every position left counts
    none; only the windows the cursor cuts have positions mapped, each on its smaller side (its
    consumed positions, or those left), a window at a time by its own keyed bijection. Cost O(S +
    half the samples of the windows the cursor cuts, at most): a cursor of a generation cuts about
    ``lanes`` windows a reader group.

    Raises:
        ValueError: `spec` has no shard order of its own (no ``shards``, another permutation, or a
            mixture, whose positions are the mixture's).
    """
    shards = spec.shards
    if shards is None or not has_own_shard_order(spec):  # (the first test narrows the type)
        raise ValueError(f"consumed_rows needs a spec with a shard order over one dataset (got permutation="
                         f"{spec.permutation!r}, shards={'set' if spec.shards else None}, sources={spec.sources!r})")
    order = ShardOrder(shards, spec.seed, spec.shard_window)
    table = _epoch_table(order, cursor.epoch)
    off = _offsets(shards)
    sizes = shard_sizes(spec)
    rem = np.array(cursor.remaining, dtype=np.int64).reshape(-1, 2)  # (intervals, 2) sorted, disjoint
    if rem.size == 0:
        return sizes.astype(np.int64)  # the epoch consumed whole
    before = np.concatenate([[0], np.cumsum(rem[:, 1] - rem[:, 0])])  # (intervals + 1,) positions left before each

    def left_below(x: np.ndarray) -> np.ndarray:
        """Positions of `remaining` below each of `x`."""
        k = np.searchsorted(rem[:, 0], x, side="right") - 1  # (len,) the last interval starting at or below x
        j = np.maximum(k, 0)
        got: np.ndarray = np.where(k >= 0, before[j] + np.minimum(x - rem[j, 0], rem[j, 1] - rem[j, 0]), 0)
        return got

    wins = table.wins  # (W + 1,)
    left = left_below(wins[1:]) - left_below(wins[:-1])  # (W,) positions left in each window
    span = wins[1:] - wins[:-1]
    cut = (left > 0) & (left < span)
    # NOTE: a window the cursor cuts is walked on its smaller side: its consumed runs, or its runs left
    # (counted off the window's shards counted whole)
    by_left = cut & (2 * left < span)  # (W,)
    slot_shard = np.searchsorted(off, table.first, side="right") - 1  # (S,) the shard in each slot
    out = np.zeros(sizes.size, dtype=np.int64)
    whole = np.repeat((left == 0) | by_left, order.window)[:sizes.size]  # (S,) the slots counted whole
    out[slot_shard[whole]] = sizes[slot_shard[whole]]
    gaps = np.stack([np.concatenate([[0], rem[:, 1]]), np.concatenate([rem[:, 0], wins[-1:]])], axis=1)
    for runs_of, windows, sign in ((gaps, cut & ~by_left, 1), (rem, by_left, -1)):
        for w in np.flatnonzero(windows).tolist():
            lo, hi = int(wins[w]), int(wins[w + 1])
            k = int(np.searchsorted(runs_of[:, 1], lo, side="right"))  # the first run ending past lo
            local = []
            while k < runs_of.shape[0] and runs_of[k, 0] < hi:
                local.append(np.arange(max(lo, int(runs_of[k, 0])), min(hi, int(runs_of[k, 1])), dtype=np.int64) - lo)
                k += 1
            # the window's places of those positions (its keyed bijection), then their slots among its shards
            q = lo + _feistel.permute(np.concatenate(local), hi - lo, _window_keys(order.seed, cursor.epoch, w))
            slots = table.cum[w * order.window:(w + 1) * order.window + 1].astype(np.int64)  # (shards + 1,)
            counts = np.bincount(np.searchsorted(slots, q, side="right") - 1, minlength=slots.size - 1)
            out[slot_shard[w * order.window:w * order.window + counts.size]] += sign * counts
    return out


def source_orders(spec: Spec) -> tuple[ShardOrder, ...]:
    """Each source's shard order, for a mixture over sharded sources: its shards (the sources' sizes
    cut the spec's shards, as ``ConcatDataset`` numbers them) and a seed of its own."""
    assert spec.shards is not None and spec.sources is not None  # checked by Spec
    sizes = shard_sizes(spec)
    off = _offsets(spec.shards)
    cut = np.searchsorted(off, np.cumsum([0, *spec.sources]).astype(off.dtype))  # (sources + 1,) shard bounds
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


@functools.lru_cache(maxsize=4096)
def _window_rounds(seed: int, epoch: int, window: int, n: int) -> tuple[tuple[tuple[int, int, int, int], int], ...]:
    """The rounds of a window of `n` samples for :func:`croupier.core.feistel.walk_one` (the scalar path's)."""
    return _feistel.rounds(n, tuple(int(k) for k in _window_keys(seed, epoch, window)))
