"""croupier under HF Accelerate: a prepared loader that keeps croupier's sharding, and its state in ``save_state``.

Use :func:`prepare_data_loader` for the loader whose sampler (or batch sampler) is croupier's, and
``accelerator.prepare`` for the rest::

    from croupier.integrations.accelerate import prepare_data_loader

    loader = DataLoader(dataset, batch_sampler=DistributedBatchSampler(dataset, batch_size=8, seed=0))
    loader = prepare_data_loader(accelerator, loader)         # not re-sharded; registered for checkpointing
    model, optim = accelerator.prepare(model, optim)
    if resume_dir:
        accelerator.load_state(resume_dir)                     # before the first batch; saved with any world size
    for epoch in range(loader.croupier_sampler.epoch, epochs):
        for batch in loader:                                   # no skip_first_batches: the sampler resumes by itself
            ...
            accelerator.save_state(step_dir)                   # anywhere, mid-epoch included

What Accelerate does with a loader, read in accelerate 1.15 (``accelerator.py``, ``data_loader.py``,
``checkpointing.py``), and the decisions that follow:

* ``Accelerator.prepare`` -> ``prepare_data_loader`` wraps the batch sampler in ``BatchSamplerShard``
  whenever ``num_processes > 1`` (and ``dispatch_batches`` is off): every rank keeps one batch in
  ``num_processes`` of what it iterates. croupier's sampler already deals this rank its own share,
  so each rank would train half of it (2 ranks: 32 of 64 samples an epoch). No
  ``DataLoaderConfiguration`` option turns the sharding off (``split_batches`` splits each batch,
  ``dispatch_batches`` has rank 0 read and scatter, ``even_batches`` pads), and neutralising the
  wrapper afterwards (``num_processes = 1`` on it, as the HF Trainer does for its own
  rank-aware sampler) still pads a rank's short last batch with samples from the epoch's start.
  :func:`prepare_data_loader` therefore calls accelerate's public
  ``accelerate.data_loader.prepare_data_loader`` with ``num_processes=1, process_index=0``: the
  branch that leaves the batch sampler as it is, while device placement, non-blocking copies
  and RNG synchronisation stay the accelerator's.
* ``DataLoaderShard`` (what ``prepare`` returns) reads the loader one batch ahead of the loop (to
  know which batch is the last), and a loader with ``num_workers > 0`` reads further: the sampler
  has handed out more than the loop trained on. The returned :class:`CroupierDataLoader` is a
  ``DataLoaderShard`` that counts the batches the loop actually took in the current epoch (from the
  epoch's start, a resumed checkpoint's included), and its state passes that count to
  ``state_dict(consumed=...)``.
* ``save_state`` saves a loader's sampler only for accelerate's own ``SeedableRandomSampler`` or a
  ``StatefulDataLoader``; other objects only when registered with ``register_for_checkpointing``
  (``custom_checkpoint_<i>.pkl``: ``state_dict()`` is called on every rank, rank 0 writes it, and
  ``load_state`` loads it on every rank, by registration order). :func:`prepare_data_loader`
  registers the loader's :class:`CroupierLoaderState` (``register=False`` to hold it yourself).
  Register the same objects in the same order when resuming; ``load_state`` must come before the
  first batch. The accelerator's ``use_stateful_dataloader`` is not used for this loader: the
  state it keeps is snapshotted at every batch, which would call (and log) a sampler checkpoint
  per batch.
* ``skip_first_batches`` (Accelerate's recipe for resuming mid-epoch) must NOT be called on this
  loader: the sampler resumed by ``load_state`` yields only what is left of the epoch, and skipping
  would skip that many untrained batches a second time. Iterate the loader as it is.
* ``DataLoaderShard`` calls ``set_epoch(self.iteration)`` at the start of every pass, with its own
  pass counter. :class:`CroupierDataLoader` sets that counter to the sampler's epoch first, so a
  resumed sampler is never sent back to epoch 0; ``loader.set_epoch(e)`` works as before.
* Not supported, with a clear error: ``dispatch_batches=True`` and ``split_batches=True`` (croupier
  deals each rank its own batches, of the loader's batch size), iterable datasets, and XLA's
  wrapper. With a device mesh (tensor parallelism), build the sampler with
  ``device_mesh=..., mesh_dim="dp"``: this loader is not re-sharded along the mesh either.

The step: ``save_state`` calls the registered state's ``state_dict()`` with no argument, so the
loader counts the optimizer steps itself: ``accelerator.gradient_accumulation_steps`` batches a
step, and a short last step at an epoch's end (``accumulate`` syncs at the loader's end), from the
job's start (a resumed state names the step it was saved at). The sampler's state carries it, and
the coordinator's step ledger places each step on its samples: give the sampler
``global_batch=`` (batch size x world x accumulation steps) to count steps alike. A checkpoint in
the middle of an accumulation names the last step taken.

Re-entering a loop over the loader in the middle of an epoch (``break`` and iterate again) loses
the batches Accelerate read ahead: they were handed out and never trained. Save a checkpoint and
stop, or go on to the next epoch (``set_epoch``), instead.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import accelerate  # type: ignore[import-untyped]
from accelerate.data_loader import DataLoaderShard  # type: ignore[import-untyped]
from accelerate.data_loader import prepare_data_loader as _accelerate_prepare_data_loader
from torch.utils.data import DataLoader, IterableDataset

from croupier.client import DistributedBatchSampler, DistributedSampler, items_consumed, sampler_of

log = logging.getLogger("croupier")

#: The format of :meth:`CroupierLoaderState.state_dict`.
FORMAT = 1


class CroupierDataLoader(DataLoaderShard):  # type: ignore[misc]  # accelerate ships no types
    """Accelerate's ``DataLoaderShard`` over a croupier sampler, counting the batches the loop took.

    Made by :func:`prepare_data_loader`; iterate it as any prepared loader. ``len()`` is this rank's
    batches in the whole current epoch (the sampler's meaning: after a resume, the batches taken
    before the checkpoint count too).

    Attributes:
        croupier_sampler: The loader's :class:`~croupier.client.DistributedSampler` or
            :class:`~croupier.client.DistributedBatchSampler`; its ``epoch`` is the epoch the next
            pass goes through.
        croupier_state: The :class:`CroupierLoaderState` to save and load with the checkpoint.
    """

    croupier_sampler: DistributedSampler | DistributedBatchSampler
    croupier_state: CroupierLoaderState
    _croupier_unit: int  # sampler items per loader batch: 1 for the batch sampler, batch_size for the index sampler
    _count_epoch: int  # the epoch the count is for
    _count_before: int  # sampler items of _count_epoch taken before the count began (a resumed state's)
    _count_batches: int  # loader batches the loop took in _count_epoch since then
    _count_len: int  # len(sampler) for _count_epoch, taken when its pass began
    _accumulation: int  # batches an optimizer step takes (the accelerator's gradient accumulation)
    _steps_before: int | None  # optimizer steps of the job before _count_epoch (None: not known, a resume without one)

    def __iter__(self) -> Iterator[Any]:
        sampler = self.croupier_sampler
        epoch = sampler.epoch
        # DataLoaderShard.__iter__ calls set_epoch(self.iteration) with its own pass counter: the
        # sampler's epoch is the one to go through (a resumed sampler may be at epoch 3).
        self.iteration = epoch
        if self._count_epoch != epoch:
            self._steps_before = self.steps()
            self._count_epoch, self._count_before, self._count_batches = epoch, 0, 0
        self._count_len = len(sampler)
        for batch in super().__iter__():
            self._count_batches += 1
            yield batch

    def consumed(self) -> int | None:
        """Sampler items (indices, or batches) the loop has taken in the current epoch, from the epoch's start.

        None when no pass of the current epoch has begun (the last pass ran to its end, or the loop
        moved on with ``set_epoch``): the sampler has then handed out nothing the loop did not take.
        """
        if self._count_epoch != self.iteration:
            return None
        return items_consumed(self.croupier_sampler, self._count_batches, self._croupier_unit, self._count_before)

    def _batches_taken(self) -> int:
        """Loader batches of the current epoch the loop took, from the epoch's start (a resumed state's included)."""
        return self._count_before // self._croupier_unit + self._count_batches

    def steps(self) -> int | None:
        """Optimizer steps the loop took since the job's start, by its count of batches (see the module);
        None when not known (resumed from a state that names no step)."""
        if self._steps_before is None:
            return None
        batches, a = self._batches_taken(), self._accumulation
        # the epoch's last batch was taken
        whole = self._count_len and self._count_before + self._count_batches * self._croupier_unit >= self._count_len
        return self._steps_before + (-(-batches // a) if whole else batches // a)

    def batches_left(self) -> int:
        """Batches this pass still yields in the current epoch (``len()`` minus those the loop took)."""
        n = len(self)
        if self._count_epoch != self.croupier_sampler.epoch:
            return n
        return max(0, n - self._batches_taken())

    def __reduce__(self) -> Any:
        # DataLoaderShard reports DataLoader as its __class__; pickle this class.
        return (CroupierDataLoader, *super().__reduce__()[1:])


class CroupierLoaderState:
    """The checkpoint state of a :class:`CroupierDataLoader`: a ``Stateful`` for ``register_for_checkpointing``.

    ``state_dict()`` is ``{"format", "sampler", "epoch", "items"}``: the sampler's own state, taken
    with ``consumed=`` the loop's count, and that count (``items`` of ``epoch``), which the resumed
    loader goes on counting from. Every rank returns the same dict in lockstep. Each call names a
    checkpoint in the sampler's audit log, so call it to save, not to look.
    """

    def __init__(self, loader: CroupierDataLoader) -> None:
        self.loader = loader

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """The state to save, at the trainer's global step `step` (default: the loader's count of optimizer
        steps); the sampler's state carries it and the coordinator's record is named after it."""
        loader = self.loader
        consumed = loader.consumed()
        state = loader.croupier_sampler.state_dict(consumed=consumed, step=loader.steps() if step is None else step)
        epoch = loader._count_epoch if consumed is not None else loader.iteration
        return {"format": FORMAT, "sampler": state, "epoch": epoch, "items": consumed or 0}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads what :meth:`state_dict` saved (with any world size), before the loader's first batch.

        Raises:
            ValueError: not such a state; and the sampler's own errors (another job or spec).
            RuntimeError: the sampler has already served a batch.
        """
        if not isinstance(state_dict, dict) or state_dict.get("format") != FORMAT or "sampler" not in state_dict:
            raise ValueError(f"not a croupier loader state (format {FORMAT}): {state_dict!r:.200}")
        loader = self.loader
        loader.croupier_sampler.load_state_dict(state_dict["sampler"])
        epoch = loader.croupier_sampler.epoch
        items = int(state_dict.get("items") or 0)
        loader._count_epoch, loader._count_batches = epoch, 0
        loader._count_before = items if state_dict.get("epoch") == epoch else 0
        loader.iteration = epoch
        # NOTE: the steps of the epochs before are the saved step less the resumed epoch's (counted
        # with this launch's accumulation: a launch that changes it mid-epoch counts from there on)
        step = state_dict["sampler"].get("step") if isinstance(state_dict["sampler"], dict) else None
        in_epoch = loader._batches_taken() // loader._accumulation
        loader._steps_before = step - in_epoch if isinstance(step, int) and step >= in_epoch else None


