"""A run's whole mixture: the schedule of weights, sources that run out, and the amendments recorded while it ran.

:class:`Stream` cuts the run's positions into segments, each dealt by one
``croupier.core.mixture.Mixture``, and maps each source's count to its source epochs through the
source's timeline (``croupier.core.amend.Timeline``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import numpy as np

from croupier.core import feistel, mixture
from croupier.core.amend import Amendment, Timeline, check
from croupier.core.checks import check_int
from croupier.core.mixture import PARTS, Mixture, base_key, indices_of, parts_of, round_keys, source_epoch_pairs


@dataclasses.dataclass(frozen=True)
class _Segment:
    start: int  # the first stream position it deals
    end: int | None  # the first it does not (None: it deals on for good)
    mixture: Mixture
    base: tuple[int, ...]  # what each source had dealt before `start`


#: Where a mixture's schedule of weights is read from (a position of the stream, the weights in parts from there on).
Change = tuple[int, tuple[int, ...]]


class SourceOrder(Protocol):
    """A source's own order of each of its epochs, in place of the keyed Feistel shuffle (a shard order,
    ``croupier.core.shards.ShardOrder``): a bijection of [0, size) an epoch, and its inverse. MUST be
    hashable (a stream is cached by its settings)."""

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray: ...

    def positions(self, epoch: int, indices: np.ndarray) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class Stream:
    """A run's whole mixture from stream position 0 on: sources, weights that change, sources that run out.

    The stream is cut into segments, each dealt by one :class:`Mixture` from its own position 0,
    with each source's count carried over from the segment before, so that a source's ``k``-th
    sample of the run is its ``k``-th wherever the weights changed: every source goes on through
    its own epochs across any change, and every sample is still dealt once per source epoch.

    A segment ends where the schedule's next change begins, where an amendment holds from, or
    where a capped source has dealt its last sample (``max_epochs`` whole epochs of its own): from
    there its weight is 0 and the others' weights are scaled up in proportion (their parts
    rounded again by largest remainder).

    Attributes:
        sizes: Samples of each source (in the spec: before any grow).
        changes: The schedule: ``(position, parts)`` pairs, the first at 0, positions increasing;
            from ``position`` on, the weights are ``parts`` (parts of PARTS, see :func:`parts_of`).
        max_epochs: Each source's cap in epochs of its own (0: none); empty: no source is capped.
        seed: The job's seed.
        shuffle: Each source epoch in a keyed permutation (True) or in order (False).
        amendments: Changes recorded while the job ran (``croupier.core.amend``), each with the
            position it holds from, in order: new weights end the schedule there; a grow or a
            skip changes its source's epochs from there on. Indices are numbered by the sources'
            sizes once every grow took effect.
        orders: Each source's own order of its epochs (a sharded source's shard order), in place of
            the shuffle; empty: every source takes the shuffle (or none). Such a source does not grow.
    """

    sizes: tuple[int, ...]
    changes: tuple[Change, ...]
    max_epochs: tuple[int, ...] = ()
    seed: int = 0
    shuffle: bool = True
    amendments: tuple[Amendment, ...] = ()
    orders: tuple[SourceOrder, ...] = ()

    def __post_init__(self) -> None:
        if not self.changes or self.changes[0][0] != 0:
            raise ValueError(f"a mixture's weights must start at position 0 (got a schedule starting at "
                             f"{self.changes[0][0] if self.changes else None})")
        for (a, _), (b, _) in zip(self.changes, self.changes[1:]):
            if b <= a:
                raise ValueError(f"the schedule's positions must increase (got {a} then {b})")
        for at, parts in self.changes:
            if len(parts) != len(self.sizes):
                raise ValueError(f"the weights from position {at} name {len(parts)} sources; there are {len(self.sizes)}")
        if self.max_epochs and len(self.max_epochs) != len(self.sizes):
            raise ValueError(f"max_epochs names {len(self.max_epochs)} sources; there are {len(self.sizes)}")
        for i, m in enumerate(self.max_epochs):
            check_int(f"max_epochs[{i}]", m, 0, type_error=ValueError)
        prev = 0
        for i, am in enumerate(self.amendments):
            if am.at is None or am.at < prev:
                raise ValueError(f"amendment {i} ({am.describe()}) must hold from a position at or after the one "
                                 f"before it ({prev})")
            check(self.sizes, self.amendments[:i], am, PARTS, strict=False)
            prev = am.at
        _ = self._built  # every segment is made (and checked) now: the stream must never run dry

    def cap(self, source: int) -> int | None:
        """How many samples `source` deals in the whole run (None: no cap)."""
        m = self.max_epochs[source] if self.max_epochs else 0
        return self.timeline(source).epoch_start(m) if m else None

    def timeline(self, source: int) -> Timeline:
        """`source`'s epochs under the amendments (see ``croupier.core.amend.Timeline``)."""
        lines = self._built[1]
        if source not in lines:  # made when first asked: a source no amendment touched is plain
            lines[source] = self._timeline(source)
        return lines[source]

    @property
    def _segments(self) -> tuple[_Segment, ...]:
        return self._built[0]

    def _timeline(self, source: int) -> Timeline:
        n = self.sizes[source]
        if self.orders:
            order = self.orders[source]

            def own(epoch: np.ndarray, m: int, raw: np.ndarray) -> np.ndarray:
                out = np.empty(raw.shape, dtype=np.int64)
                for e in np.unique(epoch).tolist():
                    sel = epoch == e
                    out[sel] = order.indices(int(e), raw[sel])
                return out

            return Timeline(n, own, lambda e, m, samples: order.positions(e, np.asarray(samples, dtype=np.int64)))
        if not self.shuffle:
            return Timeline(n, lambda e, m, raw: raw, lambda e, m, samples: np.asarray(samples, dtype=np.int64))
        base = base_key(self.seed, mixture.SOURCE_TAG)

        def perm(epoch: np.ndarray, m: int, raw: np.ndarray) -> np.ndarray:
            combo, which = source_epoch_pairs(np.full(epoch.shape, source, dtype=np.int64), epoch)
            return feistel.permute(raw, m, round_keys(base, combo)[:, which])

        def unperm(epoch: int, m: int, samples: np.ndarray) -> np.ndarray:
            keys = round_keys(base, np.array([(source << 40) | epoch], dtype=np.int64))
            return feistel.unpermute(samples, m, np.repeat(keys, samples.size, axis=1))

        return Timeline(n, perm, unperm)

    @functools.cached_property
    def _built(self) -> tuple[tuple[_Segment, ...], dict[int, Timeline]]:
        segments: list[_Segment] = []
        lines: dict[int, Timeline] = {}  # the timelines made so far (every amended source's)

        def line(s: int) -> Timeline:
            if s not in lines:
                lines[s] = self._timeline(s)
            return lines[s]

        schedule = list(self.changes)
        todo = list(self.amendments)
        base, pos, ci = [0] * len(self.sizes), 0, 0

        def cap(s: int) -> int | None:
            m = self.max_epochs[s] if self.max_epochs else 0
            if not m:
                return None
            return line(s).epoch_start(m) if s in lines else m * self.sizes[s]

        while True:
            while todo and todo[0].at == pos:
                a = todo.pop(0)
                if a.kind == "weights":
                    schedule = [c for c in schedule if c[0] < pos] + [(pos, a.values)]
                    ci = len(schedule) - 1
                elif a.kind == "grow":
                    line(a.values[0]).amend(base[a.values[0]], grow_to=a.values[2])
                else:
                    for s in sorted({s for s, _ in a.pairs}):
                        line(s).amend(base[s], skip=[j for t, j in a.pairs if t == s])
            while ci + 1 < len(schedule) and schedule[ci + 1][0] <= pos:
                ci += 1
            nxt = schedule[ci + 1][0] if ci + 1 < len(schedule) else None
            if todo and todo[0].at is not None:
                nxt = todo[0].at if nxt is None else min(nxt, todo[0].at)
            parts = list(schedule[ci][1])
            spent = [s for s in range(len(parts)) if parts[s] and (c := cap(s)) is not None and base[s] >= c]
            for s in spent:
                parts[s] = 0
            if not any(parts):
                until = f"before the next change at position {nxt}" if nxt is not None else "for good"
                raise ValueError(f"from stream position {pos} every source with a weight has dealt its max_epochs: "
                                 f"the mixture has nothing to deal {until} (give a source with weight no cap)")
            if spent:
                parts = list(parts_of(parts))
            mix = Mixture(self.sizes, tuple(parts), self.seed)
            _ = mix._arrays  # its tree, made with the stream (when a sampler is made), not in a first batch
            end = nxt
            for s, p in enumerate(parts):
                c = cap(s)
                if p and c is not None:
                    at = pos + mix.position_of(s, c - base[s])
                    end = at if end is None else min(end, at)
            segments.append(_Segment(pos, end, mix, tuple(base)))
            if end is None:
                return tuple(segments), lines
            base = [b + mix.count(s, end - pos) for s, b in enumerate(base)]
            pos = end

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, k) of each stream position: the source dealing it and how many that source dealt before it."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        segments = self._segments
        if len(segments) == 1:
            return segments[0].mixture.locate(pos)
        starts = np.array([g.start for g in segments], dtype=np.int64)
        which = np.searchsorted(starts, pos, side="right") - 1
        source = np.empty_like(pos)
        k = np.empty_like(pos)
        for i in sorted(set(which.tolist())):
            g = segments[i]
            sel = which == i
            s, q = g.mixture.locate(pos[sel] - g.start)
            source[sel], k[sel] = s, q + np.array(g.base, dtype=np.int64)[s]
        return source, k

    def dealt_before(self, position: int) -> tuple[int, ...]:
        """How many samples each source has dealt at stream positions [0, position)."""
        g = [g for g in self._segments if g.start <= position][-1]
        return tuple(b + g.mixture.count(s, position - g.start) for s, b in enumerate(g.base))

    @functools.cached_property
    def _plain(self) -> bool:
        """No grow or skip amendment: each source's epochs are its spec's (the unamended fast path)."""
        return all(t.plain for t in self._built[1].values())

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        """Where each source's samples start in the index space, with the sizes once every grow took effect."""
        sizes = np.array([self.timeline(s).size if s in self._built[1] else n for s, n in enumerate(self.sizes)],
                         dtype=np.int64)
        return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)

    def indices(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(global index, source, source epoch) of each stream position."""
        source, k = self.locate(positions)
        if self._plain and not self.orders:
            return indices_of(self.sizes, self.seed, source, k, self.shuffle)
        epoch, sample = np.empty_like(k), np.empty_like(k)
        for s in sorted(set(source.tolist())):
            sel = source == s
            epoch[sel], sample[sel] = self.timeline(s).locate(k[sel])
        return sample + self.offsets[source], source, epoch


@functools.lru_cache(maxsize=64)
def stream(sizes: tuple[int, ...], changes: tuple[Change, ...], max_epochs: tuple[int, ...], seed: int,
           shuffle: bool, amendments: tuple[Amendment, ...] = (), orders: tuple[SourceOrder, ...] = ()) -> Stream:
    """The :class:`Stream` of these settings, made once per process (its segments are worked out when made)."""
    return Stream(sizes, changes, max_epochs, seed, shuffle, amendments, orders)
