"""The ranks' audit logs as streams: what each rank of each incarnation was handed in an epoch, in order."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from croupier.core.ledger import Version
    from croupier.tools.audit import Incarnation

HOLE, CLASH = -1, -2  # a stream's position no record holds / two records hold differently


class Streams:
    """One job's audit logs, read as streams: for (incarnation, rank, epoch), the indices the rank was handed in
    that epoch, in order, from the first it was handed in that incarnation.

    Args:
        incarnations: The job's incarnations as :func:`croupier.tools.audit.load` reads them.
    """

    def __init__(self, incarnations: Sequence[Incarnation]) -> None:
        self.by_name = {inc.name: inc for inc in incarnations}
        self._streams: dict[tuple[str, int, int], np.ndarray] = {}
        self._taken: dict[tuple[int, int, int], int] = collections.Counter()  # (generation, rank, epoch) -> indices

    def stream(self, inc: Incarnation, rank: int, epoch: int) -> np.ndarray | None:
        """The rank's stream of `epoch` (None: the rank left no log); a position no record holds is :data:`HOLE`,
        one that two records hold differently :data:`CLASH`."""
        key = (inc.name, rank, epoch)
        if key not in self._streams:
            r = inc.ranks.get(rank)
            if r is None:
                return None
            unit = int(r.start.get("unit", 1))  # indices per item; 0: each record is one item of its own size
            # NOTE: a rank logs whole leases, read ahead of the loop; what it handed out of an epoch the trainer
            # cut (set_epoch of the next epoch) ends at the items taken then, as the per-epoch audit counts them.
            cut = inc.cuts.get(epoch)
            records = sorted(((at, idx) for e, at, idx in r.batches if e == epoch and (cut is None or at < cut)),
                             key=lambda x: x[0])
            got = _by_items(records) if unit == 0 else _by_positions(records, unit)
            if cut is not None and unit and records:
                got = got[:max(0, (cut - records[0][0]) * unit)]
            self._streams[key] = got
        return self._streams[key]

    def mismatch(self, t: int, v: Version) -> str | None:
        """How kept step `t` (version `v`) differs from what the ranks of its generation were handed at that point
        of their share of its epoch, or None. Called for the kept steps in order: each rank's stream is read on
        from where the previous step of its generation in the epoch left it."""
        inc = self.by_name.get(v.incarnation)
        if inc is None:
            return f"generation {v.generation} (incarnation {v.incarnation!r}) trained step {t}, but left no audit log"
        if inc.generation != v.generation:
            return (f"incarnation {v.incarnation!r} logged generation {inc.generation}; the ledger says it was "
                    f"generation {v.generation}")
        for b in v.batches:
            key = (v.generation, b.rank, v.epoch)
            off = self._taken[key]
            self._taken[key] = off + b.indices.size
            got = self.stream(inc, b.rank, v.epoch)
            if got is None:
                return f"step {t}: rank {b.rank} of generation {v.generation} left no audit log"
            part = got[off:off + b.indices.size]
            if part.size == b.indices.size and np.array_equal(part, b.indices):
                continue
            j = next(j for j in range(b.indices.size) if j >= part.size or part[j] != b.indices[j])
            cut = inc.cuts.get(v.epoch)
            logged = (f"nothing more: the trainer cut the epoch after {cut} items (set_epoch of the next epoch)"
                      if cut is not None and off + j >= got.size else f"{_at(got, off + j)} there")
            return (f"step {t}, rank {b.rank}, micro-batch {b.micro}: the ledger says sample {b.indices[j]} (position "
                    f"{off + j} of the rank's share of epoch {v.epoch} in generation {v.generation}); the rank logged "
                    f"{logged} (logged: {_around(got, off + j)})")
        return None


def _by_positions(records: list[tuple[int, np.ndarray]], unit: int) -> np.ndarray:
    """Records of `unit` indices per item placed at their items (a range leased again is logged twice)."""
    if not records:
        return np.zeros(0, dtype=np.int64)
    base = records[0][0] * unit
    end = max(at * unit + idx.size for at, idx in records)
    out = np.full(end - base, HOLE, dtype=np.int64)
    for at, idx in records:
        a = at * unit - base
        old = out[a:a + idx.size]
        out[a:a + idx.size] = np.where((old != HOLE) & (old != idx), CLASH, idx)
    return out


def _by_items(records: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """Records of one item each (token-budget batches, of any size), in item order; a missing item is a hole."""
    parts: list[np.ndarray] = []
    prev: int | None = None
    for at, idx in records:
        if at == prev:
            continue
        if prev is not None and at != prev + 1:
            parts.append(np.array([HOLE], dtype=np.int64))
        parts.append(idx.astype(np.int64))
        prev = at
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _at(a: np.ndarray, i: int) -> str:
    """What a stream holds at position `i`, holes and clashes named."""
    if i >= a.size:
        return "nothing more"
    v = int(a[i])
    return "nothing (no record holds it)" if v == HOLE else "two different indices (two records)" if v == CLASH else str(v)


def _around(a: np.ndarray, i: int) -> str:
    """A few of a stream's indices around position `i`, the one at `i` in brackets."""
    lo, hi = max(0, i - 2), min(a.size, i + 3)
    items = ["?" if v == HOLE else "CLASH" if v == CLASH else str(v) for v in a[lo:hi].tolist()]
    if lo <= i < hi:
        items[i - lo] = f"[{items[i - lo]}]"
    return ("... " if lo else "") + " ".join(items) + (" ..." if hi < a.size else "")
