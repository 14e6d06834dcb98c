"""`PackedLoader`: documents tokenized by a DataLoader's workers packed into rows, with an exact checkpoint state."""

from __future__ import annotations

import array
import logging
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from croupier.client._filter import FILTERED, Filtered, is_filtered
from croupier.client._pack_state import Key, Merged, Part, from_state, merge, share, to_state
from croupier.client._packing import LONG, Packed, Piece, Planner, Row, assemble, make_planner, pieces_of
from croupier.client._sampler import DistributedSampler
from croupier.core.checks import check_choice, check_int

log = logging.getLogger("croupier")
Gather = Callable[[dict[str, Any]], list[dict[str, Any]]]


class Indexed(torch.utils.data.Dataset[tuple[int, Any]]):
    """A map-style dataset whose items carry their index: ``Indexed(ds)[i] == (i, ds[i])``.

    :class:`PackedLoader` needs to know which index each loaded document came from; wrap the
    dataset the loader's workers read with this (or return ``(index, tokens)`` yourself). A sample
    the dataset rejects by raising :class:`croupier.client.Filtered` is ``(index, FILTERED)``.

    Args:
        dataset: Any map-style dataset whose items are 1-D token sequences.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getitem__(self, index: int) -> tuple[int, Any]:
        try:
            return int(index), self.dataset[index]
        except Filtered:
            return int(index), FILTERED

    def __len__(self) -> int:
        return len(self.dataset)


def _tokens(doc: Any, what: str) -> torch.Tensor:
    if isinstance(doc, torch.Tensor) and doc.dtype == torch.int64 and doc.dim() == 1:
        return doc  # what a tokenizer's tensor is: taken as it is
    t = torch.as_tensor(doc)
    if t.dim() != 1 or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{what} must be a 1-D sequence of integer tokens (got shape {tuple(t.shape)}, {t.dtype})")
    return t.to(torch.int64)


def _sample(item: Any) -> tuple[int, torch.Tensor | None] | None:
    """The ``(index, tokens)`` of `item` if it is one sample, tokens None if it is filtered (else None: a list of them)."""
    if not (isinstance(item, (tuple, list)) and len(item) == 2) or isinstance(item[0], (tuple, list)):
        return None
    index = item[0]
    if isinstance(index, torch.Tensor) and index.numel() == 1:
        index = index.item()
    try:
        index = check_int("a sample's index", index, None)
    except TypeError:
        raise TypeError(f"the loader must yield (index, tokens) samples (Indexed(dataset)); got an item whose "
                        f"first element is {index!r}") from None
    if is_filtered(item[1]):
        return index, None
    return index, _tokens(item[1], f"the tokens of sample {index}")


def _samples(item: Any) -> list[tuple[int, torch.Tensor | None]]:
    """The ``(index, tokens)`` samples of one item the loader yields: a sample, or a list of them."""
    one = _sample(item)
    if one is not None:
        return [one]
    if isinstance(item, (tuple, list)):
        out: list[tuple[int, torch.Tensor | None]] = []
        for x in item:
            s = _sample(x)
            out += [s] if s is not None else _samples(x)
        return out
    raise TypeError(f"the loader must yield (index, tokens) samples, or lists of them (collate_fn=list); got "
                    f"{type(item).__name__}")


def _gather_for(sampler: DistributedSampler) -> Gather:
    """Every rank's object, by rank: none needed in a world of one, else torch.distributed's all_gather_object."""

    def gather(obj: dict[str, Any]) -> list[dict[str, Any]]:
        world = sampler.num_replicas
        if world == 1:
            return [obj]
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"a packed loader's state holds every rank's waiting pieces, so state_dict() gathers "
                               f"them from the {world} ranks: call it on every rank after init_process_group, "
                               "or pass gather= to PackedLoader")
        out: list[Any] = [None] * world
        dist.all_gather_object(out, obj, group=sampler._world.group)
        return out

    return gather


class _Epoch:
    """One epoch's packing on this rank: the planner, what waits, and the counts the checkpoint needs."""

    def __init__(self, epoch: int, before: int, planner: Planner, reload: list[Key], skip: Counter[int]) -> None:
        self.epoch = epoch
        self.pulled = before  # the sampler's items of the epoch taken by the packer (from the epoch's start)
        self.planner = planner
        self.reload: deque[Key] = deque(reload)  # the loaded state's waiting pieces, this rank's share
        self.pending: deque[Piece] = deque()  # the rest of a document being added
        self.early: list[Piece] = []  # the first sample's pieces, taken before the waiting pieces are packed
        self.ready: deque[Row] = deque()  # closed rows not yet in a yielded batch
        self.loaded_skip = list(skip.elements())
        self.skip = skip  # what this rank still drops
        self.hits: Counter[int] = Counter()
        self.log = array.array("q")  # indices pulled at items [pulled - len(log), pulled)
        self.filtered: list[int] = []  # indices filtered since the last checkpoint (on_filtered="skip")
        self.done = False

    def waiting(self) -> list[Key]:
        held = [p.key for row in self.ready for p in row] + [p.key for p in self.planner.waiting()]
        return held + [p.key for p in self.pending] + list(self.reload) + [p.key for p in self.early]

    def part(self, rank: int) -> Part:
        return Part(rank, self.epoch, self.pulled, self.done, tuple(self.log), tuple(self.hits.elements()),
                    tuple(self.waiting()))


