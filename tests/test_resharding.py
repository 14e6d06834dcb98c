"""A wrapper that re-shards a croupier sampler is refused, naming the integration to use (no silent loss)."""

from __future__ import annotations

import pytest
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler

from croupier.client import DistributedBatchSampler, DistributedSampler


@pytest.mark.parametrize("make", [
    lambda: DistributedBatchSampler(16, 4, num_replicas=2, rank=0),
    lambda: BatchSampler(DistributedSampler(16, num_replicas=2, rank=0), 4, False),
], ids=["batch sampler", "index sampler in torch's BatchSampler"])
def test_accelerate_resharding_a_croupier_sampler_is_refused(make) -> None:  # type: ignore[no-untyped-def]
    shard = BatchSamplerShard(make(), num_processes=2, process_index=1)
    with pytest.raises(RuntimeError, match=r"re-sharding a croupier sampler.*prepare_data_loader\(accelerator, loader\)"):
        next(iter(shard))


def test_a_batch_sampler_shard_of_one_process_changes_nothing_and_passes() -> None:
    sampler = DistributedBatchSampler(16, 4, num_replicas=1, rank=0, seed=3)
    try:
        batches = list(BatchSamplerShard(sampler, num_processes=1, process_index=0))
        assert len(batches) == 4 and sorted(i for b in batches for i in b) == list(range(16))  # the whole epoch
    finally:
        sampler.close()
