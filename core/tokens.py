"""Token-budget batches: batches sized by their samples' lengths, dealt as a lazy plan.

A spec with ``max_tokens`` set has batches of as many samples as fit in the budget, instead of
``batch_size`` of them. :class:`TokenPlan` deals them to ranks as :class:`croupier.core.order.FixedPlan`
deals fixed batches. The contract (what a job gets, on every machine):

Virtual positions
    The cursor's remaining positions laid end to end, [0, R), as in :mod:`croupier.core.order`.

Windows
    Window w holds virtual positions [w * S, min((w + 1) * S, R)), S = ``spec.token_window``.

Packing a window
    A pure function of the spec, the epoch and the window's order positions. Its samples are the
    dataset indices ``order(spec, epoch, positions)``, with lengths ``spec.sort_keys[indices]``,
    sorted stably by length (ties by virtual position). The batches are then cut, each batch
    laid out in that ascending order:

    * cost ``sum`` (a batch costs its lengths added up): a batch takes the longest remaining
      samples while they fit, then tops up with the shortest remaining ones while they fit. Every
      batch but the last few of a window thus misses the budget by less than the shortest sample
      still left in the window.
    * cost ``padded`` (a batch costs its longest length times its size): a batch takes the
      shortest remaining samples while they fit; in ascending order its longest is its last.

    No batch costs more than ``max_tokens`` (Spec checks every length is in [1, max_tokens]).
    The batches, in the order they were cut, are then shuffled by the Feistel bijection of
    :mod:`croupier.core.feistel` on [0, number of batches), keyed by
    ``derive_key(seed, epoch, first order position of the window, tokens tag)``: batch k of the
    window is the cut batch ``permute(k)``.

The global sequence
    Window 0's batches, then window 1's, ...; G batches in all. Step s of rank r is global batch
    s * W + r (W ranks in lockstep, one batch each per step), so after j steps the job consumed
    the first j * W global batches.

The last round
    With m = G mod W != 0, the last m batches (the last round, step G // W) are re-cut so that
    every rank gets one: batch i of them (c_i samples) is split into k_i >= 1 contiguous pieces,
    sum k_i = W, as evenly by count as possible (each extra piece goes to the batch whose pieces
    are largest, ties to the earlier batch; a batch of c pieces splits into sizes differing by at
    most one, the larger first). Rank r takes piece r, pieces in batch order. A piece of a batch
    never costs more than the batch. When the round holds P < W samples it is cut into P
    one-sample pieces, and the tail decides the rest: ``uneven`` keeps them (ranks r >= P have
    one step fewer), ``drop`` drops the round (P < W samples are not dealt), ``pad`` gives ranks
    r >= P one sample each, positions r - P (mod n) of the epoch's order, as torch pads.

Laziness
    Making a plan packs nothing; a lease packs the windows its steps need (to know that the round
    of step s is full, the windows holding global batches up to (s + 1) * W - 1). The plan keeps
    every packed window's batch count and the batches of a few recent windows, so resuming is
    O(window) whatever the dataset's size, and a job that leases its steps in order packs every
    window once. Only :meth:`TokenPlan.steps`, :attr:`TokenPlan.nb_r` and
    :meth:`TokenPlan.samples` pack the whole epoch (O(N)), once.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import threading

import numpy as np

from croupier.core import feistel as _feistel
from croupier.core.checks import check_int
from croupier.core.cursor import Cursor, Interval, fresh, intervals_of, merge_intervals
from croupier.core.order import order
from croupier.core.plan import ComputedPlan, Grant, Runs
from croupier.core.spec import Spec

#: Tells the batch shuffle's keys apart from every other key croupier derives: the bytes of
#: "croupier/tokens", above 2**64, as the fourth part (the bucket tag is "croupier/bucket").
_TOKENS_TAG = int.from_bytes(b"croupier/tokens", "little")
#: How many samples of packed windows a plan keeps (16 bytes each; at least two windows are kept),
#: enough for every rank of a lockstep job to lease a few hundred steps from the same windows.
#: Batch counts are kept for every window packed.
_KEEP_SAMPLES = 1 << 18

# A rank's batch in one step: its order positions and its dataset indices.
_Batch = tuple[np.ndarray, np.ndarray]


@dataclasses.dataclass(frozen=True)
class _Window:
    """One packed window: its samples batch after batch, in the window's shuffled batch order."""

    pos: np.ndarray  # order positions
    idx: np.ndarray  # dataset indices
    bounds: np.ndarray  # (batches + 1,) offsets of the batches

    @property
    def batches(self) -> int:
        return len(self.bounds) - 1


