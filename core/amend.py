"""Changes made to a running mixture: new weights, a source that grows, samples taken out; and a source's epochs under them.

An **amendment** is recorded by the coordinator while a job runs and becomes part of the job's
history when the job's next generation starts: it then holds from one stream position ``at`` on
(the first position that generation deals; ``None`` while it waits). Every rank of that
generation and of every later one, and every checkpoint taken from then on, carries the same
amendments, so a resume, a resize or a rollback replays the same stream.

- ``weights``: from ``at`` on, the sources' weights are these parts (of ``mixture.PARTS``); the
  spec's schedule of weights ends there.
- ``grow``: source ``s`` has ``size`` samples from its next source epoch on (the epoch in
  progress at ``at`` finishes with the samples it started with, so none of them is dealt twice
  or left out; a source at the very start of an epoch grows at once).
- ``skip``: the samples named are never dealt from ``at`` on, in the source epoch in progress
  too: a source's epoch deals every sample of it that is not skipped, once.

A source's **timeline** (:class:`Timeline`) maps the ``k``-th sample it deals in the run to its
source epoch and sample: without amendments, ``k // size`` and the permutation of that epoch at
``k % size``; amendments cut it into pieces, each with the size of its epochs' permutations and
the samples they leave out (found with the permutation's inverse, so a position still costs the
same at any ``k``).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from croupier.core.checks import check_choice, check_count, check_int, is_int

KINDS = ("weights", "grow", "skip")
#: Most samples one ``skip`` may name, and most a job may have skipped in all (each costs every
#: batch of its source a few numpy operations).
MAX_SKIP = 100_000
#: The (source, sample) pairs :meth:`Amendment.describe` shows of a skip (the rest are counted).
SHOWN = 8


@dataclasses.dataclass(frozen=True)
class Amendment:
    """One recorded change of a running mixture.

    Attributes:
        kind: ``"weights"``, ``"grow"`` or ``"skip"``.
        values: ``weights``: each source's parts; ``grow``: ``(source, old size, new size)``;
            ``skip``: ``(source, sample, source, sample, ...)``, each sample as numbered within its
            source, pairs sorted.
        at: The stream position from which it holds; None until a generation starts with it.
    """

    kind: str
    values: tuple[int, ...]
    at: int | None = None

    def to_list(self) -> list[Any]:
        """``[kind, values, at]``: the form checkpoints, the journal and the audit log write."""
        return [self.kind, list(self.values), self.at]

    @classmethod
    def from_list(cls, v: Any) -> Amendment:
        """Inverse of :meth:`to_list`.

        Raises:
            ValueError: not ``[kind, values, at]`` with a known kind and ints.
        """
        if not isinstance(v, (list, tuple)) or len(v) != 3 or not isinstance(v[1], (list, tuple)):
            raise ValueError(f"an amendment must be [kind, values, at] (got {v!r})")
        kind, values, at = v
        kind = check_choice("amendment kind", kind, KINDS)
        if not all(is_int(x) for x in values):
            raise ValueError(f"a {kind} amendment's values must be ints (got {list(values)!r})")
        if at is not None:
            check_int("amendment position", at, 0, type_error=ValueError)
        return cls(kind, tuple(values), at)

    def describe(self) -> str:
        """A short rendering for messages and the audit."""
        where = "pending" if self.at is None else f"from position {self.at}"
        if self.kind == "grow":
            return f"grow source {self.values[0]} from {self.values[1]} to {self.values[2]} samples ({where})"
        if self.kind == "skip":
            pairs = self.pairs
            shown = ", ".join(f"({s}, {j})" for s, j in pairs[:SHOWN])
            more = f" and {len(pairs) - SHOWN} more" if len(pairs) > SHOWN else ""
            return f"skip {len(pairs)} samples, (source, sample) {shown}{more} ({where})"
        return f"weights {list(self.values)} in parts ({where})"

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """A skip's (source, sample) pairs."""
        return list(zip(self.values[0::2], self.values[1::2]))


def sizes_after(sizes: Sequence[int], amendments: Sequence[Amendment]) -> tuple[int, ...]:
    """The sources' sizes once every ``grow`` of `amendments` has taken effect."""
    out = list(sizes)
    for a in amendments:
        if a.kind == "grow":
            out[a.values[0]] = max(out[a.values[0]], a.values[2])
    return tuple(out)


