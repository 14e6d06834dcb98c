"""croupier's client: drop-in samplers for torch's DataLoader, fed by a croupier coordinator."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from croupier.client._rpc import CoordinatorClient, Security

if TYPE_CHECKING:
    from croupier.client._sampler import DistributedBatchSampler, DistributedSampler, shards

__all__ = ["CoordinatorClient", "DistributedBatchSampler", "DistributedSampler", "Security", "shards"]

#: Imported when first asked for: they need torch, which tools that only call the coordinator
#: (``croupier status``, ``croupier health``: a probe runs often) should not wait for.
_SAMPLERS = ("DistributedBatchSampler", "DistributedSampler", "shards")


def __getattr__(name: str) -> Any:
    if name in _SAMPLERS:
        from croupier.client import _sampler

        return getattr(_sampler, name)
    raise AttributeError(f"module 'croupier.client' has no attribute {name!r}")
