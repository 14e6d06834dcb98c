"""croupier's client: drop-in samplers for torch's DataLoader, fed by a croupier coordinator."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from croupier.client._filter import FILTERED, Filtered
from croupier.client._guard import MissingCallbackWarning
from croupier.client._rpc import CHANNEL_OPTIONS, CoordinatorClient, Security
from croupier.client._sample import Sample

if TYPE_CHECKING:
    from croupier.client._loader import Loader, items_consumed, sampler_of
    from croupier.client._packed import Indexed, PackedLoader
    from croupier.client._packing import Packed
    from croupier.client._sampler import DistributedBatchSampler, DistributedSampler
    from croupier.client._shards import shards
    from croupier.client._workers import worker_options

__all__ = ["CHANNEL_OPTIONS", "FILTERED", "CoordinatorClient", "DistributedBatchSampler", "DistributedSampler",
           "Filtered", "Indexed", "Loader", "MissingCallbackWarning", "Packed", "PackedLoader", "Sample", "Security",
           "items_consumed", "sampler_of", "shards", "worker_options"]

#: Imported when first asked for: they need torch, which tools that only call the coordinator
#: (``croupier status``, ``croupier health``: a probe runs often) should not wait for.
_SAMPLERS = {"DistributedBatchSampler": "_sampler", "DistributedSampler": "_sampler", "Indexed": "_packed",
             "Loader": "_loader", "Packed": "_packing", "PackedLoader": "_packed", "items_consumed": "_loader",
             "sampler_of": "_loader", "shards": "_shards", "worker_options": "_workers"}


def __getattr__(name: str) -> Any:
    if name in _SAMPLERS:
        import importlib

        return getattr(importlib.import_module(f"croupier.client.{_SAMPLERS[name]}"), name)
    raise AttributeError(f"module 'croupier.client' has no attribute {name!r}")