def prepare_data_loader(accelerator: accelerate.Accelerator, data_loader: DataLoader[Any], *,
                        device_placement: bool | None = None, register: bool = True) -> CroupierDataLoader:
    """``accelerator.prepare`` for a loader over croupier's sampler: placed on the device, not re-sharded.

    Args:
        accelerator: The job's ``Accelerator``.
        data_loader: A ``DataLoader`` over a croupier sampler, as :class:`~croupier.client.Loader` takes it:
            a :class:`~croupier.client.DistributedBatchSampler` (``batch_sampler=``), or a
            :class:`~croupier.client.DistributedSampler` (``sampler=``, with a ``batch_size``,
            or under a torch ``BatchSampler``).
        device_placement: Move batches to ``accelerator.device`` (default: the accelerator's setting).
        register: Register the loader's :class:`CroupierLoaderState` with
            ``accelerator.register_for_checkpointing``, so that ``save_state`` / ``load_state``
            carry the sampler's position. Register in the same order when resuming.

    Returns:
        A :class:`CroupierDataLoader`. Do not call ``skip_first_batches`` on it (see the module).

    Raises:
        ValueError: the accelerator dispatches or splits batches.
        TypeError: the loader is not over a croupier sampler (or over the index sampler without a batch size),
            or its dataset is iterable.
    """
    sampler, unit = sampler_of(data_loader, "croupier.integrations.accelerate.prepare_data_loader",
                               "accelerator.prepare", batched=True)
    if isinstance(data_loader.dataset, IterableDataset):
        raise TypeError("croupier's samplers deal map-style datasets; this loader's dataset is an IterableDataset")
    if accelerator.dispatch_batches:
        raise ValueError("dispatch_batches=True has rank 0 read every batch and scatter it; croupier deals each rank "
                         "its own batches: leave dispatch_batches unset or False")
    if accelerator.split_batches:
        raise ValueError("split_batches=True splits each batch over the ranks; croupier deals each rank its own "
                         "batches of the loader's batch size: set split_batches=False and give the per-rank batch size")
    if device_placement is None:
        device_placement = accelerator.device_placement
    # num_processes=1: accelerate's branch that keeps the loader's (batch) sampler as it is.
    prepared = _accelerate_prepare_data_loader(
        data_loader, accelerator.device, num_processes=1, process_index=0, split_batches=False,
        put_on_device=device_placement, rng_types=list(accelerator.rng_types), dispatch_batches=False,
        even_batches=accelerator.even_batches, non_blocking=accelerator.non_blocking, use_stateful_dataloader=False,
    )
    if type(prepared) is not DataLoaderShard:
        raise TypeError(f"accelerate returned a {type(prepared).__name__} (XLA?), which croupier's integration does not support")
    # A DataLoaderShard keeps everything in its __dict__ (its DataLoader is an attribute); the same
    # object as a CroupierDataLoader, whatever arguments this accelerate version passed it.
    loader = CroupierDataLoader.__new__(CroupierDataLoader)
    loader.__dict__.update(prepared.__dict__)
    loader.croupier_sampler = sampler
    loader._croupier_unit = unit
    loader._count_epoch, loader._count_before, loader._count_batches, loader._count_len = sampler.epoch, 0, 0, 0
    loader._accumulation, loader._steps_before = max(1, int(accelerator.gradient_accumulation_steps)), 0
    loader.iteration = sampler.epoch
    loader.croupier_state = CroupierLoaderState(loader)
    loader._is_accelerate_prepared = True  # a later accelerator.prepare(loader) returns it as it is
    if register:
        accelerator.register_for_checkpointing(loader.croupier_state)
    return loader
