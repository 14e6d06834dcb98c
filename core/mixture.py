"""A weighted mixture of sources as a pure function of a position: which source, which sample, which seed.

A mixture deals a stream of global positions 0, 1, 2, ... Position ``p`` names one source ``s``
and the ``k``-th sample that source deals (``k`` counts from the start of the run). Source
``s`` has its own epochs: its ``k``-th sample is offset ``k % size_s`` of its epoch
``k // size_s``, whose order is a keyed permutation of ``[0, size_s)`` (``core.feistel``), so
every sample of a source is dealt exactly once in each of that source's epochs. Indices are
returned in one global index space, as ``torch.utils.data.ConcatDataset`` numbers them: source
``s``'s sample ``j`` is ``offsets[s] + j``.

**Which source at which position.** The sources are the leaves of a binary tree built as a
Huffman code over their weights (merging the two lightest). Each inner node splits the positions
that reach it between its two children as a Beatty sequence: with ``a`` and ``b`` the children's
weights, the ``q``-th position of the node goes to the first child exactly when
``floor(((q + 1) * a + h) / (a + b)) > floor((q * a + h) / (a + b))`` (``h = (a + b) // 2``), and
is that child's position ``floor((q * a + h) / (a + b))``, else the other child's position
``q - floor((q * a + h) / (a + b))``. Everything is integer arithmetic: a position costs one step
per level of the tree, and so does the count a source has dealt before a position, so a resume
costs the same at position 10 and at position 10**11, with no table over the samples.

**How exact.** Over any ``K`` consecutive positions, a source ``s`` deals ``w_s * K`` samples
give or take less than :meth:`Mixture.window_bound` ``(s)``, for every ``K`` and every start:

- two sources: less than 1 (each child of a Beatty split is exact to within 1);
- more: ``1 + sum(w_s / w_a)`` over the inner nodes ``a`` above ``s`` other than the root (each
  split adds its own error, less than 1, to its parent's, scaled by the child's share). It is
  1.5 for three or four equal weights and about 2 for a hundred or a thousand.

Within 1 for every window cannot be had with three or more sources in general: each source would
have to be a Beatty sequence of its own, and three Beatty sequences with different rates do not
share out the positions between them (``tests/core/test_mixture.py`` shows it by exhaustive search for
weights such as 0.293 / 0.656 / 0.051, where no sequence of even 13 positions keeps every window
of every source within 1).

**Weights.** Weights are rounded to whole parts of ``PARTS`` (2**24) by largest remainder; the
proportions above are exact for the rounded weights. Positions must stay below
``MAX_POSITION`` (about 5.5e11) so the integer arithmetic cannot overflow.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from croupier.core import feistel
from croupier.core.checks import check_int, check_weights

PARTS = 1 << 24
MAX_POSITION = (1 << 63) // PARTS - 1
#: Tells the per-sample seeds apart from every other key croupier derives (the bytes of "croupier/sample").
_SAMPLE_TAG = int.from_bytes(b"croupier/sample", "little")
#: Tells each source's permutation keys apart from every other key croupier derives (the bytes of "croupier/source").
SOURCE_TAG = int.from_bytes(b"croupier/source", "little")


def parts_of(weights: Sequence[float]) -> tuple[int, ...]:
    """The weights as whole parts of PARTS (largest remainder; every positive weight gets at least one part).

    Raises:
        ValueError: no weights, a negative, non-finite or all-zero weight list, or more sources than parts.
    """
    ws = check_weights(weights)
    total = sum(ws)
    positive = [i for i, w in enumerate(ws) if w > 0]
    if len(positive) > PARTS:
        raise ValueError(f"{len(positive)} sources with a weight: at most {PARTS}")
    exact = np.array(ws, dtype=np.float64) / total * PARTS
    floor = exact.astype(np.int64)
    pos = np.array(positive, dtype=np.int64)
    arr = floor.copy()
    arr[pos] = np.maximum(arr[pos], 1)
    short = PARTS - int(arr.sum())
    if short > 0:
        # Largest remainder first (ties by source), only among sources that have a weight; round and round.
        order = pos[np.lexsort((pos, -(exact[pos] - floor[pos])))]
        q, r = divmod(short, order.size)
        arr[order] += q
        arr[order[:r]] += 1
    parts = arr.tolist()
    while short < 0:  # sources raised to one part took more than the remainders gave: the largest part gives one back
        i = max(positive, key=lambda j: (parts[j], -j))
        parts[i] -= 1
        short += 1
    return tuple(parts)


@dataclasses.dataclass(frozen=True)
class _Tree:
    """The Huffman tree as lists indexed by node id (leaves first, the root last); a leaf has
    first = second = -1 and its source, an inner node source -1."""

    weight: list[int]
    first: list[int]  # the heavier child: it takes the node's first position
    second: list[int]
    source: list[int]


@dataclasses.dataclass(frozen=True)
class Mixture:
    """The stream of one set of weights over sources of the given sizes, dealt from position 0.

    Attributes:
        sizes: Samples of each source (each >= 1).
        parts: Each source's weight in parts of PARTS (see :func:`parts_of`); a source with 0
            parts is never dealt.
        seed: The job's seed: each source's permutations and every sample's seed derive from it.
    """

    sizes: tuple[int, ...]
    parts: tuple[int, ...]
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.parts):
            raise ValueError(f"{len(self.sizes)} sizes for {len(self.parts)} weights")
        for i, n in enumerate(self.sizes):
            check_int(f"sizes[{i}]", n, 1, type_error=ValueError)
        if sum(self.parts) != PARTS or any(p < 0 for p in self.parts):
            raise ValueError(f"parts {self.parts!r} must be >= 0 and add up to {PARTS} (see parts_of)")

    @classmethod
    def of(cls, sizes: Sequence[int], weights: Sequence[float], seed: int = 0) -> Mixture:
        """A mixture of sources of `sizes` with `weights` (any positive scale: they are normalised)."""
        return cls(tuple(int(n) for n in sizes), parts_of(weights), int(seed))

    # ---------------------------------------------------------------- the tree

    @functools.cached_property
    def _tree(self) -> _Tree:
        parts = np.array(self.parts, dtype=np.int64)
        src = np.flatnonzero(parts > 0)
        weight, source = parts[src].tolist(), src.tolist()
        leaves = len(weight)
        first, second = [-1] * leaves, [-1] * leaves
        # Huffman's two queues: the leaves by (weight, id), and the merged nodes, which come out in
        # that order too; the lighter front is the next to merge, as a heap of every node would pick.
        queue: list[int] = np.lexsort((np.arange(leaves), np.array(weight, dtype=np.int64))).tolist()
        li, mi = 0, leaves  # fronts of the leaf queue and of the merged nodes (ids leaves, leaves + 1, ...)

        def pop() -> int:
            nonlocal li, mi
            if li < leaves and (mi >= len(weight) or (weight[queue[li]], queue[li]) < (weight[mi], mi)):
                li += 1
                return queue[li - 1]
            mi += 1
            return mi - 1

        for _ in range(leaves - 1):
            a, b = pop(), pop()  # a is the lighter: the heavier child goes first
            weight.append(weight[a] + weight[b])
            first.append(b)
            second.append(a)
            source.append(-1)
        return _Tree(weight, first, second, source)

    @functools.cached_property
    def _paths(self) -> dict[int, tuple[tuple[int, bool], ...]]:
        """Each dealt source's path from the root: (inner node id, goes to its first child) per level."""
        t = self._tree
        paths: dict[int, tuple[tuple[int, bool], ...]] = {}
        stack: list[tuple[int, tuple[tuple[int, bool], ...]]] = [(len(t.weight) - 1, ())]
        while stack:
            node, path = stack.pop()
            if t.source[node] >= 0:
                paths[t.source[node]] = path
                continue
            stack.append((t.first[node], path + ((node, True),)))
            stack.append((t.second[node], path + ((node, False),)))
        return paths

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """Where each source's samples start in the global index space (ConcatDataset's numbering)."""
        out, at = [], 0
        for n in self.sizes:
            out.append(at)
            at += n
        return tuple(out)

    def window_bound(self, source: int) -> float:
        """A bound, strictly above, on how far `source`'s count in any window of K positions is from weight * K."""
        path = self._paths.get(source)
        if path is None:
            return 0.0  # never dealt: its count is exactly 0 = 0 * K
        w = self.parts[source]
        return 1.0 + sum(w / self._tree.weight[node] for node, _ in path[1:])

    # ---------------------------------------------------------------- positions

    def _check(self, positions: np.ndarray) -> None:
        if positions.size and (int(positions.min()) < 0 or int(positions.max()) > MAX_POSITION):
            raise ValueError(f"positions must be in [0, {MAX_POSITION}]: got {int(positions.min())} .. "
                             f"{int(positions.max())}")

    @functools.cached_property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The tree as arrays indexed by node id: first child's weight, weight, first child, second child, source."""
        t = self._tree
        weight = np.array(t.weight, dtype=np.int64)
        first = np.array(t.first, dtype=np.int64)
        first_w = np.where(first >= 0, weight[np.maximum(first, 0)], 0)
        return first_w, weight, first, np.array(t.second, dtype=np.int64), np.array(t.source, dtype=np.int64)

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, k) of each global position: the source dealing it and how many that source dealt before it."""
        local = np.asarray(positions, dtype=np.int64).reshape(-1).copy()
        self._check(local)
        first_w, weight, first, second, source = self._arrays
        node = np.full(local.shape, len(weight) - 1, dtype=np.int64)
        inner = np.flatnonzero(source[node] < 0)
        # One level of the tree per pass, for every position still at an inner node.
        while inner.size:
            at, q = node[inner], local[inner]
            a, total = first_w[at], weight[at]
            half = total // 2
            before = (q * a + half) // total
            goes_first = (q + 1) * a + half >= (before + 1) * total
            node[inner] = np.where(goes_first, first[at], second[at])
            local[inner] = np.where(goes_first, before, q - before)
            inner = inner[source[node[inner]] < 0]
        return source[node], local

    def count(self, source: int, position: int) -> int:
        """How many samples `source` has dealt at positions [0, position), one step per level of the tree."""
        path = self._paths.get(source)
        if path is None:
            return 0
        q = int(position)
        t = self._tree
        for node, first in path:
            total = t.weight[node]
            before = (q * t.weight[t.first[node]] + total // 2) // total
            q = before if first else q - before
        return q

    def dealt_before(self, position: int) -> tuple[int, ...]:
        """How many samples each source has dealt at positions [0, position)."""
        self._check(np.array([position]))
        return tuple(self.count(s, position) for s in range(len(self.sizes)))

    def position_of(self, source: int, count: int) -> int:
        """The first position by which `source` has dealt `count` samples (``count(source, p) >= count``)."""
        if count <= 0:
            return 0
        if self.parts[source] == 0:
            raise ValueError(f"source {source} has no weight: it never deals {count} samples")
        # count(source, p) >= p * w - window_bound: this p is far enough, and the search is a bisection.
        hi = int((count + self.window_bound(source) + 1) * PARTS / self.parts[source]) + 2
        while self.count(source, hi) < count:
            hi *= 2
        lo = 0
        while lo < hi:
            mid = (lo + hi) // 2
            if self.count(source, mid) >= count:
                hi = mid
            else:
                lo = mid + 1
        if lo > MAX_POSITION:
            raise ValueError(f"source {source} reaches {count} samples only at position {lo}, past {MAX_POSITION}")
        return lo

    def indices(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(global index, source, source epoch) of each position."""
        source, k = self.locate(positions)
        return indices_of(self.sizes, self.seed, source, k)


