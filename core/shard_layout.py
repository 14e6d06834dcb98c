"""The shard order's static layout: how a generation of reader groups deals what is left of an epoch.

Ranks form **reader groups** of ``spec.reader_group`` consecutive ranks (a node's ranks by default:
they share a cache). Each group takes its own **pieces** of what is left of the epoch and reads each
piece from both of its ends inward, ``spec.lanes`` reading heads at a time, so a group holds about
``lanes`` windows of the order (:mod:`croupier.core.shards`) at once and a shard is fetched by one
group per epoch. The pieces follow the cursor: an interval the job left unconsumed is a piece whose
two ends are the heads that were being read, so a restart, a resize or a rollback carries on from the
windows the groups held, and only the shares that must move to balance the new groups are cut.

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

from croupier.core.cursor import Interval, merge_intervals
from croupier.core.spec import Spec

__all__ = ["ShardLayout", "shard_layout"]


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
    phase_n: np.ndarray  # (K,) how many take part in phase p
    phase_table: np.ndarray  # (K, K) row p: the slot ids (ascending) taking part in phase p, then 0s

    def active(self, p: int) -> np.ndarray:
        """The slot ids (ascending) taking part in phase `p`."""
        row: np.ndarray = self.phase_table[p, :int(self.phase_n[p])]
        return row

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
            act = self.active(q)
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
        act = self.active(p)
        before = act[act < int(slot[0])]
        out[before] += 1
        return out


def _phases(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Round-robin phases over slots of lengths `x`: each round every slot with positions left reads one.

    Returns each phase's rounds before it (K,), positions before it (K,), slots taking part (K,) and
    those slots (K, K): row p the ids (ascending) of the slots longer than phase p's rounds, then 0s.
    """
    k = x.size
    srt = np.sort(x)
    px = np.concatenate([[0], srt[:-1]]).astype(np.int64)  # (K,) x_(p): rounds before phase p
    below = np.concatenate([[0], np.cumsum(srt)[:-1]]).astype(np.int64)  # sum of the p shortest
    pc = below + (k - np.arange(k, dtype=np.int64)) * px
    taking = x[None, :] > px[:, None]  # (K, K) slot s takes part in phase p
    n = taking.sum(axis=1).astype(np.int64)  # (K,)
    ids = np.argsort(~taking, axis=1, kind="stable")  # (K, K) the slots taking part first, each row ascending
    table = np.where(np.arange(k)[None, :] < n[:, None], ids, 0).astype(np.int64)
    return px, pc, n, table


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
    cut = np.array(_cut(pieces, half), dtype=np.int64).reshape(-1, 2)  # (pieces, 2)
    a, b = cut[:, 0], cut[:, 1]
    m = a + (b - a + 1) // 2
    # each piece's two half-lanes, upward from a then downward from b - 1; the empty ones dropped
    head = np.stack([a, b - 1], axis=1).reshape(-1)  # (2 * pieces,)
    direction = np.tile(np.array([1, -1], dtype=np.int64), a.size)
    length = np.stack([m - a, b - m], axis=1).reshape(-1)
    keep = length > 0
    head, direction, length = head[keep], direction[keep], length[keep]
    k = max(1, min(lanes, length.size))
    slot = np.arange(length.size, dtype=np.int64) % k  # half-lane h goes to slot h % k
    order = np.argsort(slot, kind="stable")  # half-lanes slot-major
    hl_len = length[order]
    slot_len = np.zeros(k, dtype=np.int64)  # (K,)
    np.add.at(slot_len, slot, length)
    px, pc, n, table = _phases(slot_len)
    return _Group(
        ranks=ranks, first_rank=first_rank, size=size, real=size - pads[1], pad_start=pads[0],
        hl_head=head[order], hl_dir=direction[order], hl_len=hl_len,
        hl_flat=np.concatenate([[0], np.cumsum(hl_len)]).astype(np.int64),
        slot_len=slot_len,
        slot_base=np.concatenate([[0], np.cumsum(slot_len)]).astype(np.int64),
        phase_x=px, phase_c=pc, phase_n=n, phase_table=table,
    )


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How a generation's virtual positions [0, T) are laid out over its ranks: reader groups, each
    reading its pieces from both ends with ``lanes`` heads (see the module docstring).

    Invariants (MUST):
        * :meth:`virtual` is a bijection from {(rank, m): m < n_r[rank]} onto [0, T).
        * :meth:`owner` is its inverse.
        * :meth:`virtual_left` is exactly the positions of [0, R) that no rank consumed.

    NOTE: a group's half-lanes and slots are made when one of its ranks is first asked about (a rank
    leasing its batches makes its own group only); :meth:`owner` and :meth:`virtual_left` make them all.
    """

    world: int
    group_size: int  # L
    lanes: int
    shares: tuple[list[tuple[int, int]], ...]  # each group's pieces of the virtual positions
    need: tuple[int, ...]  # each group's positions (padding included)
    pads: tuple[tuple[int, int], ...]  # each group's padding: its first virtual position and count
    _made: dict[int, _Group] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def group(self, g: int) -> _Group:
        """Reader group `g`'s half-lanes and slots (made once)."""
        got = self._made.get(g)
        if got is None:
            ranks = min(self.group_size, self.world - g * self.group_size)
            got = _group(self.shares[g], ranks, g * self.group_size, self.need[g], self.pads[g], -(-self.lanes // 2),
                         self.lanes)
            self._made[g] = got
        return got

    @functools.cached_property
    def groups(self) -> tuple[_Group, ...]:
        """Every reader group's half-lanes and slots."""
        return tuple(self.group(g) for g in range(len(self.shares)))

    @functools.cached_property
    def _half_lanes(self) -> tuple[np.ndarray, np.ndarray]:
        """Every half-lane's lowest virtual position, sorted (all half-lanes,), and its (group, half-lane)
        (all half-lanes, 2) in that order."""
        groups = self.groups
        count = np.array([grp.hl_len.size for grp in groups], dtype=np.int64)  # (groups,)
        head = np.concatenate([grp.hl_head for grp in groups])  # (all half-lanes,)
        length = np.concatenate([grp.hl_len for grp in groups])
        lo = np.where(np.concatenate([grp.hl_dir for grp in groups]) > 0, head, head - length + 1)
        gid = np.repeat(np.arange(count.size, dtype=np.int64), count)
        hid = np.arange(gid.size, dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
        order = np.argsort(lo, kind="stable")
        return lo[order], np.stack([gid, hid], axis=1)[order]

    def _group_of(self, rank: int) -> _Group:
        return self.group(rank // self.group_size)

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
            g = self.group(q)
            out[sel] = g.virtual((ranks[sel] - g.first_rank) + g.ranks * local[sel])
        return out

    def owner(self, v: int) -> tuple[int, int]:
        """The rank virtual position `v` is dealt to, and its local position there."""
        for g in self.groups:
            if g.pad_start <= v < g.pad_start + g.size - g.real:  # padding: the last of the group's stream
                u = g.real + v - g.pad_start
                return g.first_rank + u % g.ranks, u // g.ranks
        hl_lo, hl_ref = self._half_lanes
        i = int(np.searchsorted(hl_lo, v, side="right")) - 1
        gi, h = (int(x) for x in hl_ref[i])
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
        return merge_intervals(kept)


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

    Cost: O(world + intervals of the cursor) to make, and O(lanes) a reader group when first asked about;
    nothing is O(n).
    """
    size = spec.reader_group
    groups_n = -(-world // size)
    half = -(-spec.lanes // 2)
    need: list[int] = np.add.reduceat(n_r, np.arange(0, world, size)).tolist()  # (groups,) positions each
    # NOTE: the padding (T > R: fewer than `world` positions) is read last, as the stripes read it: one
    # at the end of a rank's share, from the last group back.
    pads = [0] * groups_n
    extra = max(0, t - left)
    for g in reversed(range(groups_n)):
        pads[g] = min(extra, min(size, world - g * size), need[g])
        extra -= pads[g]
    pad_at = np.concatenate([[0], np.cumsum(pads)]).astype(np.int64) + min(left, t)
    shares = _balance(_pieces(cum, left, t), [need[g] - pads[g] for g in range(groups_n)], half)
    return ShardLayout(world=world, group_size=size, lanes=spec.lanes, shares=tuple(shares), need=tuple(need),
                       pads=tuple((int(pad_at[g]), pads[g]) for g in range(groups_n)))
