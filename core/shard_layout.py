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
