"""`Loader`: a DataLoader over a croupier sampler that counts the batches reaching the loop, for an exact `state_dict`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler

from croupier.client._sampler import DistributedBatchSampler, DistributedSampler

log = logging.getLogger("croupier")
Croupier = DistributedSampler | DistributedBatchSampler


def sampler_of(loader: Any, user: str = "Loader", otherwise: str | None = None, *,
               batched: bool = False) -> tuple[Croupier, int]:
    """The croupier sampler `loader` draws from, and how many of its items one loader batch holds.

    One item per batch for a ``DistributedBatchSampler`` (``batch_sampler=``, or ``sampler=`` with
    ``batch_size=None``) and for a ``DistributedSampler`` with ``batch_size=None``; the batch size for
    a ``DistributedSampler`` batched by the loader (``sampler=`` with ``batch_size=k``, or a torch
    ``BatchSampler`` over it as ``batch_sampler=``). Every wrapper that counts a loader's batches
    (``Loader``, the integrations) asks this, and counts with :func:`items_consumed`.

    Args:
        loader: A ``DataLoader`` (or any object with its ``sampler`` and ``batch_sampler``).
        user: What asked, for the error.
        otherwise: What to use for other loaders, for the error (None: nothing named).
        batched: Refuse a ``DistributedSampler`` the loader does not batch (``batch_size=None``): a
            wrapper that rebuilds the loader and drops such a sampler (Accelerate's) asks for this.

    Raises:
        TypeError: `loader` does not draw from a croupier sampler (the message names what it draws from),
            or `batched` and its index sampler is not batched.
    """
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(loader, "sampler", None)
    if isinstance(batch_sampler, DistributedBatchSampler):
        return batch_sampler, 1
    if isinstance(batch_sampler, BatchSampler) and isinstance(batch_sampler.sampler, DistributedSampler):
        return batch_sampler.sampler, int(batch_sampler.batch_size)
    if batch_sampler is None and isinstance(sampler, (DistributedSampler, DistributedBatchSampler)):
        if batched and isinstance(sampler, DistributedSampler):
            raise TypeError(f"{user}: a DataLoader over croupier's DistributedSampler needs a batch_size (or use "
                            "DistributedBatchSampler as its batch_sampler)")
        return sampler, 1
    rest = "" if otherwise is None else f"; use {otherwise} for the others"
    raise TypeError(
        f"{user} is for a DataLoader over a croupier sampler (sampler=DistributedSampler, or "
        f"batch_sampler=DistributedBatchSampler){rest}: this {type(loader).__name__}'s sampler is a "
        f"{type(sampler).__name__} and its batch sampler a {type(batch_sampler).__name__}"
    )


def items_consumed(sampler: Croupier, batches: int, per_batch: int, before: int = 0) -> int:
    """The sampler's items (indices, or batches for the batch sampler) of its epoch in hand that the loop
    consumed, from the epoch's start: what ``state_dict(consumed=)`` takes.

    `before` items of the epoch were consumed before the count began (a resumed checkpoint's), then
    `batches` loader batches of `per_batch` items each (:func:`sampler_of`'s) reached the loop. The
    epoch's last batch may hold fewer: the loop can take it only once the sampler handed out its last
    item, so what the sampler handed out (``items_done``) bounds the count. Ask it while the sampler is
    in the epoch the batches are of (handing it out, or the last it handed out).
    """
    return min(before + batches * per_batch, sampler.items_done)


@dataclasses.dataclass
class _Run:
    """One pass of the DataLoader over one epoch of the sampler, and the batches of it the loop took.

    Attributes:
        batches: Loader batches yielded to the loop in this pass.
        epoch: The sampler's epoch the pass goes through (known at its first batch; None before).
        done: The DataLoader's iterator ran out: every batch of the pass reached the loop.
        iterator: The pass as the loop iterates it.
    """

    batches: int = 0
    epoch: int | None = None
    done: bool = False
    iterator: Iterator[Any] | None = None


class Loader:
    """A ``DataLoader`` over a croupier sampler, whose ``state_dict()`` is exact with any ``num_workers``.

    A DataLoader's workers and its prefetch read the sampler ahead of the training loop, so what
    the sampler handed out is more than what the loop trained. ``Loader`` iterates the DataLoader
    for the loop and counts the batches it yields; its ``state_dict()`` is the sampler's state at
    that count (``sampler.state_dict(consumed=...)``, computed for you). The state is the
    sampler's own: topology-free and free of the worker count, so a checkpoint taken with 4
    workers on 2 ranks resumes with 0, 2 or 8 workers on any world size.

    Args:
        loader: A ``torch.utils.data.DataLoader`` (or torchdata's ``StatefulDataLoader``, whose
            own state is then not needed) over a croupier ``DistributedSampler`` (``sampler=``,
            batched by the loader or not) or ``DistributedBatchSampler`` (``batch_sampler=``).

    Raises:
        TypeError: `loader` does not draw from a croupier sampler.

    Example::

        sampler = DistributedSampler(dataset, seed=0)
        loader = Loader(DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=4))
        if checkpoint:
            loader.load_state_dict(checkpoint["data"])     # saved with any world size and num_workers
        for epoch in range(start_epoch, epochs):
            sampler.set_epoch(epoch)
            for batch in loader:
                ...
                checkpoint = {"model": ..., "data": loader.state_dict(step=step)}

    NOTE: a wrapper, not something the sampler works out by itself. Only the training process
    sees which batches reached the loop; the sampler sees the DataLoader's main process draw
    indices for its workers, ``prefetch_factor * num_workers`` batches ahead, and cannot tell them
    from trained ones. torchdata's ``StatefulDataLoader`` counts the batches it yielded for the
    same reason, but its state is tied to its worker count; this count is the sampler's items,
    whose state any world and any worker count resumes. Each rank counts its own batches: no
    collective is needed (unlike :class:`PackedLoader`, whose ranks pull different numbers of
    documents).

    NOTE: a loop that stops before the epoch's end and iterates again goes on with the same pass
    of the DataLoader: a new pass would start from what the sampler last handed out, and the
    batches the workers had read ahead would never be trained. A batch taken from the iterator
    counts as trained. ``set_epoch(e + 1)`` before the pass of ``e`` ended cuts epoch ``e`` (as the
    sampler's own ``set_epoch`` does): the next iteration is a new pass of ``e + 1``.
    """

    def __init__(self, loader: Any) -> None:
        self.sampler, self.items_per_batch = sampler_of(loader)
        self.loader = loader
        self._run: _Run | None = None

    # ---------------------------------------------------------------- iteration

    @property
    def dataset(self) -> Any:
        """The DataLoader's dataset."""
        return self.loader.dataset

    @property
    def batch_size(self) -> int | None:
        """The DataLoader's batch size (None when its batch sampler makes the batches)."""
        return self.loader.batch_size  # type: ignore[no-any-return]

    def __len__(self) -> int:
        """The DataLoader's ``len()``: its batches in the whole current epoch (those before a resume included)."""
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        """The batches of the epoch: a new pass, or the rest of the pass in hand if it has not ended."""
        run = self._run
        if run is not None and not run.done and run.iterator is not None:
            if run.epoch is None or run.epoch == self._epoch():
                return run.iterator
            # set_epoch moved the sampler on mid-pass: the rest of this pass is not trained
            log.warning("croupier: epoch %d was cut after %d batches of the loop: a new pass of the DataLoader "
                        "begins with epoch %d", run.epoch, run.batches, self._epoch())
            self.close()
        run = _Run()
        run.iterator = self._batches(run)
        self._run = run
        return run.iterator

    def _batches(self, run: _Run) -> Iterator[Any]:
        for batch in self.loader:
            if run.epoch is None:  # the sampler has joined its generation: its epoch is known
                run.epoch = self._epoch()
            run.batches += 1
            yield batch
        run.done = True

    def _epoch(self) -> int:
        """The epoch the sampler is handing out (or last handed out), as its progress holds it."""
        s = self.sampler
        return s._progress.epoch if s._start is not None else s.epoch

    def close(self) -> None:
        """Ends the pass in hand (its DataLoader iterator, and with it the workers of a non-persistent loader).

        The sampler is not closed: it is the caller's.
        """
        run = self._run
        if run is not None and run.iterator is not None and not run.done:
            run.iterator.close()  # type: ignore[attr-defined]  # a generator
            run.done = True

    # ---------------------------------------------------------------- counts

    @property
    def items_trained(self) -> int:
        """Sampler items (indices, or batches for the batch sampler) of the current epoch that reached the
        loop, counted from the epoch's start as the sampler's ``len()`` counts them: what ``state_dict``
        passes as ``consumed=``. After a pass ran to its end it is the sampler's ``items_done``."""
        s, run = self.sampler, self._run
        if run is None or run.done or (run.epoch is not None and run.epoch != self._epoch()):
            return s.items_done
        return items_consumed(s, run.batches, self.items_per_batch, s.items_resumed)

    # ---------------------------------------------------------------- checkpoints

    def state_dict(self, *, step: int | None = None) -> dict[str, Any]:
        """The sampler's checkpoint state at the batches that reached the loop.

        Call it after the batches taken so far were trained. Each rank's state is its own sampler's
        (in lockstep every rank's is the same); save one with the model.

        Args:
            step: The trainer's global step, for the sampler's state (the sampler's ``state_dict(step=)``).
        """
        run = self._run
        if run is None or run.done or (run.epoch is not None and run.epoch != self._epoch()):
            return self.sampler.state_dict(step=step)  # nothing read ahead of the loop in this epoch
        return self.sampler.state_dict(consumed=self.items_trained, step=step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes from a state of :meth:`state_dict` (or of the sampler's own ``state_dict``), taken on any
        world size with any ``num_workers``; ``{}`` means "from the start".

        Raises:
            RuntimeError: the loader has begun a pass (load before the first iteration).
            ValueError: the sampler's own errors (a malformed state, another job or spec).
        """
        run = self._run
        if run is not None and not run.done:
            raise RuntimeError("load_state_dict must come before the loader's first batch: a pass of the DataLoader "
                               "has begun")
        self.sampler.load_state_dict(state)