def minus(records: Sequence[Amendment], taken: Sequence[Amendment]) -> list[Amendment]:
    """`records` (in order) but for those `taken` accounts for, matched by kind and values as a multiset:
    the same weights recorded twice are two records, and a history holding one of them leaves the other."""
    left = collections.Counter((a.kind, a.values) for a in taken)
    out = []
    for a in records:
        if left[(a.kind, a.values)]:
            left[(a.kind, a.values)] -= 1
        else:
            out.append(a)
    return out


def skipped(amendments: Sequence[Amendment]) -> set[tuple[int, int]]:
    """Every (source, sample) some ``skip`` of `amendments` names."""
    return {p for a in amendments if a.kind == "skip" for p in a.pairs}


def skip_of(indices: Sequence[int], sizes: Sequence[int], before: Sequence[Amendment],
            numbered: Sequence[int]) -> Amendment:
    """A pending ``skip`` of dataset `indices`, numbered as a ConcatDataset of sources of sizes `numbered` numbers them.

    Args:
        indices: The dataset indices named.
        sizes: The sources' sizes in the job's spec.
        before: Every amendment recorded before, in order (held and pending).
        numbered: The sources' sizes the indices are numbered by: those the ranks hand them out
            with (the spec's, grown by the grows their generation holds; a grow still pending
            renumbers nothing).

    Returns:
        The skip, its (source, sample) pairs sorted.

    Raises:
        ValueError: an index out of range, already skipped, none or too many, or a skip that would
            leave a source with no sample.
    """
    now = sizes_after(sizes, before)
    if len(numbered) != len(now) or any(m > n for m, n in zip(numbered, now)):
        raise ValueError(f"indices numbered by sources of sizes {list(numbered)} are not the job's (sizes {list(now)})")
    if not indices:
        raise ValueError("skip needs at least one index")
    offsets = np.concatenate([[0], np.cumsum(np.array(numbered, dtype=np.int64))])
    done = skipped(before)
    pairs: set[tuple[int, int]] = set()
    for i in indices:
        check_int("index", i, None, type_error=ValueError)
        if not 0 <= int(i) < int(offsets[-1]):
            raise ValueError(f"index {i} is not in the dataset: indices are in [0, {int(offsets[-1])}) "
                             f"(sources of {', '.join(map(str, numbered))} samples)")
        s = int(np.searchsorted(offsets, int(i), side="right")) - 1
        p = (s, int(i) - int(offsets[s]))
        if p in done:
            raise ValueError(f"index {i} (source {s}, sample {p[1]}) is skipped already")
        pairs.add(p)
    if len(pairs) + len(done) > MAX_SKIP:
        raise ValueError(f"a job may skip at most {MAX_SKIP} samples ({len(done)} skipped, {len(pairs)} more asked)")
    for s in {p[0] for p in pairs}:
        left = now[s] - sum(1 for q in done | pairs if q[0] == s)
        if left < 1:
            raise ValueError(f"skipping these would leave source {s} ({now[s]} samples) with none to deal")
    return Amendment("skip", tuple(x for p in sorted(pairs) for x in p))


def check(sizes: Sequence[int], before: Sequence[Amendment], new: Amendment, parts: int, strict: bool = True) -> None:
    """Raises ValueError, naming the value, if `new` cannot follow `before` on sources of `sizes`.

    Args:
        sizes: The sources' sizes in the job's spec.
        before: The amendments already recorded, in order.
        new: The one to check (its ``at`` is not checked).
        parts: What a weights amendment's parts must add up to (``mixture.PARTS``).
        strict: As a new request is checked: a grow from the source's size now to a larger one, a
            skip of samples not skipped yet. Not strict, as a history is read: a grow to a size the
            source has reached already, or a sample skipped twice, changes nothing (a checkpoint's
            amendments taken back by a coordinator that lost its store may come before ones
            recorded since).
    """
    now = sizes_after(sizes, before)
    v = new.values
    if new.kind == "weights":
        check_count("weights", v, len(sizes), "sources")  # one part per weight given: the count is the user's
        if any(p < 0 for p in v) or sum(v) != parts:
            raise ValueError(f"new weights must be {len(sizes)} parts >= 0 adding up to {parts} (got {list(v)})")
    elif new.kind == "grow":
        if len(v) != 3 or not 0 <= v[0] < len(sizes):
            raise ValueError(f"grow names a source in [0, {len(sizes)}) and its old and new sizes (got {list(v)})")
        if strict and v[1] != now[v[0]]:
            raise ValueError(f"source {v[0]} has {now[v[0]]} samples, not {v[1]} (grow from its size now)")
        if v[2] <= v[1]:
            raise ValueError(f"a source only grows: source {v[0]} has {v[1]} samples (got new size {v[2]})")
    elif new.kind == "skip":
        if not v or len(v) % 2:
            raise ValueError(f"skip names (source, sample) pairs (got {list(v)})")
        pairs = new.pairs
        for s, j in pairs:
            if not 0 <= s < len(sizes) or not 0 <= j < now[s]:
                raise ValueError(f"source {s} has no sample {j}")
        if len(set(pairs)) != len(pairs) or pairs != sorted(pairs):
            raise ValueError("skip's (source, sample) pairs must be sorted and distinct")
        seen = skipped(before)
        again = [p for p in pairs if p in seen]
        if again and strict:
            raise ValueError(f"(source, sample) {again[0]} is skipped already")
        total = seen | set(pairs)
        if len(total) > MAX_SKIP:
            raise ValueError(f"a job may skip at most {MAX_SKIP} samples (this makes {len(total)})")
        for s in {p[0] for p in pairs}:
            if now[s] - sum(1 for q in total if q[0] == s) < 1:
                raise ValueError(f"skipping these would leave source {s} ({now[s]} samples) with none to deal")
    else:
        raise ValueError(f"amendment kind must be one of {', '.join(map(repr, KINDS))} (got {new.kind!r})")


