"""croupier under Ray Train: the sampler's state inside Ray's checkpoints, restored by any number of workers.

Inside ``train_loop_per_worker`` of a ``ray.train.torch.TorchTrainer``, croupier's sampler works
as under torchrun: Ray Train sets up the process group (gloo or nccl) before the loop runs, the
sampler takes the world and rank from it, and rank 0 hosts the embedded coordinator (or set
``CROUPIER_ADDRESS`` to a ``croupier serve`` the driver started). Two things are Ray's own, and
this module does them::

    from croupier.client import DistributedSampler
    from croupier.integrations import ray as croupier_ray

    def train_loop_per_worker(config):
        sampler = DistributedSampler(dataset, seed=0, job=config["job"])
        checkpoint = croupier_ray.load(sampler, config.get("resume"))   # Ray's latest, else `resume`
        loader = croupier_ray.prepare_data_loader(DataLoader(dataset, batch_size=32, sampler=sampler))
        ...
        for batch in loader:
            ...
            croupier_ray.report({"loss": loss}, loader, files={"model.pt": model_bytes})  # every worker

* **The loader** (:func:`prepare_data_loader`): Ray's ``prepare_data_loader`` (which keeps
  croupier's sampler: it is an instance of torch's ``DistributedSampler``), counting the batches
  that reach the loop. Ray's loader reads one batch ahead of the loop (it moves the next batch to
  the device while this one trains), so what the sampler handed out is one batch more than what
  was trained; the count is the ``consumed=`` of the sampler's state. A sampler read ahead by
  Ray's loader refuses a ``state_dict()`` without ``consumed=``, rather than name a batch the loop
  never trained as done.
* **Saving** (:func:`report`): ``ray.train.report`` is called by every worker; rank 0 attaches a
  checkpoint directory with the sampler's state (``croupier_sampler.json``) and the files it is
  given (the model's, say); the others report without one, as Ray asks.
* **Restoring** (:func:`load`): after a worker dies, Ray restarts the worker group (``FailureConfig``)
  and ``ray.train.get_checkpoint()`` names the last checkpoint reported; a run started again by
  the driver (another ``ScalingConfig``, a new cluster) gets it through the loop's config instead
  (Ray Train v2 dropped ``resume_from_checkpoint``). Either way the state loads before the
  sampler's first batch, on any number of workers.

With a loader whose ``sampler`` is not croupier's ``DistributedSampler`` (``DistributedBatchSampler``
as ``batch_sampler=``, or a torch ``BatchSampler`` over croupier's sampler), :func:`prepare_data_loader`
passes ``add_dist_sampler=False``: otherwise Ray rebuilds the loader around a torch
``DistributedSampler`` of its own and croupier is not used.
"""

from __future__ import annotations

import json
import pathlib
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import ray.train
import ray.train.torch
from torch.utils.data import DataLoader

from croupier.client import DistributedBatchSampler, DistributedSampler, items_consumed, sampler_of

__all__ = ["STATE_FILE", "CountedLoader", "load", "prepare_data_loader", "report"]

#: The sampler's state in a checkpoint directory.
STATE_FILE = "croupier_sampler.json"


class CountedLoader:
    """Ray's prepared loader, counting the batches of the current epoch that reached the training loop."""

    def __init__(self, loader: Any, sampler: DistributedSampler | DistributedBatchSampler, unit: int) -> None:
        self.loader = loader
        self.sampler = sampler
        self.unit = unit  # sampler items per loader batch: 1 for the batch sampler, the batch size for the index sampler
        self.batches = 0  # batches of the current pass that the loop has received
        self.resumed = 0  # items of the pass's epoch taken before the checkpoint it resumed from

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.batches = 0
        for batch in self.loader:
            if self.batches == 0:  # the sampler has joined and is in the pass's epoch now
                self.resumed = self.sampler.items_resumed
            self.batches += 1
            yield batch

    def consumed(self) -> int:
        """What the loop took of the epoch, as ``state_dict(consumed=)`` counts it: from the epoch's start
        (a resumed epoch's items before the checkpoint included), batches for a batch sampler."""
        return items_consumed(self.sampler, self.batches, self.unit, self.resumed)


