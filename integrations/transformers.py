"""croupier under the HF ``Trainer``: its data order resumed exactly, mid-epoch and with any world size.

Swap the class (or mix :class:`CroupierTrainerMixin` into your own Trainer subclass)::

    from croupier.integrations.transformers import CroupierTrainer

    trainer = CroupierTrainer(model=model, args=args, train_dataset=dataset)   # as Trainer
    trainer.train(resume_from_checkpoint=last_checkpoint_or_None)

Each checkpoint folder (``checkpoint-<step>``) then holds ``croupier_sampler.json``, the sampler's
state, and ``train(resume_from_checkpoint=...)`` resumes from it, saved by any number of ranks.

How the Trainer handles data, read in transformers 5.23 (``trainer.py``), and the decisions:

* ``get_train_dataloader`` goes through ``accelerator.prepare``, which re-shards any sampler
  (``BatchSamplerShard``): each rank would train half its croupier share on 2 ranks. The mixin's
  ``get_train_dataloader`` builds the loader over a
  :class:`~croupier.client.DistributedBatchSampler` (``per_device_train_batch_size`` a rank,
  ``dataloader_drop_last``, ``data_seed`` else ``seed``; pass ``croupier_sampler=`` for your own
  sampler, or ``croupier_sampler_kwargs=`` for ``job=``, ``tail=``, ...) and prepares it with
  :func:`croupier.integrations.accelerate.prepare_data_loader` (device placement, no re-sharding).
  With ``gradient_accumulation_steps > 1`` it is given ``global_batch=`` (the batch size times the
  world times the accumulation), so the coordinator's step ledger counts the Trainer's steps.
  The batch sampler is the default rather than the index sampler: the DataLoader's own batching
  would drop a short last batch (``dataloader_drop_last``) after the sampler handed it out. The
  dataset and the collator are prepared as the Trainer does (unused columns removed).
* Resuming: the Trainer skips ``global_step % steps_per_epoch`` batches of the resumed epoch with
  ``skip_first_batches`` unless ``args.ignore_data_skip``. croupier's sampler already starts where
  the checkpoint was, so skipping would skip untrained data: the mixin sets
  ``args.ignore_data_skip = True`` (logged when it changes it), and :class:`CroupierCallback`
  refuses to train if anything set it back.
* Order of events in ``_inner_training_loop``: ``get_train_dataloader``; ``len(loader)`` gives
  ``steps_in_epoch``, ``num_update_steps_per_epoch`` and ``max_steps``; ``_init_training_state``
  loads the ``TrainerState`` and computes the epoch to start from as ``global_step //
  num_update_steps_per_epoch``; the model, optimizer and scheduler are loaded; ``on_train_begin``;
  then per epoch ``set_epoch(epoch)`` and one pass. ``len(loader)`` is read before the sampler
  loads the checkpoint, so it is this world's share of a whole epoch: the right length for every
  later epoch, and a bound on the resumed epoch, which yields only what it has left (the pass ends
  when the loader does). The sampler's state is loaded in ``_init_training_state`` (a private
  method of the Trainer, overridden here; the mixin refuses a Trainer that has none): after the
  ``TrainerState``, before the epoch loop.
* The epoch to start from: ``global_step // steps_per_epoch`` holds only while the world size (so
  the steps an epoch takes) is the one that made the checkpoint. Resumed with another world size
  it names a wrong epoch: an epoch ahead, whose ``set_epoch`` would cut the rest of the resumed
  one, or behind, which the sampler refuses. The mixin starts from the sampler's epoch instead,
  and with no batch to skip.
* ``max_steps`` and the learning-rate schedule: when training is epoch-based (``max_steps <= 0``)
  the Trainer stops at ``num_train_epochs * steps_per_epoch`` optimizer steps, counted with this
  world's epoch length, while ``global_step`` counts the steps of the worlds that made the
  checkpoint. On resume the mixin sets ``state.max_steps`` (and the scheduler's
  ``num_training_steps``, through ``create_scheduler``) to ``global_step`` plus the steps the
  data left needs: ``ceil(batches left in the resumed epoch / gradient_accumulation_steps)`` plus
  ``steps_per_epoch`` for each later epoch. Resumed with the same world size this is the
  Trainer's own number; with another, training still runs to the end of the last epoch (instead
  of stopping early, or going on to a learning rate of 0). With ``max_steps > 0`` the run stops
  at ``max_steps`` as the Trainer says, whatever epoch that is.
* Saving: :class:`CroupierCallback`'s ``on_save`` (called on every rank right after the Trainer
  wrote ``checkpoint-<step>``) takes the sampler's state with ``consumed=`` the batches the loop
  took (the prepared loader reads ahead), on every rank, and rank 0 (``args.should_save``) writes
  it into that folder, atomically. A checkpoint folder without the file (the job was killed between
  the Trainer's files and this one) is refused on resume with a clear error rather than restarting
  the data order.

Limits: with ``gradient_accumulation_steps > 1``, a resumed epoch whose batches left do not divide
by it ends on a partial accumulation that the Trainer steps together with the next epoch's first
one (every batch is still trained once). Hyper-parameter search (``run_dir`` per trial) is not
supported. ``dataloader_num_workers``, ``pin_memory`` and ``persistent_workers`` are honoured; the
Trainer's per-worker seeding (``seed_worker``) is not applied.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from croupier.client import DistributedBatchSampler, DistributedSampler
from croupier.integrations.accelerate import CroupierDataLoader, prepare_data_loader

log = logging.getLogger("croupier")

#: The sampler's state in each checkpoint folder.
STATE_FILE = "croupier_sampler.json"


def _write_json(path: str, data: dict[str, Any]) -> None:
    """Writes `data` to `path` atomically (a reader sees the old file or the whole new one)."""
    d = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".croupier-", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class CroupierCallback(TrainerCallback):
    """Saves the sampler's state into each checkpoint folder; checks the Trainer's setup at ``on_train_begin``.

    Added by :class:`CroupierTrainerMixin`; it needs the mixin's loader (a plain ``Trainer`` re-shards
    the sampler, and does not load the state on resume).
    """

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       train_dataloader: Any = None, **kwargs: Any) -> None:
        if not isinstance(train_dataloader, CroupierDataLoader):
            raise TypeError(f"CroupierCallback needs the loader of a CroupierTrainer (or CroupierTrainerMixin), got a "
                            f"{type(train_dataloader).__name__}: a plain Trainer re-shards croupier's sampler")
        if not args.ignore_data_skip:
            raise ValueError("args.ignore_data_skip is False: the Trainer would skip the resumed epoch's first batches, "
                             "which croupier's sampler does not yield again; set it to True")

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                train_dataloader: Any = None, **kwargs: Any) -> None:
        if not isinstance(train_dataloader, CroupierDataLoader):
            return
        # On every rank: each rank's audit log names the checkpoint, and the coordinator records it
        # under the global step (DistributedSampler.resume_from_step).
        data = train_dataloader.croupier_state.state_dict(step=state.global_step)
        if not args.should_save:
            return
        folder = os.path.join(args.output_dir or "", f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"the Trainer's checkpoint folder {folder} does not exist: croupier has nowhere to save "
                                    "the sampler's state (hyper-parameter search runs are not supported)")
        _write_json(os.path.join(folder, STATE_FILE), data)


class CroupierTrainerMixin:
    """Mix into a ``transformers.Trainer`` subclass (before it): croupier's sampler, not re-sharded, resumed exactly.

    Args:
        croupier_sampler: The training sampler: a :class:`~croupier.client.DistributedBatchSampler`
            (its batch size is the per-rank batch) or a :class:`~croupier.client.DistributedSampler`
            (batched by ``per_device_train_batch_size``). Default: a ``DistributedBatchSampler`` over
            ``train_dataset`` made from the arguments (see the module).
        croupier_sampler_kwargs: Extra arguments for the default sampler (``job=``, ``tail=``, ...).

    Everything else is the Trainer's. See the module for what it overrides and why.
    """

    # What the mixin expects of the Trainer it is mixed into (for the type checker).
    args: TrainingArguments
    state: TrainerState
    accelerator: Any
    train_dataset: Any
    data_collator: Any
    _train_batch_size: int

    def __init__(self, *args: Any, croupier_sampler: DistributedSampler | DistributedBatchSampler | None = None,
                 croupier_sampler_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not isinstance(self, Trainer):
            raise TypeError("CroupierTrainerMixin goes before transformers.Trainer in a Trainer subclass's bases")
        if not callable(getattr(Trainer, "_init_training_state", None)):
            import transformers

            raise RuntimeError(f"transformers {transformers.__version__}'s Trainer has no _init_training_state, where "
                               "croupier loads the sampler's state on resume; this integration needs transformers 5")
        super().__init__(*args, **kwargs)
        self.croupier_sampler = croupier_sampler
        self._croupier_sampler_kwargs = dict(croupier_sampler_kwargs or {})
        self._croupier_loader: CroupierDataLoader | None = None
        self._croupier_max_steps: int | None = None
        if not self.args.ignore_data_skip:
            log.info("croupier: setting args.ignore_data_skip = True (the sampler resumes where the checkpoint was; "
                     "skipping batches would skip untrained data)")
            self.args.ignore_data_skip = True
        self.add_callback(CroupierCallback())

    # ---------------------------------------------------------------- the loader

    def _croupier_make_sampler(self, dataset: Any) -> DistributedSampler | DistributedBatchSampler:
        if self.croupier_sampler is None:
            a = self.args
            kw: dict[str, Any] = dict(shuffle=True, seed=a.data_seed if a.data_seed is not None else a.seed,
                                      drop_last=a.dataloader_drop_last)
            if a.gradient_accumulation_steps > 1:  # an optimizer step takes that many batches of every rank
                kw["global_batch"] = self._train_batch_size * a.world_size * a.gradient_accumulation_steps
            kw.update(self._croupier_sampler_kwargs)
            self.croupier_sampler = DistributedBatchSampler(dataset, self._train_batch_size, **kw)
        return self.croupier_sampler

    def get_train_dataloader(self) -> DataLoader[Any]:
        """The training loader over croupier's sampler, prepared without re-sharding (a :class:`CroupierDataLoader`)."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset, collator = self.train_dataset, self.data_collator
        try:
            import datasets  # type: ignore[import-not-found]

            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf_dataset = False
        # As the Trainer's own _get_dataloader: drop the columns the model's forward does not take.
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description="training")  # type: ignore[attr-defined]
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")  # type: ignore[attr-defined]
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise TypeError("croupier's samplers deal map-style datasets; train_dataset is an IterableDataset")
        sampler = self._croupier_make_sampler(dataset)
        a = self.args
        params: dict[str, Any] = dict(collate_fn=collator, num_workers=a.dataloader_num_workers,
                                      pin_memory=a.dataloader_pin_memory,
                                      persistent_workers=a.dataloader_persistent_workers and a.dataloader_num_workers > 0)
        if a.dataloader_num_workers > 0 and a.dataloader_prefetch_factor is not None:
            params["prefetch_factor"] = a.dataloader_prefetch_factor
        if isinstance(sampler, DistributedBatchSampler):
            loader = DataLoader(dataset, batch_sampler=sampler, **params)
        else:
            loader = DataLoader(dataset, sampler=sampler, batch_size=self._train_batch_size, drop_last=a.dataloader_drop_last,
                                **params)
        self._croupier_loader = prepare_data_loader(self.accelerator, loader, register=False)
        return self._croupier_loader

    # ---------------------------------------------------------------- resuming

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int, num_train_epochs: int,
                             resume_from_checkpoint: str | None, trial: Any) -> tuple[int, int]:
        """The Trainer's, then: load the sampler's state, start from its epoch, skip nothing, fix ``max_steps``."""
        epochs_trained, skip = super()._init_training_state(  # type: ignore[misc]
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial)
        self._croupier_max_steps = None
        if resume_from_checkpoint is None:
            return epochs_trained, skip
        loader = self._croupier_loader
        if loader is None:
            raise RuntimeError("croupier: the training loader was not made by CroupierTrainerMixin.get_train_dataloader")
        path = os.path.join(resume_from_checkpoint, STATE_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path} is missing: checkpoint {resume_from_checkpoint} holds no croupier sampler state (saved by a "
                "plain Trainer, or interrupted between the Trainer's files and croupier's), so its data order cannot be "
                "resumed; resume an earlier checkpoint, or start the data over with a fresh audit directory"
            )
        with open(path) as f:
            loader.croupier_state.load_state_dict(json.load(f))
        epoch = loader.croupier_sampler.epoch
        if self.args.max_steps <= 0:
            ga = self.args.gradient_accumulation_steps
            later = max(0, num_train_epochs - epoch - 1) * num_update_steps_per_epoch
            left = math.ceil(loader.batches_left() / ga) + later if epoch < num_train_epochs else 0
            self._croupier_max_steps = self.state.global_step + left
            if self._croupier_max_steps != max_steps:
                log.info("croupier: resumed at epoch %d, step %d with another epoch length: max_steps %d -> %d",
                         epoch, self.state.global_step, max_steps, self._croupier_max_steps)
            self.state.max_steps = self._croupier_max_steps
        if epoch != epochs_trained:
            log.info("croupier: the checkpoint's data is at epoch %d (the Trainer's step count says %d): starting there",
                     epoch, epochs_trained)
        return epoch, 0

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """The Trainer's, over the steps the data left needs when resumed (see the module)."""
        if self._croupier_max_steps is not None:
            num_training_steps = self._croupier_max_steps
        return super().create_scheduler(num_training_steps, optimizer)  # type: ignore[misc]


class CroupierTrainer(CroupierTrainerMixin, Trainer):
    """``transformers.Trainer`` with :class:`CroupierTrainerMixin`: croupier's sampler, resumed exactly."""
