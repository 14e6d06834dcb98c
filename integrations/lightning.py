"""croupier under PyTorch Lightning: :class:`CroupierCheckpoint`, a callback that checkpoints the sampler.

Use croupier's sampler in ``train_dataloader()`` and add the callback::

    from croupier.client import DistributedSampler
    from croupier.integrations.lightning import CroupierCheckpoint

    def train_dataloader(self):
        return DataLoader(dataset, batch_size=32, num_workers=2, sampler=DistributedSampler(dataset, seed=0))

    trainer = Trainer(callbacks=[CroupierCheckpoint(), ModelCheckpoint(every_n_train_steps=100)])
    trainer.fit(model, ckpt_path=last)          # any world size: every sample of the epoch once

Default Trainer settings are fine (``use_distributed_sampler=True``): croupier's sampler is an
instance of torch's ``DistributedSampler``, so Lightning leaves it in place.

What the callback does, and why (checked against Lightning 2.6's loops):

* **Saving.** Lightning saves a model checkpoint on every rank's
  ``Callback.state_dict()``; the callback returns ``sampler.state_dict(consumed=...)`` with
  ``consumed`` taken from the fit loop's batch progress (``batch_progress.current.processed``:
  the batches the loop has trained in this epoch, counted from the epoch's start, also after a
  resume). That count is exactly what Lightning itself resumes from, and it is right with a plain
  ``DataLoader`` and ``num_workers > 0``, which reads the sampler ahead of the loop. When the
  loop has taken the epoch's last batch (``num_training_batches`` reached, which also covers
  ``limit_train_batches``), the state names the next epoch, as Lightning does.
* **Restoring.** Lightning restores callback states before ``fit_loop.run()``; the train
  dataloader, and with it the sampler, is made later, in ``FitLoop.setup_data()``, which then
  measures ``len()`` and calls ``iter()`` at once (with ``num_workers > 0`` that already reads the
  sampler, so the state must be in before it). No callback hook runs in between, so the callback
  wraps the strategy's ``process_dataloader``, the one step every train dataloader goes through
  between its creation and its first ``len()``/``iter()``: it loads the saved state into the
  sampler there. ``sampler.set_epoch(epoch)``, which Lightning calls after ``iter()`` in
  ``on_advance_start``, agrees with the loaded state.
* **Lengths.** Lightning measures the train dataloader once, in ``setup_data()``, and keeps that
  count (``max_batches``, the loader's limit, ``val_check_batch``) for every later epoch. A resume
  with another world size makes the resumed epoch's length (what this rank took before the
  checkpoint plus its share of what is left) differ from a full epoch's: the callback measures
  again at ``on_train_start`` and at every ``on_train_epoch_start``, so that no epoch is cut short
  or run past its end.

torchdata's ``StatefulDataLoader``: Lightning saves its ``state_dict()`` (which holds the
sampler's) in the fit loop's state, and restores it, but only when the fit loop restarts inside
an epoch (``fit_loop.restarting``). In that case the callback leaves the sampler alone (no
double restore): the loader's state wins. From a checkpoint made at an epoch's end Lightning
restores no loader state; the callback then loads its own, without which a loader with
``num_workers > 0`` would start the sampler at epoch 0 before Lightning's ``set_epoch``. So the
callback is not needed for mid-epoch resumes with a ``StatefulDataLoader``, but it is needed for
resumes from end-of-epoch checkpoints, and its length correction is needed whenever the world size
changes: add it in both cases.

``DistributedBatchSampler`` as ``batch_sampler=``: under the default
``use_distributed_sampler=True`` Lightning sees a ``DataLoader`` whose ``sampler`` is not a
``DistributedSampler`` (``DataLoader`` makes a ``SequentialSampler`` when given a
``batch_sampler``), so it builds a torch ``DistributedSampler`` and re-instantiates the batch
sampler's class around it: with the arguments it captured plus ``sampler=`` (a batch sampler made
inside ``train_dataloader()``: ``TypeError: ... does not have an argument called `sampler```), or
as ``cls(that_sampler, batch_size=..., drop_last=...)`` (one made elsewhere: croupier refuses a
sampler as its dataset). Either way the result would lose croupier's own sharding, so nothing in
this callback can make it right: pass ``Trainer(use_distributed_sampler=False)``. croupier's batch
sampler shards by itself, and the callback works with it the same way (``consumed`` then counts
batches). Lightning then leaves validation loaders unsharded too (give them a
``DistributedSampler`` yourself if you want them sharded).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import lightning.pytorch as pl
from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

from croupier.client import DistributedBatchSampler, DistributedSampler, items_consumed, sampler_of

__all__ = ["CroupierCheckpoint", "croupier_sampler"]

_FORMAT = 1

Sampler: TypeAlias = "DistributedSampler | DistributedBatchSampler"


def croupier_sampler(dataloader: object) -> Sampler | None:
    """The croupier sampler that drives `dataloader` (``croupier.client.sampler_of``'s), None for another loader."""
    try:
        return sampler_of(dataloader)[0]
    except TypeError:
        return None


def _is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _train_loaders(trainer: pl.Trainer) -> list[Any]:
    """The fit loop's train dataloaders, flattened (empty before ``setup_data``).

    NOTE: ``fit_loop._combined_loader`` is a Lightning 2.x internal (the public
    ``trainer.train_dataloader`` gives the same loaders, unflattened).
    """
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    return list(combined.flattened) if combined is not None else []


class CroupierCheckpoint(Callback):
    """Saves the train dataloader's croupier sampler state in Lightning's checkpoints and restores it on resume.

    The state is a list, one entry per train dataloader (None for one without a croupier
    sampler): each a sampler's small, topology-free ``state_dict()``, so the job resumes with any
    world size. See the module's docstring for when each step happens and why.
    """

    def __init__(self) -> None:
        self._trainer: pl.Trainer | None = None
        self._pending: list[dict[str, Any] | None] | None = None  # loaded, not yet given to a sampler
        self._loop_has_loader_states = False  # the checkpoint holds Lightning's own dataloader states
        self._original: Callable[[object], object] | None = None  # the strategy's process_dataloader

    # ------------------------------------------------------------------ wiring

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != TrainerFn.FITTING or self._original is not None:
            return
        self._trainer = trainer
        strategy = trainer.strategy
        original = strategy.process_dataloader
        self._original = original

        def process_dataloader(dataloader: object) -> object:
            dataloader = original(dataloader)
            if trainer.state.stage == RunningStage.TRAINING:
                self._restore(trainer, dataloader)
            return dataloader

        # An instance attribute: this Trainer's strategy only, undone at teardown.
        strategy.process_dataloader = process_dataloader  # type: ignore[method-assign]

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._original is not None and "process_dataloader" in vars(trainer.strategy):
            del trainer.strategy.process_dataloader
        self._original = None

    # ------------------------------------------------------------------ saving

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        loaders = _train_loaders(trainer) if trainer is not None else []
        if trainer is None or not loaders or self._pending is not None:
            # No train loader yet (or its states not given to it yet): what was loaded, unchanged.
            return {"format": _FORMAT, "samplers": list(self._pending or [])}
        # The batches this epoch's loop has trained, counted from the epoch's start: what Lightning
        # resumes from (its restored counter starts there again).
        # (``current`` is annotated as the base tracker; it is a ``_ProcessedTracker``.)
        batches: int = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[attr-defined]
        finished = batches >= trainer.num_training_batches
        states: list[dict[str, Any] | None] = []
        for dl in loaders:
            try:
                sampler, per_batch = sampler_of(dl)
            except TypeError:
                states.append(None)
                continue
            if finished:
                consumed = len(sampler)  # the whole epoch: the state names the next one, as Lightning does
            else:
                consumed = items_consumed(sampler, batches, per_batch)
            states.append(sampler.state_dict(consumed=consumed, step=trainer.global_step))
        return {"format": _FORMAT, "samplers": states}

    # ------------------------------------------------------------------ restoring

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        self._loop_has_loader_states = bool(fit_state.get("combined_loader"))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("format") != _FORMAT:
            raise ValueError(f"CroupierCheckpoint: unknown state format {state_dict.get('format')!r} (expected {_FORMAT})")
        self._pending = list(state_dict["samplers"])

    def _restore(self, trainer: pl.Trainer, dataloader: object) -> None:
        """Gives the next loaded state to `dataloader`'s sampler, before its first ``len()`` and ``iter()``."""
        if self._pending is None:
            return
        state = self._pending.pop(0) if self._pending else None
        if not self._pending:
            self._pending = None
        sampler = croupier_sampler(dataloader)
        if sampler is None or state is None:
            return
        if _is_stateful(dataloader) and self._loop_has_loader_states and trainer.fit_loop.restarting:
            return  # Lightning restores the loader's own state, the sampler's included: it must not be loaded twice
        sampler.load_state_dict(state)

    # ------------------------------------------------------------------ lengths

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _measure_again(trainer)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _measure_again(trainer)


def _measure_again(trainer: pl.Trainer) -> None:
    """Makes Lightning's once-measured epoch length the current one of the croupier-sampled train loaders.

    Lightning (2.x) computes the loaders' limits, ``fit_loop.max_batches`` (``num_training_batches``),
    the fetcher's length and ``val_check_batch`` once, in ``FitLoop.setup_data()``; this redoes that
    arithmetic with the lengths the samplers give now.

    NOTE: touches Lightning internals (``fit_loop._combined_loader`` and its ``_iterator``,
    ``fit_loop._data_fetcher``):
    checked against Lightning 2.6; on a Lightning without them it does nothing.
    """
    fit_loop = trainer.fit_loop
    combined = getattr(fit_loop, "_combined_loader", None)
    if combined is None or not any(croupier_sampler(dl) is not None for dl in combined.flattened):
        return
    limits = []
    for dl in combined.flattened:
        length = sized_len(dl)
        limits.append(_parse_num_batches(RunningStage.TRAINING, float("inf") if length is None else length,
                                         trainer.limit_train_batches))
    combined.limits = limits
    mode_iterator = getattr(combined, "_iterator", None)  # the epoch's iterator keeps a copy of the limits
    if mode_iterator is not None:
        mode_iterator.limits = limits
    max_batches = sized_len(combined)
    if max_batches is None:
        return
    fit_loop.max_batches = max_batches
    fetcher = getattr(fit_loop, "_data_fetcher", None)
    if fetcher is not None and fetcher.length is not None:
        fetcher.length = max_batches
    if (getattr(trainer, "_val_check_time_interval", None) is None and isinstance(trainer.val_check_interval, float)
            and trainer.val_check_batch not in (None, float("inf"))):
        trainer.val_check_batch = max(1, int(max_batches * trainer.val_check_interval))
