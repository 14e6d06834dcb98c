"""croupier's sharded datasets: parquet and webdataset shards, local or in object storage, read through a node's cache."""

from __future__ import annotations

from croupier.data._cache import ShardCache
from croupier.data._dataset import DEFAULT_CACHE_BYTES, ShardedDataset, ShardError, default_cache_dir
from croupier.data._formats import FORMATS
from croupier.data._manifest import Manifest, Shard, ShardChanged
from croupier.data._storage import Retry

__all__ = ["DEFAULT_CACHE_BYTES", "FORMATS", "Manifest", "Retry", "Shard", "ShardCache", "ShardChanged", "ShardError",
           "ShardedDataset", "default_cache_dir"]