def indices_of(sizes: Sequence[int], seed: int, source: np.ndarray, k: np.ndarray,
               shuffle: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(global index, source, source epoch) of each `source`'s `k`-th sample dealt since the run began.

    Source ``s``'s ``k``-th sample is offset ``k % size`` of its epoch ``k // size``, permuted by
    that source epoch's keyed permutation (``shuffle``; else in order).
    """
    size = np.array(sizes, dtype=np.int64)[source]
    epoch, offset = np.divmod(k, size)
    offsets = np.concatenate([[0], np.cumsum(np.array(sizes, dtype=np.int64))[:-1]]).astype(np.int64)
    if not shuffle or k.size == 0:
        return offset + offsets[source], source, epoch
    index = np.empty_like(k)
    # One Feistel pass per distinct source size, each element keyed by its (source, source epoch).
    combo, which = source_epoch_pairs(source, epoch)
    keys = round_keys(base_key(seed, SOURCE_TAG), combo)  # (ROUNDS, pairs)
    # NOTE: distinct sizes from a set, not np.unique: numpy 2's unique of plain values imports numpy.ma on first
    # use, some 10 ms of a resumed process's first batch.
    for n in sorted(set(size.tolist())):
        sel = size == n
        index[sel] = feistel.permute(offset[sel], n, keys[:, which[sel]])
    return index + offsets[source], source, epoch


# NOTE: the keys of the source epochs and of the samples' seeds are derived in numpy, for a whole
# lease at once: one blake2b key per job (core.feistel.derive_key, with a tag of its own), then
# the SplitMix64 finaliser, a bijection of 64-bit words, over (source, source epoch) packed in one
# word. A resumed batch of a mixture of 1,000 sources touches up to 256 source epochs, and a
# blake2b per round key of each (1,800 of them) was most of its first batch.
_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """The SplitMix64 finaliser of each uint64 (a bijection)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        out: np.ndarray = z ^ (z >> np.uint64(31))
    return out


@functools.lru_cache(maxsize=256)
def base_key(seed: int, tag: int) -> int:
    """The key a job's `seed` derives for one use of keys (`tag`: SOURCE_TAG, ...)."""
    return feistel.derive_key(seed, tag)


def source_epoch_pairs(source: np.ndarray, epoch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (source, source epoch) pairs packed one in an int64 (source << 40 | epoch), and
    which pair each element is (one 1-D unique, not a 2-D one)."""
    # Sources are below 2**23 (MAX_SOURCES) and source epochs below MAX_POSITION < 2**40.
    combo, which = np.unique((source << 40) | epoch, return_inverse=True)
    return combo, which.reshape(-1)


def _pair_keys(base: int, combo: np.ndarray) -> np.ndarray:
    """A 64-bit key per packed (source, source epoch) under `base`: distinct pairs, distinct keys."""
    return _mix(np.uint64(base) ^ _mix(combo.astype(np.uint64)))


def round_keys(base: int, combo: np.ndarray) -> np.ndarray:
    """The Feistel round keys of each packed (source, source epoch): shape (ROUNDS, pairs)."""
    key = _pair_keys(base, combo)
    with np.errstate(over="ignore"):
        rounds = np.arange(1, feistel.ROUNDS + 1, dtype=np.uint64)[:, None] * _GOLDEN
        return _mix(key[None, :] + rounds)


def permute_source(seed: int, source: int, epoch: int, n: int, offsets: np.ndarray) -> np.ndarray:
    """Source `source`'s samples at `offsets` of its epoch `epoch`: a keyed permutation of [0, n)."""
    off = np.asarray(offsets, dtype=np.int64).reshape(-1)
    keys = round_keys(base_key(seed, SOURCE_TAG), np.array([(source << 40) | epoch], dtype=np.int64))
    return feistel.permute(off, n, np.repeat(keys, off.size, axis=1))


def sample_seeds(seed: int, source: np.ndarray, epoch: np.ndarray, index: np.ndarray) -> np.ndarray:
    """The seed of each dealt sample (int64, in [0, 2**63)) from (job seed, source, source epoch, index).

    A key per (source, source epoch) under the job's seed, mixed with the index by the SplitMix64
    finaliser, for a whole lease at once.
    """
    src = np.asarray(source, dtype=np.int64).reshape(-1)
    ep = np.asarray(epoch, dtype=np.int64).reshape(-1)
    idx = np.asarray(index, dtype=np.int64).reshape(-1)
    if src.size == 0:
        return np.zeros(0, dtype=np.int64)
    combo, which = source_epoch_pairs(src, ep)
    keys = _pair_keys(base_key(seed, _SAMPLE_TAG), combo)[which]
    with np.errstate(over="ignore"):
        z = _mix(keys ^ (idx.astype(np.uint64) * _GOLDEN))
    out: np.ndarray = (z >> np.uint64(1)).astype(np.int64)
    return out


def sample_seed(seed: int, source: int, epoch: int, index: int) -> int:
    """The seed of one dealt sample: a 63-bit int from (job seed, source, source epoch, index).

    The same on any world size, any number of workers and after any resume, since it depends on
    what the sample is and nothing on who dealt it. Use it for the sample's random crops, masks
    or augmentations: ``torch.Generator().manual_seed(sample_seed(...))``. A sampler made with
    ``tag=True`` hands out each index with its seed already worked out (``Sample.seed``).
    """
    return int(sample_seeds(seed, np.array([source]), np.array([epoch]), np.array([index]))[0])
