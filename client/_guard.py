"""Refusals of the known wrong ways to drive a croupier sampler, where a run would otherwise lose data silently.

Three are known, all read from the frames that call a sampler's ``__iter__``:

* a wrapper that re-shards what croupier already dealt to this rank (Accelerate's
  ``BatchSamplerShard``): each rank would train a fraction of its share and exit 0;
* a Lightning ``Trainer`` without :class:`~croupier.integrations.lightning.CroupierCheckpoint`:
  its checkpoints do not hold croupier's position, so ``fit(ckpt_path=...)`` would start the
  epoch over (plain ``DataLoader``) or size the resumed epoch for the old world
  (``StatefulDataLoader`` on another number of devices). Resuming so is refused; a fresh ``fit``
  without the callback warns once, since every checkpoint it saves would lead to that refusal;
* a wrapper that reads the sampler a batch ahead of the loop (Ray Train's ``prepare_data_loader``):
  ``state_dict()`` would name a batch the loop never trained as done, so it then insists on
  ``consumed=`` (``croupier.integrations.ray`` counts it).
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType
from typing import Any

#: How many frames above a sampler's ``__iter__`` are looked at for a re-sharding wrapper (it iterates the sampler).
_SHARD_DEPTH = 8
#: How many for a Lightning loop or Trainer (about 20 above, through the loader and the fetcher, in Lightning 2.6).
_TRAINER_DEPTH = 48

_CALLBACK = "croupier.integrations.lightning.CroupierCheckpoint"


class MissingCallbackWarning(UserWarning):
    """A Lightning Trainer drives a croupier sampler without ``CroupierCheckpoint``: its checkpoints cannot resume it."""


def check_callers(first: bool, loaded: bool) -> str | None:
    """Raises RuntimeError when a sampler's ``__iter__`` is called on a known wrong path (see the module).

    `first`: the sampler has not joined its job yet (the Trainer is looked for then only).
    `loaded`: a checkpoint state was loaded into the sampler (by the user's own code, say).

    Returns the name of a known wrapper that reads the sampler a batch ahead of the training loop
    (Ray Train's ``prepare_data_loader``), for ``state_dict()`` to insist on ``consumed=``; else None.
    """
    frame: FrameType | None = sys._getframe(2)  # the caller of the sampler's __iter__
    depth = _TRAINER_DEPTH if first else _SHARD_DEPTH
    ahead = None
    for level in range(depth):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if owner is not None:
            if level < _SHARD_DEPTH:
                _refuse_shard(owner)
                ahead = ahead or _reads_ahead(owner)
            trainer = _lightning_trainer(owner) if first else None
            if trainer is not None:
                _check_trainer(trainer, loaded)
                break
        frame = frame.f_back
    return ahead


def _reads_ahead(owner: object) -> str | None:
    cls = type(owner)
    if cls.__name__ == "_WrappedDataLoader" and cls.__module__.startswith("ray.train."):
        return "Ray Train's prepare_data_loader"
    return None


def _refuse_shard(owner: object) -> None:
    cls = type(owner)
    shards = int(getattr(owner, "num_processes", 1) or 1)
    if cls.__name__ == "BatchSamplerShard" and cls.__module__.startswith("accelerate.") and shards > 1:
        raise RuntimeError(
            f"Accelerate's BatchSamplerShard (num_processes={shards}) is re-sharding a croupier "
            "sampler, which already deals each rank its own batches: every rank would train 1 batch in "
            f"{shards} of its share. Prepare this loader with "
            "croupier.integrations.accelerate.prepare_data_loader(accelerator, loader) instead of "
            "accelerator.prepare(loader); under the HF Trainer, train with "
            "croupier.integrations.transformers.CroupierTrainer (docs/integrations.md)"
        )


def _lightning_trainer(owner: object) -> Any:
    """The Lightning Trainer `owner` is or belongs to (a loop, a fetcher with ``trainer``), or None."""
    module = type(owner).__module__
    if not module.startswith(("lightning.pytorch.", "pytorch_lightning.")):
        return None
    if type(owner).__name__ == "Trainer":
        return owner
    trainer = getattr(owner, "trainer", None)
    return trainer if type(trainer).__name__ == "Trainer" else None


def _check_trainer(trainer: Any, loaded: bool) -> None:
    callbacks = getattr(trainer, "callbacks", None) or []
    if any(f"{type(cb).__module__}.{type(cb).__name__}" == _CALLBACK for cb in callbacks):
        return
    resuming = getattr(trainer, "ckpt_path", None)
    if resuming and not loaded:
        raise RuntimeError(
            f"Lightning resumes from {resuming} without {_CALLBACK}: its checkpoint holds no croupier position "
            "that reaches this sampler before its first batch, so the epoch would start over (a plain DataLoader) or "
            "be sized for the old world (a StatefulDataLoader on another number of devices). Add "
            "Trainer(callbacks=[CroupierCheckpoint()]) from croupier.integrations.lightning, here and in the runs that "
            "save the checkpoints (docs/integrations.md)"
        )
    if not resuming:
        warnings.warn(
            f"a Lightning Trainer drives this croupier sampler without {_CALLBACK}: the checkpoints it saves hold no "
            "croupier position, and fit(ckpt_path=...) from them will be refused. Add "
            "Trainer(callbacks=[CroupierCheckpoint()]) from croupier.integrations.lightning",
            MissingCallbackWarning,
            stacklevel=4,
        )
