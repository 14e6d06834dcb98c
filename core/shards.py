"""Shard-local orders: an epoch read shard by shard, in windows, each reader group from its own part.

A dataset in shards (parquet files or row groups, webdataset tars, MDS shards) is numbered as
``ConcatDataset`` numbers its parts: shard ``s`` holds indices ``offsets[s] .. offsets[s] + sizes[s] - 1``.
This module is one way of dealing, in two pure parts:

The order (:func:`order_positions`, the ``shards`` permutation)
    Epoch ``e``'s shards are put in a keyed order (a Feistel bijection of [0, S)), cut into
    **windows** of ``spec.shard_window`` consecutive shards, and the samples of each window are
    permuted by a keyed Feistel bijection of the window's samples. Position ``p`` of the epoch is
    found in O(log S) (two binary searches over the epoch's table) with O(S) memory: 16 bytes a
    shard (each slot's first index and the running sample count), no O(N) array anywhere.

The layout (:class:`ShardLayout`, how a generation deals the positions left)
    Ranks form **reader groups** of ``spec.reader_group`` consecutive ranks (a node's ranks by
    default: they share a cache). Each group takes its own **pieces** of what is left of the epoch
    and reads each piece from both of its ends inward, ``spec.lanes`` reading heads at a time, so a
    group holds about ``lanes`` windows at once and a shard is fetched by one group per epoch. The
    pieces follow the cursor: an interval the job left unconsumed is a piece whose two ends are the
    heads that were being read, so a restart, a resize or a rollback carries on from the windows the
    groups held, and only the shares that must move to balance the new groups are cut.

Everything the plan needs is the fixed-size plan's (:class:`croupier.core.order.FixedPlan`, which
takes this layout in place of its stripes): counts, tails, padding, ``advance``. The layout is a
bijection between the ranks' local positions and the generation's virtual positions ``[0, T)``, and
:meth:`ShardLayout.virtual_left` gives back exactly the virtual positions no rank consumed, which is
what keeps the cursor topology-free.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from croupier.core import feistel as _feistel
from croupier.core.cursor import Interval, _merge
from croupier.core.spec import Spec

__all__ = ["ShardLayout", "ShardOrder", "order_positions", "shard_layout", "shard_of", "shard_sizes", "source_orders"]

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


# --------------------------------------------------------------------------- the layout


@dataclasses.dataclass(frozen=True)
class _Group:
    """One reader group's share: its half-lanes (each a run of virtual positions read from one end)
    and the reading slots that take them in turn."""

    ranks: int  # L_g: ranks in the group
    first_rank: int
    size: int  # n_g: virtual positions the group reads
    real: int  # of which the first `real` of its stream are positions of the order; the rest are padding
    pad_start: int  # the virtual position of its first pad (padding is read last: each rank's last position)
    hl_head: np.ndarray  # (H,) the virtual position each half-lane reads first
    hl_dir: np.ndarray  # (H,) +1 (upward) or -1 (downward)
    hl_len: np.ndarray  # (H,)
    hl_flat: np.ndarray  # (H + 1,) each half-lane's start in the slots laid end to end (slot-major)
    slot_len: np.ndarray  # (K,) X_s: positions each slot reads
    slot_base: np.ndarray  # (K + 1,) each slot's start in the slots laid end to end
    # round-robin phases: phase p covers rounds x_(p) .. x_(p+1) - 1 with the slots longer than x_(p)
    phase_x: np.ndarray  # (K,) sorted slot lengths, from 0: x_(0) = 0, x_(1), ...
    phase_c: np.ndarray  # (K,) group positions before phase p
    phase_active: tuple[np.ndarray, ...]  # slot ids (ascending) taking part in phase p
    phase_n: np.ndarray  # (K,) how many take part in phase p
    phase_table: np.ndarray  # (K, K) phase_active laid out as rows (padded)

    # ---------------------------------------------------------------- u (group stream) <-> virtual

    def slot_offset(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot, offset in slot) of group stream positions `u` in [0, size)."""
        p = np.searchsorted(self.phase_c, u, side="right") - 1  # (len,)
        active = self.phase_n[p]
        d = u - self.phase_c[p]
        t = self.phase_x[p] + d // active
        i = d % active
        return self.phase_table[p, i], t

    def stream(self, slot: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Inverse of :meth:`slot_offset`: the group stream position of offset `t` of `slot`."""
        x = self.slot_len
        srt = np.sort(x)
        p = np.searchsorted(srt, t, side="right")  # slots shorter than or as long as t: phase p
        u = np.empty(t.shape, dtype=np.int64)
        for q in np.unique(p).tolist():
            sel = p == q
            act = self.phase_active[q]
            u[sel] = self.phase_c[q] + (t[sel] - self.phase_x[q]) * act.size + np.searchsorted(act, slot[sel])
        return u

    def virtual(self, u: np.ndarray) -> np.ndarray:
        """Virtual positions of group stream positions `u`."""
        pad = u >= self.real
        if pad.any():
            out = np.empty(u.shape, dtype=np.int64)
            out[pad] = self.pad_start + u[pad] - self.real
            out[~pad] = self.virtual(u[~pad])
            return out
        slot, t = self.slot_offset(u)
        flat = self.slot_base[slot] + t
        h = np.searchsorted(self.hl_flat, flat, side="right") - 1
        got: np.ndarray = self.hl_head[h] + self.hl_dir[h] * (flat - self.hl_flat[h])
        return got

    def consumed_per_slot(self, u_end: int) -> np.ndarray:
        """How many positions of each slot the group stream positions [0, u_end) read; (K,)."""
        if u_end >= self.real:
            whole: np.ndarray = self.slot_len.copy()
            return whole
        slot, t = self.slot_offset(np.array([u_end], dtype=np.int64))
        t0 = int(t[0])
        out: np.ndarray = np.minimum(self.slot_len, t0)
        # the slots before `slot` in round t0 have read their position t0 too
        p = int(np.searchsorted(self.phase_c, u_end, side="right") - 1)
        act = self.phase_active[p]
        before = act[act < int(slot[0])]
        out[before] += 1
        return out


def _phases(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...]]:
    """Round-robin phases over slots of lengths `x`: each round every slot with positions left reads one."""
    k = x.size
    srt = np.sort(x)
    px = np.concatenate([[0], srt[:-1]]).astype(np.int64)  # (K,) x_(p): rounds before phase p
    below = np.concatenate([[0], np.cumsum(srt)[:-1]]).astype(np.int64)  # sum of the p shortest
    pc = below + (k - np.arange(k, dtype=np.int64)) * px
    active = tuple(np.flatnonzero(x > px[p]).astype(np.int64) for p in range(k))
    return px, pc, active


def _table(rows: tuple[np.ndarray, ...], k: int) -> np.ndarray:
    """Rows of up to `k` ints as one (len(rows), k) array (padded with 0)."""
    out = np.zeros((len(rows), k), dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, :row.size] = row
    return out


def _pieces(cum: np.ndarray, left: int, t: int) -> list[tuple[int, int]]:
    """The virtual runs to deal: the cursor's intervals laid end to end (each a piece with two heads),
    cut at T (the padding past R, when T > R, is dealt apart: last)."""
    d = min(left, t)
    out = []
    for a, b in zip(cum[:-1].tolist(), cum[1:].tolist()):
        b = min(b, d)
        if a < b:
            out.append((a, b))
    return out


def _balance(pieces: list[tuple[int, int]], need: list[int], half: int) -> list[list[tuple[int, int]]]:
    """Each group's pieces, exactly `need[g]` positions each.

    A piece goes first to the group that read it (the pieces of a layout come ``half`` a group, in
    order); what a group cannot take, and the pieces of groups that are gone, fill the groups still
    short, in order, cut where a share ends.
    """
    g_count = len(need)
    own: list[list[tuple[int, int]]] = [[] for _ in range(g_count)]
    spare: list[tuple[int, int]] = []
    for i, piece in enumerate(pieces):
        home = i // half
        (own[home] if home < g_count else spare).append(piece)
    out: list[list[tuple[int, int]]] = [[] for _ in range(g_count)]
    short = list(need)
    for g in range(g_count):
        for a, b in own[g]:
            if short[g] >= b - a:
                out[g].append((a, b))
                short[g] -= b - a
            elif short[g] > 0:
                out[g].append((a, a + short[g]))
                spare.append((a + short[g], b))
                short[g] = 0
            else:
                spare.append((a, b))
    spare.sort()
    for g in range(g_count):
        while short[g] > 0:
            a, b = spare.pop(0)
            if b - a <= short[g]:
                out[g].append((a, b))
                short[g] -= b - a
            else:
                out[g].append((a, a + short[g]))
                spare.insert(0, (a + short[g], b))
                short[g] = 0
    return out


def _cut(pieces: list[tuple[int, int]], half: int) -> list[tuple[int, int]]:
    """`pieces` cut into `half` (or as many as there are positions), each cut into near-equal parts in
    proportion to its length (largest remainders first); as they are when there are `half` already."""
    total = sum(b - a for a, b in pieces)
    if len(pieces) >= half or total == 0:
        return list(pieces)
    want = min(half, total)
    exact = [want * (b - a) / total for a, b in pieces]
    parts = [max(1, int(x)) for x in exact]
    order = sorted(range(len(pieces)), key=lambda i: (parts[i] - exact[i], i))
    for i in order[: max(0, want - sum(parts))]:
        parts[i] += 1
    out: list[tuple[int, int]] = []
    for (a, b), k in zip(pieces, parts):
        k = min(k, b - a)
        edges = [a + (b - a) * j // k for j in range(k + 1)]
        out.extend(zip(edges[:-1], edges[1:]))
    return out


def _group(pieces: list[tuple[int, int]], ranks: int, first_rank: int, size: int, pads: tuple[int, int], half: int,
           lanes: int) -> _Group:
    """A group's half-lanes and slots from its pieces (cut until there are `half` of them); `pads`: its
    padding's first virtual position and count."""
    pieces = _cut(pieces, half)
    head, direction, length = [], [], []
    for a, b in pieces:
        m = a + (b - a + 1) // 2
        if m > a:  # upward from a
            head.append(a)
            direction.append(1)
            length.append(m - a)
        if b > m:  # downward from b - 1
            head.append(b - 1)
            direction.append(-1)
            length.append(b - m)
    k = max(1, min(lanes, len(head)))
    slots: list[list[int]] = [[] for _ in range(k)]
    for h in range(len(head)):
        slots[h % k].append(h)
    order = [h for s in slots for h in s]  # half-lanes slot-major
    hl_len = np.array([length[h] for h in order], dtype=np.int64)
    slot_len = np.array([sum(length[h] for h in s) for s in slots], dtype=np.int64)
    px, pc, act = _phases(slot_len)
    return _Group(
        ranks=ranks, first_rank=first_rank, size=size, real=size - pads[1], pad_start=pads[0],
        hl_head=np.array([head[h] for h in order], dtype=np.int64),
        hl_dir=np.array([direction[h] for h in order], dtype=np.int64),
        hl_len=hl_len,
        hl_flat=np.concatenate([[0], np.cumsum(hl_len)]).astype(np.int64),
        slot_len=slot_len,
        slot_base=np.concatenate([[0], np.cumsum(slot_len)]).astype(np.int64),
        phase_x=px, phase_c=pc, phase_active=act, phase_n=np.array([a.size for a in act], dtype=np.int64),
        phase_table=_table(act, slot_len.size),
    )


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How a generation's virtual positions [0, T) are laid out over its ranks: reader groups, each
    reading its pieces from both ends with ``lanes`` heads (see the module docstring).

    Invariants (MUST):
        * :meth:`virtual` is a bijection from {(rank, m): m < n_r[rank]} onto [0, T).
        * :meth:`owner` is its inverse.
        * :meth:`virtual_left` is exactly the positions of [0, R) that no rank consumed.
    """

    world: int
    group_size: int  # L
    groups: tuple[_Group, ...]
    hl_lo: np.ndarray  # (all half-lanes,) lowest virtual position, sorted
    hl_ref: np.ndarray  # (all half-lanes, 2) (group, half-lane) of each, in hl_lo's order

    def _group_of(self, rank: int) -> _Group:
        return self.groups[rank // self.group_size]

    def virtual(self, rank: int, local: np.ndarray) -> np.ndarray:
        """Virtual positions of `rank`'s local positions."""
        g = self._group_of(rank)
        return g.virtual((rank - g.first_rank) + g.ranks * np.asarray(local, dtype=np.int64))

    def virtual_all(self, ranks: np.ndarray, local: np.ndarray) -> np.ndarray:
        """:meth:`virtual` of many ranks at once."""
        ranks = np.asarray(ranks, dtype=np.int64)
        local = np.asarray(local, dtype=np.int64)
        out = np.empty(local.shape, dtype=np.int64)
        gid = ranks // self.group_size
        for q in np.unique(gid).tolist():
            sel = gid == q
            g = self.groups[q]
            out[sel] = g.virtual((ranks[sel] - g.first_rank) + g.ranks * local[sel])
        return out

    def owner(self, v: int) -> tuple[int, int]:
        """The rank virtual position `v` is dealt to, and its local position there."""
        for g in self.groups:
            if g.pad_start <= v < g.pad_start + g.size - g.real:  # padding: the last of the group's stream
                u = g.real + v - g.pad_start
                return g.first_rank + u % g.ranks, u // g.ranks
        i = int(np.searchsorted(self.hl_lo, v, side="right")) - 1
        gi, h = (int(x) for x in self.hl_ref[i])
        g = self.groups[gi]
        off = (v - int(g.hl_head[h])) * int(g.hl_dir[h])
        flat = int(g.hl_flat[h]) + off
        slot = int(np.searchsorted(g.slot_base, flat, side="right")) - 1
        u = int(g.stream(np.array([slot]), np.array([flat - int(g.slot_base[slot])]))[0])
        return g.first_rank + u % g.ranks, u // g.ranks

    def virtual_left(self, consumed: np.ndarray, left: int, t: int) -> list[Interval]:
        """The virtual positions of [0, `left`) no rank consumed, `consumed[r]` being each rank's count."""
        out: list[Interval] = []
        for g in self.groups:
            c = consumed[g.first_rank:g.first_rank + g.ranks]  # (L_g,)
            lo, hi = int(c.min()), int(c.max())
            done = g.consumed_per_slot(g.ranks * lo)  # (K,)
            # each half-lane's consumed prefix, from its slot's count
            slot_of_hl = np.searchsorted(g.slot_base, g.hl_flat[:-1], side="right") - 1
            reach = g.slot_base[slot_of_hl] + done[slot_of_hl]  # (H,) flat position the slot got to
            took = np.clip(reach - g.hl_flat[:-1], 0, g.hl_len)  # (H,)
            rest: list[Interval] = []
            for head, step, n, k in zip(g.hl_head.tolist(), g.hl_dir.tolist(), g.hl_len.tolist(), took.tolist()):
                if k < n:
                    rest.append((head + k, head + n) if step > 0 else (head - n + 1, head - k + 1))
            # the band of rounds some ranks of the group took and others did not (an epoch's end)
            band = np.arange(g.ranks * lo, min(g.ranks * hi, g.real), dtype=np.int64)
            if band.size:
                taken = band[band // g.ranks < c[band % g.ranks]]
                rest = _without(rest, g.virtual(taken)) if taken.size else rest
            out.extend(rest)
        kept = [(a, min(b, left)) for a, b in out if a < left]
        if t < left:  # tail "drop": [T, R) was dealt to no rank
            kept.append((t, left))
        return _merge(kept)


def _without(intervals: list[Interval], points: np.ndarray) -> list[Interval]:
    """`intervals` less the positions `points` (which lie inside them)."""
    pts = np.sort(points)
    out: list[Interval] = []
    for a, b in intervals:
        inside = pts[(pts >= a) & (pts < b)].tolist()
        for p in inside:
            if a < p:
                out.append((a, p))
            a = p + 1
        if a < b:
            out.append((a, b))
    return out


def shard_layout(spec: Spec, world: int, left: int, t: int, n_r: np.ndarray, cum: np.ndarray) -> ShardLayout:
    """The layout of a generation of `world` ranks dealing a cursor whose intervals lie end to end at
    `cum` (R = `left` positions, T = `t` virtual ones, `n_r` each rank's count).

    Cost: O(world + intervals of the cursor + lanes) to make; nothing is O(n).
    """
    size = spec.reader_group
    groups_n = -(-world // size)
    half = -(-spec.lanes // 2)
    need = [int(n_r[g * size:(g + 1) * size].sum()) for g in range(groups_n)]
    # NOTE: the padding (T > R: fewer than `world` positions) is read last, as the stripes read it: one
    # at the end of a rank's share, from the last group back.
    pads = [0] * groups_n
    extra = max(0, t - left)
    for g in reversed(range(groups_n)):
        pads[g] = min(extra, min(size, world - g * size), need[g])
        extra -= pads[g]
    pad_at = np.concatenate([[0], np.cumsum(pads)]).astype(np.int64) + min(left, t)
    shares = _balance(_pieces(cum, left, t), [need[g] - pads[g] for g in range(groups_n)], half)
    groups = []
    for g in range(groups_n):
        ranks = min(size, world - g * size)
        groups.append(_group(shares[g], ranks, g * size, need[g], (int(pad_at[g]), pads[g]), half, spec.lanes))
    lo, ref = [], []
    for gi, grp in enumerate(groups):
        for h in range(grp.hl_len.size):
            n = int(grp.hl_len[h])
            head = int(grp.hl_head[h])
            lo.append(head if grp.hl_dir[h] > 0 else head - n + 1)
            ref.append((gi, h))
    order = np.argsort(np.array(lo, dtype=np.int64), kind="stable")
    return ShardLayout(
        world=world, group_size=size, groups=tuple(groups),
        hl_lo=np.array(lo, dtype=np.int64)[order] if lo else np.zeros(0, dtype=np.int64),
        hl_ref=np.array(ref, dtype=np.int64).reshape(-1, 2)[order],
    )
