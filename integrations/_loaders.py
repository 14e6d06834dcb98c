"""What the integrations share about a ``DataLoader`` over a croupier sampler (no trainer imported here)."""

from __future__ import annotations

from typing import Any

from torch.utils.data import BatchSampler, DataLoader

from croupier.client import DistributedBatchSampler, DistributedSampler


def croupier_sampler_of(loader: DataLoader[Any], integration: str,
                        otherwise: str) -> tuple[DistributedSampler | DistributedBatchSampler, int]:
    """The croupier sampler of `loader` and the sampler's items in one loader batch (1, or the batch size).

    `integration` names the function that asked and `otherwise` what to use for other loaders, in the error.

    Raises:
        TypeError: `loader` is not over a croupier sampler, or over the index sampler without a batch size.
    """
    batch_sampler = loader.batch_sampler
    if isinstance(batch_sampler, DistributedBatchSampler):
        return batch_sampler, 1
    if isinstance(loader.sampler, DistributedBatchSampler):  # DataLoader(sampler=DistributedBatchSampler, batch_size=None)
        return loader.sampler, 1
    if isinstance(loader.sampler, DistributedSampler):
        if loader.batch_size is None or not isinstance(batch_sampler, BatchSampler):
            raise TypeError("a DataLoader over croupier's DistributedSampler needs a batch_size (or use "
                            "DistributedBatchSampler as its batch_sampler)")
        return loader.sampler, int(loader.batch_size)
    raise TypeError(
        f"this DataLoader's sampler is a {type(loader.sampler).__name__} and its batch sampler a "
        f"{type(batch_sampler).__name__}: {integration} is for loaders over croupier's DistributedSampler "
        f"(sampler=) or DistributedBatchSampler (batch_sampler=); use {otherwise} for the others"
    )
