"""One rank of a job reading parquet shards through `croupier.data.ShardedDataset`, and what its tests share.

Usage: python _shard_rank.py RUN_DIR MANIFEST OPTIONS CACHE_ROOT [--batch-size B] [--workers W] [--every K]
           [--park-after S] [--park-rank R] [--state FILE]

The torchrun environment names the rank (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK) and
CROUPIER_ADDRESS and CROUPIER_JOB the coordinator and the job; the ranks meet through RUN_DIR/init (gloo).
The rank reads the shards of the manifest file MANIFEST (storage options in the JSON file OPTIONS) into its
node's cache, CACHE_ROOT/node{GROUP_RANK}, with ``DistributedBatchSampler(ds, B, shard_sizes=ds.shard_sizes,
reader_group=2)`` and croupier's ``Loader`` over a DataLoader of W workers (prefetch_factor 4). Each batch
the loop takes appends ``{"epoch", "step", "rank", "rows"}`` to RUN_DIR/log-r{RANK}.jsonl (flushed), each row
``[index, id]``: the index dealt and the ``id`` column of the row read (None for a FILTERED sample). The
ranks then step together (an all-reduce of who still has a batch, as DDP's ``Join`` does at an uneven
epoch's end). At every K-th step that every rank took, each rank takes ``Loader.state_dict()`` and rank 0
writes it to RUN_DIR/ckpt-{step}.json (atomically). After step S, rank R prints "parked" and waits to be
killed. --state resumes from such a checkpoint file; the run ends with the epoch it began.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import signal
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from croupier.client import FILTERED, DistributedBatchSampler, Indexed, Loader
from croupier.data import Manifest, ShardedDataset

#: The samplers' shard order: windows of 2 shards, 4 heads a reader group, groups of 2 ranks.
ORDER = {"shard_window": 2, "lanes": 4, "reader_group": 2}
SEED = 17
#: DataLoader workers forked from a server that imported torch and the readers once.
CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "pyarrow.parquet", "s3fs", "croupier.data", "_shard_rank"])


def write_shards(folder: pathlib.Path, sizes: Sequence[int], row_group: int = 10) -> list[pathlib.Path]:
    """One parquet file per size; each row's ``id`` is its dataset index (the shards' rows numbered on)."""
    folder.mkdir(parents=True, exist_ok=True)
    out, n = [], 0
    for i, size in enumerate(sizes):
        ids = list(range(n, n + size))
        path = folder / f"{i:05d}.parquet"
        pq.write_table(pa.table({"id": pa.array(ids, pa.int64()), "text": [f"row {j}" for j in ids]}), path,
                       row_group_size=row_group)
        out.append(path)
        n += size
    return out


def rows_of(batch: list[tuple[int, Any]]) -> list[list[int | None]]:
    """A DataLoader's collate_fn over ``Indexed(ds)``: ``[index, id]`` of each sample, id None when FILTERED."""
    return [[int(i), None if row is FILTERED else int(row["id"])] for i, row in batch]


def loader_of(ds: Any, sampler: Any, workers: int) -> Any:
    """croupier's ``Loader`` over a DataLoader of ``Indexed(ds)`` with `workers` workers (prefetch_factor 4)."""
    more: dict[str, Any] = {"multiprocessing_context": CONTEXT, "prefetch_factor": 4} if workers else {}
    return Loader(DataLoader(Indexed(ds), batch_sampler=sampler, num_workers=workers, collate_fn=rows_of, **more))


def _save(path: pathlib.Path, checkpoint: dict[str, Any]) -> None:
    """Writes `checkpoint` to `path` atomically: a kill -9 leaves no half of it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(checkpoint))
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("run", "manifest", "options", "cache"):
        ap.add_argument(name)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--park-after", type=int)
    ap.add_argument("--park-rank", type=int, default=0)
    ap.add_argument("--state")
    a = ap.parse_args()

    from _shard_rank import loader_of  # the collate_fn pickled by this module's name, for the workers

    run = pathlib.Path(a.run)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{run / 'init'}", rank=rank, world_size=world)
    ds = ShardedDataset(Manifest.load(a.manifest), storage_options=json.loads(pathlib.Path(a.options).read_text()),
                        cache_dir=pathlib.Path(a.cache) / f"node{os.environ['GROUP_RANK']}")
    sampler = DistributedBatchSampler(ds, a.batch_size, shard_sizes=ds.shard_sizes, seed=SEED, tail="uneven",
                                      **ORDER)  # rank and world from the process group, address and job from the environment
    loader = loader_of(ds, sampler, a.workers)
    epoch = step = 0
    if a.state:
        saved = json.loads(pathlib.Path(a.state).read_text())
        loader.load_state_dict(saved["state"])
        epoch, step = saved["state"]["epoch"], saved["step"]
    sampler.set_epoch(epoch)
    it, more = iter(loader), True
    with open(run / f"log-r{rank}.jsonl", "a") as log:
        while True:
            batch = next(it, None) if more else None
            more = batch is not None
            if batch is not None:
                log.write(json.dumps({"epoch": epoch, "step": step + 1, "rank": rank, "rows": batch}) + "\n")
                log.flush()
            having = torch.tensor([int(more)])
            dist.all_reduce(having)  # the step every rank takes together
            if int(having) == 0:
                break
            step += 1
            if step % a.every == 0 and int(having) == world:
                state = loader.state_dict(step=step)
                if rank == 0:
                    _save(run / f"ckpt-{step}.json", {"step": step, "state": state})
            if step == a.park_after and rank == a.park_rank:
                print("parked", flush=True)
                signal.pause()  # until the test kills the rank and its workers with SIGKILL
    loader.close()
    sampler.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
