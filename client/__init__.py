"""croupier's client: drop-in samplers for torch's DataLoader, fed by a croupier coordinator."""

from croupier.client._rpc import CoordinatorClient, Security
from croupier.client._sampler import DistributedBatchSampler, DistributedSampler, shards

__all__ = ["CoordinatorClient", "DistributedBatchSampler", "DistributedSampler", "Security", "shards"]
