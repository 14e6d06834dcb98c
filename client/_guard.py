"""Refusals of the wrappers known to re-shard what a croupier sampler deals: a rank would silently train a part of its share."""

from __future__ import annotations

import sys
from types import FrameType

#: How many frames above a sampler's ``__iter__`` are looked at for a wrapper that iterates it.
_DEPTH = 8


def refuse_resharding() -> None:
    """Raises RuntimeError when a known re-sharding wrapper is iterating the caller (a sampler's ``__iter__``).

    croupier's sampler already deals each rank its own share; a wrapper that shards it again
    keeps one batch in ``num_processes`` of it on each rank, and the run ends with exit code 0
    having trained a fraction of every epoch. Known today: Accelerate's ``BatchSamplerShard``
    (what ``accelerator.prepare(loader)`` puts around the loader's batch sampler when there are
    several processes, and what the HF Trainer does with its train loader). The check reads the
    calling frames once per pass over the sampler.
    """
    frame: FrameType | None = sys._getframe(2)  # the caller of the sampler's __iter__
    for _ in range(_DEPTH):
        if frame is None:
            return
        owner = frame.f_locals.get("self")
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
        frame = frame.f_back