class PackedLoader:
    """Packs the documents a DataLoader loads into rows of `seq_len` tokens, and checkpoints exactly.

    The loader's workers load and tokenize (the dataset returns ``(index, tokens)``: wrap it in
    :class:`Indexed`); the packing runs here, in the training process, which counts the samples it
    took itself. Its ``state_dict()`` is the sampler's state at the samples every rank took, plus
    every piece loaded but not yet in a yielded batch: after ``load_state_dict`` those come first
    (reloaded from the dataset by index), then the sampler's rest, so each token of each document
    is trained once, on any world size and any ``num_workers``, with the plain ``DataLoader`` or
    ``StatefulDataLoader`` (whose own state is then not needed).

    Args:
        loader: A ``DataLoader`` over the `sampler` yielding ``(index, tokens)`` samples
            (``batch_size=None``), or lists of them (``collate_fn=list``).
        sampler: The loader's croupier ``DistributedSampler``.
        seq_len: Tokens per row.
        pack: ``"greedy"`` (next-fit, in the order of the data) or ``"best_fit"`` (within a
            buffer of `buffer` pieces; less padding, a checkpoint holds up to `buffer` pieces).
        buffer: Pieces ``"best_fit"`` holds before it makes a row.
        long: A document longer than a row: ``"split"`` into pieces of `seq_len` tokens, or
            ``"truncate"`` to its first `seq_len`.
        rows: Rows per yielded batch (the last batch of an epoch may hold fewer).
        pad_id: The token that fills a row's end.
        dataset: What a waiting piece is reloaded from by index after a resume (``dataset[index]``,
            returning ``(index, tokens)`` or the tokens); default ``loader.dataset``.
        gather: ``gather(obj)`` returns every rank's `obj` as a list by rank; default none in a
            world of one, else ``torch.distributed.all_gather_object`` on the sampler's group.
        keep: ``keep(index, tokens)`` is False for a sample to filter out (run here, in the training
            process); the dataset may also return ``FILTERED`` or raise ``Filtered``. A filtered
            sample is counted as taken (not dealt again after a resume, not missing), trains nothing
            and goes to the sampler's audit log (``croupier audit``'s ``filtered`` column).
        on_filtered: ``"record"`` (the default), or ``"skip"``: each ``state_dict()`` also records
            the samples filtered since the last one as skipped (``sampler.skip``: a mixture's job
            only), so that no rank of the job's next generation deals them again.

    Yields:
        :class:`croupier.client.Packed` batches: tokens, ``position_ids``, ``cu_seqlens`` and
        each row's pieces.

    NOTE: the ranks pull different numbers of documents (their lengths differ), so ``state_dict()``
    is a collective: every rank calls it at the same step, and each gets the same state, holding
    every rank's waiting pieces; a new rank takes every ``world``-th of them from its rank on.
    """

    def __init__(self, loader: Iterable[Any], sampler: DistributedSampler, seq_len: int, *, pack: str = "greedy",
                 buffer: int = 64, long: str = "split", rows: int = 1, pad_id: int = 0, dataset: Any = None,
                 gather: Gather | None = None, keep: Callable[[int, torch.Tensor], bool] | None = None,
                 on_filtered: str = "record") -> None:
        if not isinstance(sampler, DistributedSampler):
            raise TypeError(f"sampler must be a croupier.client.DistributedSampler (got {type(sampler).__name__}); "
                            "a batch sampler's batches are packed from its samples: use the index sampler")
        given = getattr(loader, "sampler", sampler)
        if given is not sampler:
            raise ValueError(f"the loader's sampler ({type(given).__name__}) is not the sampler given: the loader must "
                             "draw from it (DataLoader(..., sampler=sampler))")
        check_choice("long", long, LONG)
        make_planner(pack, seq_len, buffer)  # checks the three
        check_choice("on_filtered", on_filtered, ("record", "skip"))
        if on_filtered == "skip" and sampler.spec.sources is None:
            raise ValueError("on_filtered='skip' records filtered samples as skipped, a change of a mixture: the "
                             "sampler deals one dataset (make it with weights=), or use on_filtered='record'")
        if keep is not None and not callable(keep):
            raise TypeError(f"keep must be a callable keep(index, tokens) -> bool (got {keep!r})")
        self.keep, self.on_filtered = keep, on_filtered
        self._skipped: set[int] = set()  # indices recorded as skipped by this loader (on_filtered="skip")
        self.rows = check_int("rows", rows, 1)
        self.pad_id = check_int("pad_id", pad_id, None)
        self.loader, self.sampler, self.seq_len, self.pack, self.buffer, self.long = loader, sampler, seq_len, pack, buffer, long
        self.dataset = dataset if dataset is not None else getattr(loader, "dataset", None)
        self._gather = gather or _gather_for(sampler)
        self._run: _Epoch | None = None
        self._batches_of: Iterator[Packed] | None = None  # the iteration of `_run`
        # a state loaded, until the first iteration: (its epoch, every waiting piece, its skip entries)
        self._loaded: tuple[int | None, list[Key], list[int]] | None = None

    # ---------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[Packed]:
        """The batches of the epoch: a new epoch, or the rest of the one in hand if it has not ended.

        NOTE: a loop that stops before the epoch's end and iterates again goes on with the same
        iteration: the loader's workers hold samples the sampler handed out, which a new iterator of
        the loader would not see again (and the checkpoint could not count).
        """
        if self._run is not None and not self._run.done and self._batches_of is not None:
            return self._batches_of
        s = self.sampler
        epoch, before = s.epoch, s.items_resumed
        reload: list[Key] = []
        skip: Counter[int] = Counter()
        if self._loaded is not None:
            at, waiting, loaded_skip = self._loaded
            self._loaded = None
            reload = share(waiting, s.num_replicas, s.rank)
            # NOTE: a state whose sampler had dealt its whole epoch, with pieces still waiting, resumes at
            # the next epoch's start: its pieces then lead that epoch's iteration (after set_epoch(at),
            # which torch's loop calls, the iteration of epoch `at` holds them alone).
            if at is not None and at == epoch:
                skip = Counter(loaded_skip)
            elif at is not None and at + 1 == epoch:
                pass
            elif reload:
                log.warning("croupier: the packed state loaded is of epoch %d, but this iteration is of epoch %d: "
                            "its %d waiting pieces are not trained", at, epoch, len(reload))
                reload = []
        run = _Epoch(epoch, before, make_planner(self.pack, self.seq_len, self.buffer), reload, skip)
        self._run = run
        self._batches_of = self._batches(run)
        return self._batches_of

    def _batches(self, run: _Epoch) -> Iterator[Packed]:
        # NOTE: the first sample is taken before the waiting pieces are packed: the sampler joins its
        # generation at its first item, and the join waits for every rank; a rank that trained its
        # waiting pieces first would keep the others there while it steps (a deadlock under DDP).
        items = iter(self.loader)
        first = next(items, None)
        if first is not None:
            run.early.extend(self._pull(run, first))
        while run.reload:
            i, offset, length = run.reload[0]
            doc = self._reload(i)
            if offset + length > doc.shape[0]:
                raise ValueError(f"a waiting piece of document {i} ends at token {offset + length}, but the dataset's "
                                 f"document {i} has {doc.shape[0]} tokens: the dataset changed since the checkpoint")
            pieces = pieces_of(i, doc[offset:offset + length], self.seq_len, self.long)
            run.pending.extend(Piece(i, offset + p.offset, p.length, p.tokens) for p in pieces)
            run.reload.popleft()
            yield from self._drain(run)
        run.pending.extend(run.early)
        run.early.clear()
        yield from self._drain(run)
        for item in items:
            run.pending.extend(self._pull(run, item))
            yield from self._drain(run)
        run.ready.extend(run.planner.flush())
        while run.ready:
            yield self._take(run, min(self.rows, len(run.ready)))
        run.done = True

    def _pull(self, run: _Epoch, item: Any) -> list[Piece]:
        """The pieces of the samples of one item of the loader, counted as taken; none of a sample the
        state loaded names as taken past its cut (it is dropped). Until they are packed they wait in
        ``run.early`` (the first item) or ``run.pending``."""
        out: list[Piece] = []
        for index, doc in _samples(item):
            run.pulled += 1
            run.log.append(index)
            if doc is None or (self.keep is not None and not self.keep(index, doc)):
                self._filter(run, index)  # NOTE: before the skip entries: a filtered sample past the cut is
                doc = None  # filtered again when it is dealt again (the audit counts it once, where it counts)
            if run.skip[index] > 0:  # past the cut of the state loaded: trained, or among the waiting pieces
                run.skip[index] -= 1
                run.hits[index] += 1
                continue
            if doc is not None:
                out += pieces_of(index, doc, self.seq_len, self.long)
        return out

    def _filter(self, run: _Epoch, index: int) -> None:
        """Records the sample at this rank's item ``run.pulled - 1`` as filtered out."""
        if self.on_filtered == "skip":
            run.filtered.append(index)
        audit = self.sampler._audit
        if audit is not None:
            audit.filtered(run.epoch, run.pulled - 1, index)

    def _drain(self, run: _Epoch) -> Iterator[Packed]:
        """Adds the pending pieces one at a time, yielding a batch whenever `rows` rows are closed."""
        while run.pending:
            run.ready.extend(run.planner.add(run.pending.popleft()))
            while len(run.ready) >= self.rows:
                yield self._take(run, self.rows)

    def _take(self, run: _Epoch, k: int) -> Packed:
        rows = [run.ready.popleft() for _ in range(k)]
        return assemble(rows, self.seq_len, self.pad_id)

    def _reload(self, index: int) -> torch.Tensor:
        if self.dataset is None:
            raise RuntimeError("the state loaded has waiting pieces, reloaded by index from the dataset: pass dataset= "
                               "(the loader has none)")
        item = self.dataset[index]
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int):
            if item[0] != index:
                raise ValueError(f"dataset[{index}] returned the sample of index {item[0]}")
            item = item[1]
        return _tokens(item, f"the tokens of sample {index}")

    # ---------------------------------------------------------------- checkpoints

    def _part(self) -> Part:
        s = self.sampler
        if self._run is not None:
            return self._run.part(s.rank)
        if self._loaded is None:
            return Part(s.rank, s.epoch, s.items_resumed, False)
        at, waiting, _ = self._loaded
        return Part(s.rank, s.epoch if at is None else at, s.items_resumed, False, (), (),
                    tuple(share(waiting, s.num_replicas, s.rank)))

    def state_dict(self, *, step: int | None = None) -> dict[str, Any]:
        """The checkpoint state: the sampler's state at the samples every rank took, and the pieces
        loaded into any rank's buffer but not yet in a yielded batch.

        A collective (see the class's NOTE): call it on every rank at the same step, after the
        batches yielded so far were trained. Every rank gets the same state; save one.

        Args:
            step: The trainer's global step, for the sampler's state (``state_dict(step=)``).
        """
        mine = self._part()
        run = self._run
        counts = self._gather({"rank": mine.rank, "pulled": mine.pulled,
                               "filtered": list(run.filtered) if run is not None else []})
        cut = min(int(c["pulled"]) for c in counts)
        first = mine.pulled - len(mine.log)
        part = Part(mine.rank, mine.epoch, mine.pulled, mine.done, mine.log[max(0, cut - first):],
                    mine.hits, mine.waiting)
        parts = [Part.from_dict(d) for d in self._gather(part.to_dict())]
        m: Merged = merge(parts, run.loaded_skip if run is not None else (self._loaded[2] if self._loaded else []))
        if run is not None:  # the items before the cut are never asked again
            del run.log[:max(0, cut - (run.pulled - len(run.log)))]
        if m.done:
            sampler_state = self.sampler.state_dict(step=step)
        else:
            sampler_state = self.sampler.state_dict(consumed=m.cut, step=step)
        if self.on_filtered == "skip":  # NOTE: after the collectives: a skip refused on rank 0 holds no rank there
            self._skip_filtered([int(i) for c in counts for i in c["filtered"]])
        return to_state(sampler_state, m)

    def _skip_filtered(self, filtered: list[int]) -> None:
        """Records every rank's samples filtered since the last checkpoint as skipped (rank 0 records them)."""
        new = sorted(set(filtered) - self._skipped)
        if self._run is not None:
            self._run.filtered.clear()
        if not new:
            return
        if self.sampler.rank == 0:
            self.sampler.skip(new)
        self._skipped.update(new)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes from a state of :meth:`state_dict`, taken on any world size; ``{}`` means "from the start".

        This rank takes its share of the waiting pieces (every ``world``-th from its rank on): the
        next iteration packs them first, then the sampler's rest, dropping the samples the state
        names as already taken.

        Raises:
            TypeError, ValueError: the state is malformed (nothing is changed).
            RuntimeError: the loader has already begun iterating.
        """
        epoch, sampler_state, waiting, skip = from_state(state)
        if self._run is not None:
            raise RuntimeError("load_state_dict must come before the packed loader's first batch")
        self.sampler.load_state_dict(sampler_state)
        self._loaded = (epoch, waiting, skip)