def _cut_sum(sl: np.ndarray, budget: int) -> list[tuple[int, int, int, int]]:
    """Batches of ascending lengths `sl` by cost ``sum``: each is sl[lo:b] + sl[a:hi] (shortest, longest)."""
    c = [0, *np.cumsum(sl).tolist()]
    lo, hi = 0, len(sl)
    out = []
    while lo < hi:
        a = bisect.bisect_left(c, c[hi] - budget, lo, hi)  # longest samples sl[a:hi] that fit
        b = bisect.bisect_right(c, c[lo] + budget - (c[hi] - c[a]), lo, a + 1) - 1  # then shortest sl[lo:b]
        out.append((lo, b, a, hi))
        lo, hi = b, a
    return out


def _cut_padded(sl: np.ndarray, budget: int) -> list[tuple[int, int, int, int]]:
    """Batches of ascending lengths `sl` by cost ``padded``: each is the longest run sl[i:j] with sl[j-1] * (j-i) <= budget."""
    s = sl.tolist()
    n, i = len(s), 0
    out = []
    while i < n:
        lo, hi = i + 1, min(n, i + budget // s[i])  # j in [lo, hi]; sl[i] alone always fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if s[mid - 1] * (mid - i) <= budget:
                lo = mid
            else:
                hi = mid - 1
        out.append((i, lo, lo, lo))
        i = lo
    return out


def _split(c: list[int], world: int) -> list[int]:
    """How many pieces each of the last round's batches (sizes `c`, sum >= world) is cut into; they add up to world."""
    k = [1] * len(c)
    heap = [(-c[i], i) for i in range(len(c))]  # (-largest piece size, batch)
    heapq.heapify(heap)
    for _ in range(world - len(c)):
        _, i = heapq.heappop(heap)
        k[i] += 1
        heapq.heappush(heap, (-c[i] // k[i], i))  # -ceil(c / k)
    return k


@dataclasses.dataclass(eq=False)
class TokenPlan(ComputedPlan):
    """How one epoch's remainder is dealt to `world` ranks as token-budget batches (see the module).

    Making one is O(number of the cursor's intervals): nothing is packed until a lease needs it.
    Safe to share between threads. An :class:`croupier.core.plan.EpochPlan` whose steps are the
    ranks' token-budget batches.
    """

    fixed_batches = False

    spec: Spec
    cursor: Cursor
    world: int
    left: int = dataclasses.field(init=False)  # R
    windows: int = dataclasses.field(init=False)  # windows of the plan
    _packs: int = dataclasses.field(init=False, default=0, repr=False)  # windows packed, repacks included

    def __post_init__(self) -> None:
        if self.spec.max_tokens is None:
            raise ValueError("a TokenPlan needs a spec with max_tokens set")
        check_int("world", self.world, 1)
        self._budget = int(self.spec.max_tokens)
        self._window_size = int(self.spec.token_window)
        self._keys = self.spec.sort_keys
        lengths = [b - a for a, b in self.cursor.remaining]
        self._iv_cum = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
        self._iv_starts = np.array([a for a, _ in self.cursor.remaining], dtype=np.int64)
        self.left = int(self._iv_cum[-1])
        self.windows = -(-self.left // self._window_size)
        self._cum = [0]  # _cum[w]: global batches before window w, for the windows packed so far
        self._cache: collections.OrderedDict[int, _Window] = collections.OrderedDict()
        self._cached = 0  # samples in _cache
        self._sums = np.zeros(self.world, dtype=np.int64)  # samples per rank over the packed windows
        self._tail: collections.deque[np.ndarray] = collections.deque()  # batch sizes of the last windows
        self._tail_count = 0  # batches in _tail: the fewest >= world (or all of them)
        self._nb: np.ndarray | None = None  # steps per rank, once every window is packed
        self._pieces: list[int] = []  # sizes of the last round's pieces, rank by rank (0: no step)
        self._last: list[_Batch | None] | None = None
        self._all_samples: np.ndarray | None = None
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ packing

    def _positions(self, a: int, e: int) -> np.ndarray:
        """Order positions of the virtual positions [a, e)."""
        v = np.arange(a, e, dtype=np.int64)
        if len(self._iv_starts) == 1:
            out: np.ndarray = v + self._iv_starts[0]
            return out
        k = np.searchsorted(self._iv_cum, v, side="right") - 1
        pos: np.ndarray = self._iv_starts[k] + (v - self._iv_cum[k])
        return pos

    def _intervals(self, a: int, e: int) -> list[Interval]:
        """Order-position intervals of the virtual positions [a, e)."""
        cum, starts = self._iv_cum.tolist(), self._iv_starts.tolist()
        k = bisect.bisect_right(cum, a) - 1
        out: list[Interval] = []
        while a < e:
            end = min(e, cum[k + 1])
            out.append((starts[k] + a - cum[k], starts[k] + end - cum[k]))
            a, k = end, k + 1
        return out

    def _pack(self, w: int) -> _Window:
        """Packs window w (see the module's contract)."""
        self._packs += 1
        pos = self._positions(w * self._window_size, min((w + 1) * self._window_size, self.left))
        idx = order(self.spec, self.cursor.epoch, pos)
        lens = self._keys[idx]
        srt = np.argsort(lens, kind="stable")  # by length, ties by virtual position
        sl = lens[srt]
        cuts = _cut_sum(sl, self._budget) if self.spec.cost == "sum" else _cut_padded(sl, self._budget)
        nb = len(cuts)
        key = _feistel.derive_key(self.spec.seed, self.cursor.epoch, int(pos[0]), _TOKENS_TAG)
        perm = _feistel.permute(np.arange(nb, dtype=np.int64), nb, _feistel.round_keys(key)).tolist()
        parts = []
        sizes = np.empty(nb + 1, dtype=np.int64)
        sizes[0] = 0
        for k, i in enumerate(perm):
            lo, b, a, hi = cuts[i]
            parts += [srt[lo:b], srt[a:hi]]
            sizes[k + 1] = (b - lo) + (hi - a)
        local = np.concatenate(parts)
        return _Window(pos[local], idx[local], np.cumsum(sizes))

    def _window(self, w: int) -> _Window:
        """Packed window w, from the cache or packed again."""
        win = self._cache.get(w)
        if win is None:
            win = self._pack(w)
            self._cache[w] = win
            self._cached += len(win.pos)
            while len(self._cache) > 2 and self._cached > _KEEP_SAMPLES:
                self._cached -= len(self._cache.popitem(last=False)[1].pos)
        else:
            self._cache.move_to_end(w)
        return win

    @property
    def _complete(self) -> bool:
        return len(self._cum) - 1 == self.windows

    def _grow(self) -> None:
        """Packs the next window of the sequence, recording its batch count."""
        w = len(self._cum) - 1
        win = self._window(w)
        first, nb = self._cum[-1], win.batches
        sizes = np.diff(win.bounds)
        np.add.at(self._sums, (first + np.arange(nb, dtype=np.int64)) % self.world, sizes)
        self._cum.append(first + nb)
        self._tail.append(sizes)
        self._tail_count += nb
        while self._tail_count - len(self._tail[0]) >= self.world:
            self._tail_count -= len(self._tail.popleft())
        if self._complete:
            self._finish()

    def _reach(self, g: int) -> None:
        """Packs windows until global batch g exists or every window is packed."""
        while self._cum[-1] <= g and not self._complete:
            self._grow()

    def _finish(self) -> None:
        """With every window counted: the steps per rank and the sizes of the last round's pieces."""
        w = self.world
        rounds, m = divmod(self._cum[-1], w)
        nb = np.full(w, rounds, dtype=np.int64)
        pieces = [0] * w
        if m:
            c = np.concatenate(list(self._tail))[-m:].tolist()
            p = sum(c)
            if p >= w:
                pieces = []
                for ci, k in zip(c, _split(c, w)):
                    pieces += [ci // k + (r < ci % k) for r in range(k)]
            elif self.spec.tail != "drop":
                pieces = [1] * p + [1 if self.spec.tail == "pad" else 0] * (w - p)
            nb += np.array(pieces, dtype=np.int64) > 0
            self._sums[:m] -= np.array(c, dtype=np.int64)
            self._sums += np.array(pieces, dtype=np.int64)
        self._nb = nb
        self._pieces = pieces

    def _full(self) -> np.ndarray:
        """Packs every window; the steps per rank."""
        while not self._complete:
            self._grow()
        assert self._nb is not None
        return self._nb

    def _batch(self, g: int) -> _Batch:
        """Global batch g, which must be packed already and not in a re-cut last round."""
        w = bisect.bisect_right(self._cum, g) - 1
        win = self._window(w)
        k = g - self._cum[w]
        a, b = int(win.bounds[k]), int(win.bounds[k + 1])
        return win.pos[a:b], win.idx[a:b]

    def _last_round(self) -> list[_Batch | None]:
        """The last round's batches rank by rank (None: the rank has no step in it)."""
        if self._last is None:
            w, g = self.world, self._cum[-1]
            pooled = [self._batch(i) for i in range(g - g % w, g)]
            pos = np.concatenate([p for p, _ in pooled])
            idx = np.concatenate([i for _, i in pooled])
            bounds = np.cumsum([0, *self._pieces]).tolist()
            last: list[_Batch | None] = []
            p = sum(len(b[0]) for b in pooled)
            for r in range(w):
                if not self._pieces[r]:
                    last.append(None)
                elif r < p:
                    last.append((pos[bounds[r] : bounds[r + 1]], idx[bounds[r] : bounds[r + 1]]))
                else:  # a pad: position r - p of the epoch's order
                    pad = np.array([(r - p) % self.spec.n], dtype=np.int64)
                    last.append((pad, order(self.spec, self.cursor.epoch, pad)))
            self._last = last
        return self._last

    def _step(self, rank: int, s: int) -> _Batch | None:
        """Rank's batch of step s, or None when it has no step s."""
        w = self.world
        self._reach((s + 1) * w - 1)
        if self._cum[-1] >= (s + 1) * w:  # round s is full: it is not the last one
            return self._batch(s * w + rank)
        if s == self._cum[-1] // w and self._cum[-1] % w:
            return self._last_round()[rank]
        return None

    def _check(self, rank: int, first: int) -> None:
        check_int("rank", rank, 0, self.world)
        check_int("first", first, 0)

    # ------------------------------------------------------------------ dealing

    def grant(self, rank: int, first: int, count: int, dealt: tuple[Runs, bool] | None = None) -> Grant:
        """The coordinator's answer: the steps asked, whatever they are.

        NOTE: this plan learns where a rank's steps end only by packing the epoch; the coordinator
        does not pack: it grants the steps asked, and the client's plan says where the epoch ends.
        """
        return Grant(count, 0, False, 0)

    def agrees(self, grant: Grant, sizes: list[int]) -> bool:
        """Always: the grant names no sizes (see :meth:`grant`)."""
        return True

    def ends(self, rank: int, first: int, count: int, got: int, grant: Grant | None) -> bool:
        """Whether `rank` has no step after this lease: it got fewer than asked, or the packing
        reached the epoch's end and its steps stop here."""
        known = self.known_steps(rank)
        return got < count or known is not None and known <= first + got

    def known_samples(self, rank: int) -> int:
        """0: a lease must not pay for counting the epoch's samples (that packs the whole epoch)."""
        return 0

    def lease(self, rank: int, first: int, count: int, grant: Grant | None = None) -> tuple[np.ndarray, list[int]]:
        """Steps first .. first + count - 1 of `rank` (fewer at the epoch's end).

        Returns:
            The dataset indices of the batches laid end to end, and each batch's size.
        """
        with self._lock:
            self._check(rank, first)
            parts, sizes = [], []
            for s in range(first, first + count):
                b = self._step(rank, s)
                if b is None:
                    break
                parts.append(b[1])
                sizes.append(len(b[1]))
        idx = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return idx, sizes

    def lease_positions(self, rank: int, first: int, count: int, grant: Grant | None = None) -> np.ndarray:
        """The order positions of :meth:`lease`'s indices."""
        with self._lock:
            self._check(rank, first)
            parts = []
            for s in range(first, first + count):
                b = self._step(rank, s)
                if b is None:
                    break
                parts.append(b[0])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def batch_sizes(self, rank: int, first: int, count: int) -> list[int]:
        """The sizes of steps first .. first + count - 1 of `rank` (fewer at the epoch's end)."""
        return self.lease(rank, first, count)[1]

    def known_steps(self, rank: int) -> int | None:
        """Rank's steps in this epoch if the packing has already reached the plan's end, else None (never packs)."""
        with self._lock:
            return None if self._nb is None else int(self._nb[rank])

    def steps(self, rank: int) -> int:
        """Rank's steps in this epoch; packs the whole epoch the first time (O(N))."""
        return int(self.nb_r[rank])

    @property
    def nb_r(self) -> np.ndarray:
        """(world,) steps per rank; packs the whole epoch the first time (O(N))."""
        with self._lock:
            nb: np.ndarray = self._full().copy()
        return nb

    def samples(self, rank: int) -> int:
        """How many indices `rank` gets in this epoch, pads included; packs the whole epoch the first time (O(N))."""
        with self._lock:
            self._full()
            return int(self._sums[rank])

    def done(self, j: int) -> bool:
        """True when every rank has had all its steps once each has had j (packs up to step j)."""
        with self._lock:
            w = self.world
            self._reach((max(j, 0) + 1) * w - 1)
            if self._cum[-1] >= (max(j, 0) + 1) * w:
                return False
            assert self._nb is not None
            return bool(j >= int(self._nb.max()))

    def advance(self, j: int) -> Cursor:
        """The cursor once every rank took min(j, its steps) steps: the first j * W global batches are consumed.

        When that is every step, the next epoch's fresh cursor. Otherwise the remaining positions
        are order-position intervals: those of the partly consumed window's later batches (up to
        S scattered ones), then every later window's.
        """
        with self._lock:
            if j <= 0:
                return self.cursor
            if self.done(j):
                return fresh(self.spec, self.cursor.epoch + 1)
            g = j * self.world  # not in the last round: done(j) is False, so rounds 0 .. j - 1 are full
            w = bisect.bisect_right(self._cum, g) - 1
            win = self._window(w)
            rest = np.sort(win.pos[int(win.bounds[g - self._cum[w]]) :])
            ints = intervals_of(rest) + self._intervals(min((w + 1) * self._window_size, self.left), self.left)
            return dataclasses.replace(self.cursor, remaining=tuple(merge_intervals(ints)))


def token_plan(spec: Spec, cursor: Cursor, world: int) -> TokenPlan:
    """How `cursor`'s remainder is dealt to `world` ranks as token-budget batches; packs nothing."""
    return TokenPlan(spec, cursor, world)
