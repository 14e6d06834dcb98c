"""Train on a folder of parquet files: a shard-local order read through croupier.data, exact on resume.

Make some data, then train (one process, or several under torchrun)::

    python examples/parquet_train.py --make out/parquet          # 32 parquet shards of 500 rows
    python examples/parquet_train.py out/parquet                  # one process
    torchrun --nproc-per-node 2 examples/parquet_train.py out/parquet

Each row has an ``id`` (its dataset index) and a ``text``. The loop counts the ids it trains on; at the
end of each epoch it checks, over every rank, that each row came once (torchrun: through the process
group), and prints the rows trained and the shards rank 0 read. ``--stop-at N`` stops the run after N
steps with a checkpoint in ``--checkpoint`` (the loader's state and the ids trained so far in the
epoch); a run without it resumes there, on any number of processes, and checks the epoch whole.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Any


def make(folder: pathlib.Path, shards: int = 32, rows: int = 500) -> None:
    """`shards` parquet files of `rows` rows each: ``id`` (the dataset index) and a line of ``text``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        ids = list(range(s * rows, (s + 1) * rows))
        table = pa.table({"id": ids, "text": [f"row {i} of shard {s}: " + "lorem ipsum " * 8 for i in ids]})
        pq.write_table(table, folder / f"part-{s:05d}.parquet", row_group_size=100)
    print(f"wrote {shards} shards of {rows} rows to {folder}")


def _ids(batch: Any) -> list[int]:
    return [int(i) for i in batch["id"]]


def _gather(ids: list[int]) -> list[int]:
    """Every rank's ids (torchrun: through the process group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return ids
    everyone: list[list[int]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, ids)
    return [i for part in everyone for i in part]


def train(folder: str, epochs: int, batch_size: int, workers: int, checkpoint: pathlib.Path, stop_at: int | None,
          reader_group: int) -> int:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from croupier.client import DistributedBatchSampler, Loader
    from croupier.data import ShardedDataset

    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0

    ds = ShardedDataset(folder)                                                    # sizes from the footers
    batches = DistributedBatchSampler(ds, batch_size, shard_sizes=ds.shard_sizes,  # a shard-local order
                                      reader_group=reader_group)
    batches.read_ahead = ds.read_ahead  # the next leases' shards fetched while this one trains (object storage)
    loader = Loader(DataLoader(ds, batch_sampler=batches, num_workers=workers))
    state = json.loads(checkpoint.read_text()) if checkpoint.exists() else None
    if state:
        loader.load_state_dict(state["loader"])
        ds.resume(batches.spec, state["loader"])  # the node's cache counts the rows read before the checkpoint
    step, start = (state["step"], state["epoch"]) if state else (0, 0)
    for epoch in range(start, epochs):
        batches.set_epoch(epoch)
        # the rows trained before the checkpoint this run resumed from, in its epoch
        seen: list[int] = list(state["seen"]) if state and epoch == start and rank == 0 else []
        shards: set[int] = set()
        for batch in loader:
            ids = _ids(batch)
            seen += ids
            shards.update(ds.shard_of(i)[0] for i in ids)
            step += 1
            if stop_at is not None and step == stop_at:
                kept = _gather(seen)
                if rank == 0:
                    checkpoint.write_text(json.dumps({"step": step, "epoch": epoch, "seen": kept,
                                                      "loader": loader.state_dict(step=step)}))
                    print(f"stopped at step {step} with a checkpoint in {checkpoint}", flush=True)
                batches.close()
                return 0
        got = sorted(_gather(seen))
        if rank == 0:
            ok = got == list(range(len(ds)))
            print(f"epoch {epoch}: {len(got)} rows trained, rank 0 read {len(shards)} of {len(ds.shard_sizes)} shards; "
                  f"{'every row once' if ok else 'NOT every row once'}", flush=True)
            if not ok:
                return 1
    batches.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--make", action="store_true", help="write the example's parquet shards into FOLDER and stop")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--checkpoint", type=pathlib.Path, default=pathlib.Path("out/parquet_train.json"),
                    help="where --stop-at writes its checkpoint and a later run resumes from (delete it to start over)")
    ap.add_argument("--stop-at", type=int, default=None, help="stop after this many steps with a checkpoint")
    ap.add_argument("--reader-group", type=int, default=2,
                    help="ranks sharing a node's cache (by default a sampler takes LOCAL_WORLD_SIZE); part of the job's "
                         "spec, so it stays the same when the job resumes on another number of processes")
    a = ap.parse_args(argv)
    if a.make:
        make(pathlib.Path(a.folder))
        return 0
    a.checkpoint.parent.mkdir(parents=True, exist_ok=True)
    return train(a.folder, a.epochs, a.batch_size, a.workers, a.checkpoint, a.stop_at, a.reader_group)


if __name__ == "__main__":
    sys.exit(main())