def prepare_data_loader(loader: DataLoader[Any], **ray_options: Any) -> CountedLoader:
    """``ray.train.torch.prepare_data_loader(loader)`` for a loader driven by a croupier sampler, counting what the loop takes.

    Raises:
        TypeError: `loader` is not driven by a croupier sampler (or drives the index sampler without a batch size).
    """
    sampler, unit = sampler_of(loader, "croupier.integrations.ray.prepare_data_loader",
                               "ray.train.torch.prepare_data_loader", batched=True)
    if not isinstance(loader.sampler, DistributedSampler):
        # A batch sampler's loader: Ray would otherwise rebuild it around a torch DistributedSampler of its own.
        ray_options.setdefault("add_dist_sampler", False)
    return CountedLoader(ray.train.torch.prepare_data_loader(loader, **ray_options), sampler, unit)


def report(metrics: Mapping[str, Any], loader: CountedLoader | DistributedSampler | DistributedBatchSampler, *,
           consumed: int | None = None, step: int | None = None, files: Mapping[str, bytes] | None = None) -> None:
    """``ray.train.report(metrics, checkpoint=...)`` with the sampler's state in the checkpoint; call it on every worker.

    Args:
        metrics: Ray's metrics for this report.
        loader: The loader :func:`prepare_data_loader` made (its count is what was consumed), or the
            croupier sampler itself (then pass `consumed` if a loader reads it ahead).
        consumed: What the loop consumed of the epoch (``sampler.state_dict(consumed=...)``); by
            default the loader's count.
        step: The trainer's global step: the sampler's state carries it (``state_dict(step=...)``), the
            coordinator's record is named after it, and its step ledger counts on from it on resume.
        files: More files for the checkpoint (name -> bytes), written by rank 0 only.
    """
    if isinstance(loader, CountedLoader):
        sampler = loader.sampler
        consumed = loader.consumed() if consumed is None else consumed
    else:
        sampler = loader
    state = sampler.state_dict(consumed=consumed, step=step)
    if ray.train.get_context().get_world_rank() != 0:
        ray.train.report(dict(metrics), checkpoint=None)
        return
    with tempfile.TemporaryDirectory(prefix="croupier-ray-") as tmp:
        path = pathlib.Path(tmp)
        (path / STATE_FILE).write_text(json.dumps(state))
        for name, data in (files or {}).items():
            (path / name).write_bytes(data)
        ray.train.report(dict(metrics), checkpoint=ray.train.Checkpoint.from_directory(tmp))


def load(sampler: DistributedSampler | DistributedBatchSampler,
         resume: str | pathlib.Path | ray.train.Checkpoint | None = None) -> ray.train.Checkpoint | None:
    """Loads the sampler's state from Ray's latest checkpoint of this run, else from `resume`; returns the checkpoint used.

    Call it before the sampler's first batch. Returns None (and loads nothing) when there is no
    checkpoint, which is a fresh start.

    Raises:
        ValueError: the checkpoint holds no croupier state (it was not saved by :func:`report`).
    """
    checkpoint: ray.train.Checkpoint | None = ray.train.get_checkpoint()
    if checkpoint is None and resume is not None:
        checkpoint = resume if isinstance(resume, ray.train.Checkpoint) else ray.train.Checkpoint(str(resume))
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as d:
        path = pathlib.Path(d) / STATE_FILE
        if not path.exists():
            raise ValueError(f"checkpoint {checkpoint.path} holds no {STATE_FILE}: save it with "
                             "croupier.integrations.ray.report(...), which puts the sampler's state in it")
        sampler.load_state_dict(json.loads(path.read_text()))
    return checkpoint