# --------------------------------------------------------------------------- a source's timeline


#: A source epoch's permutation, (epoch, domain, raw offsets) -> samples, or its inverse (see Timeline).
Perm = Any


@dataclasses.dataclass(frozen=True)
class _Piece:
    start: int  # the source's count at which it begins
    epoch: int  # the source epoch of count `start`
    raw0: int  # the raw offset in `epoch`'s permutation it begins at (0: the epoch's start)
    first_size: int  # the domain of `epoch`'s permutation
    size: int  # the domain of every later epoch's
    skip: np.ndarray  # sorted samples left out (int64)
    first_len: int  # samples it deals in `epoch`

    @property
    def rest_len(self) -> int:
        return self.size - int(np.searchsorted(self.skip, self.size))


class Timeline:
    """One source's epochs under its amendments: the ``k``-th sample it deals -> (source epoch, sample).

    Args:
        size: The source's size in the spec.
        perm: ``perm(epoch, n, raw) -> samples``: the permutation of [0, n) of a source epoch.
        unperm: Its inverse, ``unperm(epoch, n, samples) -> raw``.
    """

    def __init__(self, size: int, perm: Perm, unperm: Perm) -> None:
        self._perm, self._unperm = perm, unperm
        self._size = size
        self.pieces: list[_Piece] = [_Piece(0, 0, 0, size, size, np.zeros(0, dtype=np.int64), size)]

    @property
    def plain(self) -> bool:
        """No amendment changed it: sample ``k`` is offset ``k % size`` of epoch ``k // size``."""
        p = self.pieces[0]
        return len(self.pieces) == 1 and p.size == p.first_size == self._size and not p.skip.size

    @property
    def size(self) -> int:
        """The domain of its latest epochs (its size once every grow took effect)."""
        return self.pieces[-1].size

    def _gaps(self, epoch: int, n: int, skip: np.ndarray, r0: int) -> np.ndarray:
        """The raw offsets >= r0 of `epoch`'s permutation of [0, n) whose samples are skipped, sorted."""
        sk = skip[: int(np.searchsorted(skip, n))]
        if not sk.size:
            return sk
        z = np.sort(self._unperm(epoch, n, sk))
        return z[z >= r0]

    def _raw(self, epoch: int, n: int, skip: np.ndarray, r0: int, i: np.ndarray) -> np.ndarray:
        """The raw offset of each `i`-th sample not skipped at or after r0 in `epoch`'s permutation."""
        z = self._gaps(epoch, n, skip, r0)
        if not z.size:
            return r0 + i
        g = z - r0 - np.arange(z.size, dtype=np.int64)  # samples dealt before each gap
        out: np.ndarray = r0 + i + np.searchsorted(g, i, side="right")
        return out

    def _split(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(piece, epoch, i, r0, domain) of each count: the i-th sample at or after raw offset r0 of `epoch`."""
        starts = np.array([p.start for p in self.pieces], dtype=np.int64)
        which = np.searchsorted(starts, k, side="right") - 1
        epoch, i, r0, dom = (np.empty_like(k) for _ in range(4))
        for w in sorted(set(which.tolist())):
            p = self.pieces[w]
            sel = which == w
            d = k[sel] - p.start
            first = d < p.first_len
            later = np.maximum(d - p.first_len, 0)
            rest = max(p.rest_len, 1)
            epoch[sel] = np.where(first, p.epoch, p.epoch + 1 + later // rest)
            i[sel] = np.where(first, d, later % rest)
            r0[sel] = np.where(first, p.raw0, 0)
            dom[sel] = np.where(first, p.first_size, p.size)
        return which, epoch, i, r0, dom

    def locate(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source epoch, sample) of each count `k` (the ``k``-th sample the source deals in the run)."""
        k = np.asarray(k, dtype=np.int64).reshape(-1)
        which, epoch, i, r0, dom = self._split(k)
        raw = r0 + i
        for w in sorted(set(which.tolist())):
            p = self.pieces[w]
            if not p.skip.size:
                continue
            sel = np.flatnonzero(which == w)
            groups = np.unique((epoch[sel] << 1) | (r0[sel] > 0))
            for gkey in groups.tolist():
                e, late = gkey >> 1, gkey & 1
                g = sel[((epoch[sel] << 1) | (r0[sel] > 0)) == gkey]
                n = p.first_size if e == p.epoch else p.size
                raw[g] = self._raw(e, n, p.skip, p.raw0 if late else 0, i[g])
        sample = np.empty_like(k)
        for n in sorted(set(dom.tolist())):
            sel = dom == n
            sample[sel] = self._perm(epoch[sel], n, raw[sel])
        return epoch, sample

    def _where(self, k: int) -> tuple[int, int, bool]:
        """(epoch, raw offset, whether it begins its epoch) of count `k`, which is in the last piece."""
        _, epoch, i, r0, dom = self._split(np.array([k], dtype=np.int64))
        p = self.pieces[-1]
        e = int(epoch[0])
        raw = int(self._raw(e, int(dom[0]), p.skip, int(r0[0]), i[:1])[0])
        d = k - p.start
        first = d == 0 and p.raw0 == 0 if d < p.first_len else (d - p.first_len) % p.rest_len == 0
        return e, raw, first

    def amend(self, k: int, grow_to: int | None = None, skip: Sequence[int] = ()) -> None:
        """Applies a grow to `grow_to` samples or a skip of `skip` from the source's count `k` on.

        `k` MUST be at or after the start of the last piece (amendments come in stream order).
        """
        last = self.pieces[-1]
        if k < last.start:
            raise ValueError(f"an amendment at count {k} comes before the last one's {last.start}")
        if grow_to is not None and grow_to <= last.size:
            grow_to = None  # grown that far already: nothing changes
            if not len(skip):
                return
        e, raw, first = self._where(k)
        dom_e = last.first_size if e == last.epoch else last.size
        size = grow_to if grow_to is not None else last.size
        sk = np.union1d(last.skip, np.asarray(skip, dtype=np.int64)).astype(np.int64) if len(skip) else last.skip
        if first:
            raw0, first_size = 0, size
        else:
            raw0, first_size = raw, dom_e
        gaps = self._gaps(e, first_size, sk, raw0)
        piece = _Piece(k, e, raw0, first_size, size, sk, first_size - raw0 - int(gaps.size))
        if piece.rest_len < 1:
            raise ValueError(f"the amendment at count {k} leaves the source with no sample to deal")
        self.pieces = [p for p in self.pieces if p.start < k] + [piece]

    def epoch_start(self, epoch: int) -> int:
        """The count at which source epoch `epoch` begins."""
        for p in reversed(self.pieces):
            if p.epoch == epoch and p.raw0 == 0:
                return p.start
            if p.epoch < epoch:
                return p.start + p.first_len + (epoch - p.epoch - 1) * p.rest_len
        raise AssertionError("the first piece begins epoch 0")  # pragma: no cover

    def epoch_sizes(self, epoch: int) -> tuple[int, int]:
        """(samples dealt in source epoch `epoch`, samples its permutation covers): their difference was skipped."""
        n = self.epoch_start(epoch + 1) - self.epoch_start(epoch)
        for p in reversed(self.pieces):
            if p.epoch < epoch or (p.epoch == epoch and p.raw0 == 0):
                return n, p.size if p.epoch < epoch else p.first_size
        raise AssertionError("the first piece begins epoch 0")  # pragma: no cover
