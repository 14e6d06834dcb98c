"""A job's spec: every setting that decides which indices a rank receives, and in what order."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from croupier.core import mixture
from croupier.core.amend import Amendment, sizes_after
from croupier.core.checks import check_bool, check_choice, check_int
from croupier.core.stream import stream

#: The names of the orders (``croupier.core.permute`` holds one kernel for each name, no other).
PERMUTATIONS = ("none", "torch", "feistel", "window", "bucket", "shards")
#: The orders that shuffle within each rank's part (``scope="rank"``).
RANK_SCOPE_PERMUTATIONS = ("feistel", "window", "none")
PARTITIONS = ("strided", "chunked", "contiguous")
TAILS = ("pad", "drop", "uneven", "pad_last")
SCOPES = ("global", "rank")
COSTS = ("sum", "padded")
DEALINGS: tuple[str, ...] = ("static", "dynamic")
#: The default window of token-budget batching, in positions of the epoch's order.
TOKEN_WINDOW = 4096
#: Fields added after the first release, with their defaults: a spec that leaves them at their
#: defaults has the fingerprint it had before they existed (G9: saved states keep loading).
_LATER_FIELDS = {"max_tokens": None, "cost": "sum", "token_window": TOKEN_WINDOW, "dealing": "static",
                 "sources": None, "weights": None, "max_epochs": None, "shards": None, "shard_window": 32, "lanes": 16,
                 "reader_group": 1}
#: Most shards one dataset may have (a shard order's table costs 8 bytes a shard an epoch below 2**32 samples, 16 above).
MAX_SHARDS = 2**27
#: Most sources one mixture may have.
MAX_SOURCES = 100_000

#: Largest dataset size the engine accepts (positions are int64; the Feistel domain is < 2**63).
MAX_N = 2**62

#: The version of what the orders yield: which dataset index every position of every epoch of
#: every spec maps to. Version 1 is croupier 0.1's orders (its ``bucket`` shuffled the packs with
#: numpy's PCG64 stream); version 2 shuffles them with croupier's own keyed Feistel bijection.
#:
#: NOTE: a checkpoint state names *positions* of an epoch's order, so an order that changed
#: silently between releases would re-map every saved checkpoint while its fingerprint still
#: matched. Hence the rule: ANY change to what an order yields for an existing spec (a Feistel
#: round or constant, a key derivation, the bucket sort or pack shuffle, a partition or tail
#: rule, a mixture's tree, segments, source permutations or sample seeds) MUST bump ORDER_VERSION
#: and regenerate tests/golden/orders.json and tests/golden/mixtures.json with
#: tests/golden/make_golden.py, in the same change. tests/core/test_golden.py fails on any such
#: change, including one a dependency makes under us (torch's randperm for ``torch``).
#: ORDER_VERSION is part of :attr:`Spec.fingerprint` and of every checkpoint state, and a state
#: of another order version is refused by name instead of being read against the wrong order.
ORDER_VERSION = 2


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a job's data order is made of. Every rank of a job MUST send the same spec.

    Attributes:
        n: Dataset size N; indices are drawn from [0, n).
        seed: Shuffle seed, in [0, 2**63).
        permutation: How an epoch's order is laid out over positions [0, n):
            ``none`` (identity), ``torch`` (``torch.randperm`` seeded with ``seed + epoch``,
            bit-exact with torch's ``DistributedSampler``), ``feistel`` (a keyed stateless
            bijection, O(1) memory and random access), ``window`` (shuffle within windows of
            ``buffer_size`` consecutive positions, DGL's buffer), ``bucket`` (d9d's length
            bucketing: sort each window of ``buffer_size`` by ``lengths``, cut into packs of
            ``pack_size``, shuffle the packs), ``shards`` (a shard-local order over ``shards``:
            the shards in a keyed order, cut into windows of ``shard_window`` shards, each
            window's samples shuffled; see ``croupier.core.shards``).
        partition: How positions are dealt to ranks: ``strided`` (round-robin: torch, spdl,
            d9d ``sequential``), ``chunked`` (d9d ``chunked``: contiguous blocks of
            ``ceil(T / W)``), ``contiguous`` (DGL's split: contiguous blocks whose sizes differ
            by at most one).
        tail: What happens when the epoch's remainder R does not divide by the world size W:
            ``pad`` (torch ``drop_last=False``: repeat from the start of the order up to
            ``ceil(R / W) * W``), ``drop`` (torch ``drop_last=True``, spdl
            ``ddp_drop_last_distributed_round=True``: keep ``floor(R / W) * W``), ``uneven``
            (spdl ``False``: keep all R, ranks differ by at most one), ``pad_last`` (d9d
            ``pad_to_equal_size_across_shards``: repeat the order's last element up to
            ``ceil(R / W) * W``).
        scope: ``global`` shuffles the whole epoch; ``rank`` splits first and shuffles within
            each rank's part (DGL ``DistributedItemSampler``), which needs a contiguous
            partition.
        buffer_size: Window size for ``window`` and ``bucket``; ``None`` means one window.
        pack_size: Pack size for ``bucket``.
        batch_size: Indices per batch of one rank.
        drop_last_batch: Drop a rank's last batch of an epoch when it is incomplete.
        even_batches: Give every rank the same number of batches, the smallest any rank has
            (DGL ``drop_uneven_inputs``).
        lengths: Per-sample lengths (sort keys for ``bucket``, token counts for ``max_tokens``)
            as little-endian int64 bytes (see :meth:`with_lengths`); when given, ``n`` is their count.
        max_tokens: Token-budget batching (``croupier.core.tokens``): each batch is as many
            samples as fit in this budget by `cost`, formed within windows of `token_window`
            positions of the epoch's order; ``batch_size`` must stay 1 (it is not used).
        cost: What a batch costs against `max_tokens`: ``sum`` (its lengths added up) or
            ``padded`` (its longest length times its size, what a padded tensor holds).
        token_window: Positions of the epoch's order that one packing window holds.
        dealing: ``static`` (a generation's positions are striped over its ranks when it starts)
            or ``dynamic`` (the coordinator hands the next batches to whichever rank asks; see
            ``croupier.core.dynamic``).
        sources: A mixture (``croupier.core.mixture``): each source's size. Dataset indices are
            then numbered as ``ConcatDataset`` numbers its datasets' samples, and an epoch is
            ``n`` consecutive positions of the run's one stream of samples (epoch ``e`` is stream
            positions ``e * n`` to ``(e + 1) * n``), while each source goes through epochs of
            its own. ``permutation`` is then ``feistel`` (each source epoch shuffled) or ``none``.
        weights: The mixture's weights as a schedule: ``(stream position, parts)`` pairs, the first
            at 0, each source's weight in parts of ``croupier.core.mixture.PARTS``.
        max_epochs: Each source's cap in epochs of its own (0: no cap); from its last sample on,
            its weight is shared out among the others.
        amendments: A mixture's changes recorded while the job ran (``croupier.core.amend``), each
            with the stream position it holds from. Not a setting: the coordinator gives them to
            each generation, and they are left out of :attr:`fingerprint` (a checkpoint carries
            them beside it). A rank MUST send its spec without them.
        shards: A dataset stored in shards: each shard's sample count, in the dataset's order, as
            little-endian int64 bytes (see :meth:`with_shards`); they add up to ``n``, and dataset
            indices number the shards' samples as ``ConcatDataset`` does. ``permutation`` is then
            ``shards``.
        shard_window: Shards per window of a shard order: the samples of a window are shuffled
            together.
        lanes: Windows a reader group reads at once (its reading heads): about ``lanes *
            shard_window`` shards are live in a group's cache.
        reader_group: Ranks per reader group: consecutive ranks that share one cache (a node's
            ranks); each group reads its own shards.
    """

    n: int
    seed: int = 0
    permutation: str = "feistel"
    partition: str = "strided"
    tail: str = "pad"
    scope: str = "global"
    buffer_size: int | None = None
    pack_size: int | None = None
    batch_size: int = 1
    drop_last_batch: bool = False
    even_batches: bool = False
    lengths: bytes | None = None
    max_tokens: int | None = None
    cost: str = "sum"
    token_window: int = TOKEN_WINDOW
    dealing: str = "static"
    sources: tuple[int, ...] | None = None
    weights: tuple[tuple[int, tuple[int, ...]], ...] | None = None
    max_epochs: tuple[int, ...] | None = None
    amendments: tuple[Amendment, ...] | None = None
    shards: bytes | None = None
    shard_window: int = 32
    lanes: int = 16
    reader_group: int = 1

    def __post_init__(self) -> None:
        # A spec read back from msgpack or JSON has lists where it had tuples: one form, hashable.
        if isinstance(self.sources, (list, tuple)):
            object.__setattr__(self, "sources", tuple(self.sources))
        if isinstance(self.max_epochs, (list, tuple)):
            # No cap on any source is no caps: one spec, one fingerprint (and one form on the wire).
            object.__setattr__(self, "max_epochs", tuple(self.max_epochs) if any(self.max_epochs) else None)
        if isinstance(self.weights, (list, tuple)):
            object.__setattr__(self, "weights", tuple(
                (c[0], tuple(c[1])) if isinstance(c, (list, tuple)) and len(c) == 2 and isinstance(c[1], (list, tuple))
                else c for c in self.weights))
        if isinstance(self.amendments, (list, tuple)):
            object.__setattr__(self, "amendments", tuple(
                a if isinstance(a, Amendment) else Amendment.from_list(a) for a in self.amendments) or None)
        _validate(self)

    @property
    def space(self) -> int:
        """How many dataset indices there are: ``n``, or a mixture's sources' sizes added up (once grown)."""
        return self.n if self.sources is None else sum(sizes_after(self.sources, self.amendments or ()))

    @classmethod
    def with_lengths(cls, lengths: Any, **kwargs: Any) -> Spec:
        """Builds a ``bucket`` spec from per-sample sort keys (any int sequence or array)."""
        arr = np.asarray(lengths)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"lengths must be a 1-D sequence of ints (got dtype={arr.dtype}, ndim={arr.ndim})")
        if kwargs.get("max_tokens") is None:
            kwargs.setdefault("permutation", "bucket")
        kwargs.setdefault("n", int(arr.size))
        return cls(lengths=arr.astype("<i8").tobytes(), **kwargs)

    @classmethod
    def with_shards(cls, sizes: Any, **kwargs: Any) -> Spec:
        """Builds a ``shards`` spec from each shard's sample count (any int sequence or array)."""
        arr = np.asarray(sizes)
        if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"shard sizes must be a 1-D sequence of ints (got dtype={arr.dtype}, ndim={arr.ndim})")
        kwargs.setdefault("permutation", "shards")
        kwargs.setdefault("n", int(arr.sum()))
        return cls(shards=arr.astype("<i8").tobytes(), **kwargs)

    @property
    def sort_keys(self) -> np.ndarray:
        """The per-sample sort keys as an int64 array (empty when none were given)."""
        if self.lengths is None:
            return np.zeros(0, dtype=np.int64)
        return np.frombuffer(self.lengths, dtype="<i8")

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of the spec (``lengths`` stays bytes), for msgpack and for errors; amendments, when
        there are any, as ``[kind, values, at]`` lists."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.amendments is None:
            del d["amendments"]
        else:
            d["amendments"] = [a.to_list() for a in self.amendments]
        return d

    def amended(self, amendments: Sequence[Amendment]) -> Spec:
        """This spec dealing under `amendments` (each with its position): the orders then follow the
        job's history; the fingerprint stays this spec's."""
        return dataclasses.replace(self, amendments=tuple(amendments) or None)

    def as_grown(self, amendments: Sequence[Amendment]) -> tuple[Spec, ...]:
        """The specs a rank of this job may send once `amendments` were recorded: this one, and this one
        with each grown source's new size (with ``n`` grown alike where it was the sources' total, as a
        sampler of a ``ConcatDataset`` of the grown sources makes it)."""
        if self.sources is None or not any(a.kind == "grow" for a in amendments):
            return (self,)
        sizes = sizes_after(self.sources, amendments)
        grown = [self, dataclasses.replace(self, sources=sizes)]
        if self.n == sum(self.sources):
            grown.append(dataclasses.replace(self, sources=sizes, n=sum(sizes)))
        return tuple(grown)

    @property
    def base(self) -> Spec:
        """This spec without its amendments: what the job was registered with."""
        return dataclasses.replace(self, amendments=None) if self.amendments else self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Spec:
        """Inverse of :meth:`to_dict`; unknown keys are refused."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown spec fields {unknown} (known: {sorted(names)})")
        return cls(**dict(data))

    def describe(self) -> str:
        """A short, readable rendering for error messages (lengths shown by count and digest)."""
        d = self.to_dict()
        if self.lengths is not None:
            d["lengths"] = f"<{self.n} keys, sha256 {hashlib.sha256(self.lengths).hexdigest()[:12]}>"
        if self.shards is not None:
            d["shards"] = f"<{len(self.shards) // 8} shards, sha256 {hashlib.sha256(self.shards).hexdigest()[:12]}>"
        return ", ".join(f"{k}={v!r}" for k, v in d.items())

    @property
    def fingerprint(self) -> str:
        """A stable digest of the spec and :data:`ORDER_VERSION`: same settings and orders, same fingerprint, anywhere."""
        d: dict[str, Any] = self.base.to_dict()
        d["lengths"] = None if self.lengths is None else hashlib.sha256(self.lengths).hexdigest()
        d["shards"] = None if self.shards is None else hashlib.sha256(self.shards).hexdigest()
        for name, default in _LATER_FIELDS.items():
            if d[name] == default:
                del d[name]
        d["order_version"] = ORDER_VERSION
        blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:32]


def _validate(s: Spec) -> None:
    check_int("n", s.n, 1, MAX_N + 1)
    check_int("seed", s.seed, 0, 2**63)
    check_choice("permutation", s.permutation, PERMUTATIONS)
    check_choice("partition", s.partition, PARTITIONS)
    check_choice("tail", s.tail, TAILS)
    check_choice("scope", s.scope, SCOPES)
    check_int("batch_size", s.batch_size, 1, 2**31)
    check_bool("drop_last_batch", s.drop_last_batch)
    check_bool("even_batches", s.even_batches)
    if s.buffer_size is not None:
        check_int("buffer_size", s.buffer_size, 1)
    if s.pack_size is not None:
        check_int("pack_size", s.pack_size, 1)
    if s.permutation == "bucket":
        if s.lengths is None or s.pack_size is None or s.buffer_size is None:
            raise ValueError(
                "permutation='bucket' needs lengths, buffer_size and pack_size "
                f"(got lengths={'set' if s.lengths is not None else None}, "
                f"buffer_size={s.buffer_size}, pack_size={s.pack_size})"
            )
    _validate_mixture(s)
    _validate_shards(s)
    if s.lengths is not None:
        if not isinstance(s.lengths, bytes) or len(s.lengths) != 8 * s.space:
            raise ValueError(
                f"lengths must be {s.space} little-endian int64 values, i.e. {8 * s.space} bytes "
                f"(got {len(s.lengths) if isinstance(s.lengths, bytes) else type(s.lengths).__name__})"
            )
        if s.permutation != "bucket" and s.max_tokens is None:
            raise ValueError(f"lengths are only used by permutation='bucket' or max_tokens= (got "
                             f"permutation={s.permutation!r}, max_tokens=None)")
    check_choice("cost", s.cost, COSTS)
    check_choice("dealing", s.dealing, DEALINGS)
    check_int("token_window", s.token_window, 1, 2**31)
    if s.max_tokens is not None:
        _validate_tokens(s)
    elif s.cost != "sum" or s.token_window != TOKEN_WINDOW:
        raise ValueError(f"cost and token_window are settings of token-budget batches: they need max_tokens= "
                         f"(got cost={s.cost!r}, token_window={s.token_window}, max_tokens=None)")
    if s.dealing == "dynamic":
        if s.scope != "global" or s.partition != "strided" or s.tail != "uneven" or s.even_batches:
            raise ValueError(
                "dealing='dynamic' hands batches to whichever rank asks, so it has no stripes, padding or even "
                "shares: it needs scope='global', partition='strided', tail='uneven', even_batches=False (got "
                f"scope={s.scope!r}, partition={s.partition!r}, tail={s.tail!r}, even_batches={s.even_batches})"
            )
        if s.max_tokens is not None:
            raise ValueError("dealing='dynamic' with token-budget batches (max_tokens=) is not offered; use one of them")
    if s.scope == "rank":
        if s.partition == "strided":
            raise ValueError("scope='rank' (split first, then shuffle each part) needs partition "
                             "'chunked' or 'contiguous' (got partition='strided')")
        if s.permutation not in RANK_SCOPE_PERMUTATIONS:
            raise ValueError(f"scope='rank' supports permutation {', '.join(map(repr, RANK_SCOPE_PERMUTATIONS))} "
                             f"(got permutation={s.permutation!r})")


def _validate_shards(s: Spec) -> None:
    check_int("shard_window", s.shard_window, 1, 2**31)
    check_int("lanes", s.lanes, 1, 2**16)
    check_int("reader_group", s.reader_group, 1, 2**31)
    if s.shards is None:
        if s.permutation == "shards":
            raise ValueError("permutation='shards' needs shards= (each shard's sample count; see Spec.with_shards)")
        if (s.shard_window, s.lanes, s.reader_group) != (32, 16, 1):
            raise ValueError(f"shard_window, lanes and reader_group are settings of a shard order: they need shards= "
                             f"(got shard_window={s.shard_window}, lanes={s.lanes}, reader_group={s.reader_group})")
        return
    if not isinstance(s.shards, bytes) or not s.shards or len(s.shards) % 8 or len(s.shards) // 8 > MAX_SHARDS:
        got = len(s.shards) if isinstance(s.shards, bytes) else type(s.shards).__name__
        raise ValueError(f"shards must be 1 to {MAX_SHARDS} little-endian int64 sample counts (got {got} bytes)")
    sizes = np.frombuffer(s.shards, dtype="<i8")
    bad = np.flatnonzero(sizes < 1)
    if bad.size:
        raise ValueError(f"shard {int(bad[0])} holds {int(sizes[bad[0]])} samples: every shard must hold at least one "
                         f"({bad.size} do not)")
    total = int(sizes.sum())
    if s.sources is None and total != s.n:
        raise ValueError(f"the shards hold {total} samples, but n={s.n}: n must be their total")
    if s.sources is not None:
        # a mixture of sharded sources: the shards of each source, one after another (ConcatDataset's numbering)
        if total != sum(s.sources):
            raise ValueError(f"the shards hold {total} samples, but the sources {sum(s.sources)}: they must be equal")
        edges = set(np.cumsum(sizes).tolist())
        cut = [int(e) for e in np.cumsum(s.sources)[:-1].tolist() if int(e) not in edges]
        if cut:
            raise ValueError(f"a source ends inside a shard (at index {cut[0]}): each source must be whole shards")
        if s.amendments and any(a.kind == "grow" for a in s.amendments):
            raise ValueError("a grown source would need the sizes of its new shards: a mixture of sharded sources "
                             "does not grow")
    if s.permutation != "shards":
        raise ValueError(f"shards= is read by permutation='shards' (got permutation={s.permutation!r})")
    if (s.lengths is not None and s.max_tokens is None) or s.scope != "global" or s.partition != "strided":
        raise ValueError(
            "a shard order shuffles the whole epoch over its reader groups: it takes lengths only as token counts "
            "(with max_tokens=), and needs scope='global', partition='strided' (its reader groups are its partition) "
            f"(got max_tokens={s.max_tokens}, lengths={'set' if s.lengths is not None else None}, "
            f"scope={s.scope!r}, partition={s.partition!r})")


def _validate_mixture(s: Spec) -> None:
    if s.sources is None:
        if s.amendments:
            raise ValueError("amendments (new weights, a grown source, skipped samples) are changes of a mixture: "
                             "they need sources=")
        if s.weights is not None or s.max_epochs is not None:
            raise ValueError(f"weights and max_epochs are settings of a mixture: they need sources= (got "
                             f"weights={s.weights!r}, max_epochs={s.max_epochs!r}, sources=None)")
        return
    if not s.sources or len(s.sources) > MAX_SOURCES:
        raise ValueError(f"a mixture needs 1 to {MAX_SOURCES} sources (got {len(s.sources)})")
    for i, size in enumerate(s.sources):
        check_int(f"sources[{i}]", size, 1, MAX_N + 1)
    if s.space > MAX_N:
        raise ValueError(f"the sources add up to {s.space} samples, more than {MAX_N}")
    if s.weights is None:
        raise ValueError(f"a mixture of {len(s.sources)} sources needs weights=")
    for c in s.weights:
        if not (isinstance(c, tuple) and len(c) == 2 and isinstance(c[1], tuple)):
            raise ValueError(f"weights must be (stream position, parts) pairs (got {c!r})")
        check_int("a weight change's position", c[0], 0, mixture.MAX_POSITION)
        for j, p in enumerate(c[1]):
            check_int(f"parts[{j}] from position {c[0]}", p, 0, mixture.PARTS + 1)
        if sum(c[1]) != mixture.PARTS:
            raise ValueError(f"the parts from position {c[0]} add up to {sum(c[1])}, not {mixture.PARTS} "
                             "(croupier.core.mixture.parts_of rounds weights to parts)")
    if s.permutation not in ("feistel", "none", "shards") or s.scope != "global":
        raise ValueError("a mixture shuffles each source epoch (permutation='feistel'), keeps it in order ('none') or "
                         "reads each source's shards in a shard order ('shards'), over the whole stream "
                         f"(scope='global') (got permutation={s.permutation!r}, scope={s.scope!r})")
    if s.amendments and s.lengths is not None and any(a.kind == "grow" for a in s.amendments):
        raise ValueError("a grown source would need the lengths of its new samples: token budgets and buckets "
                         "(lengths=) do not grow")
    stream(s.sources, s.weights, s.max_epochs or (), s.seed, s.permutation == "feistel", s.amendments or ())


def _validate_tokens(s: Spec) -> None:
    assert s.max_tokens is not None
    check_int("max_tokens", s.max_tokens, 1, 2**62)
    if s.lengths is None:
        raise ValueError(f"max_tokens={s.max_tokens} needs lengths= (each sample's token count)")
    if s.batch_size != 1 or s.drop_last_batch or s.even_batches:
        raise ValueError(
            "token-budget batches (max_tokens=) size themselves: leave batch_size, drop_last and even_batches unset "
            f"(got batch_size={s.batch_size}, drop_last_batch={s.drop_last_batch}, even_batches={s.even_batches})"
        )
    if s.scope != "global" or s.partition != "strided" or s.tail not in ("pad", "drop", "uneven"):
        raise ValueError(
            "token-budget batches deal whole batches round-robin: they need scope='global', partition='strided' and "
            f"tail 'pad', 'drop' or 'uneven' (got scope={s.scope!r}, partition={s.partition!r}, tail={s.tail!r})"
        )
    keys = s.sort_keys
    bad = np.flatnonzero((keys < 1) | (keys > s.max_tokens))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"lengths[{i}]={int(keys[i])} cannot go into a batch of max_tokens={s.max_tokens}: every length must be "
            f"in [1, max_tokens] ({bad.size} are not)"
        )
