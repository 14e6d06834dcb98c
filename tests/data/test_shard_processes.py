"""croupier.data across processes against an S3-API server on loopback: the node's ranks and DataLoader workers
share one cache, and a shard asked for by several of them at once is fetched once (counted in the server's
request log)."""

from __future__ import annotations

import multiprocessing
import os
import pathlib
from collections.abc import Iterator

import pytest
import torch
from _s3 import S3Server, serve_s3
from _shard_files import hold, lock_waiters, read_one, row_id, until, write_parquet

from croupier.client import worker_options
from croupier.data import Manifest, ShardedDataset

pytestmark = [pytest.mark.e2e, pytest.mark.paired]


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    """The module's S3-API server on loopback."""
    yield from serve_s3()


def _gets_of_one_fetch(s3: S3Server, manifest: Manifest, tmp_path: pathlib.Path, every_row: bool) -> list[int]:
    """The GET requests one read of each shard's first row (`every_row`: of its every row) takes, through a
    cache of its own: its footer and the row groups read."""
    ds = ShardedDataset(manifest, storage_options=s3.options, cache_dir=tmp_path / f"baseline{int(every_row)}")
    out = []
    for s, shard in enumerate(manifest.shards):
        before = s3.gets(shard.path)
        for i in ds.indices(s) if every_row else [ds.offsets[s]]:
            ds[i]
        out.append(s3.gets(shard.path) - before)
    assert all(n >= 1 for n in out)
    return out


def test_two_processes_reading_one_shard_fetch_it_once(s3: S3Server, tmp_path: pathlib.Path) -> None:
    s3.put(write_parquet(tmp_path / "d", [40, 40]), "procs")
    m = Manifest.build(s3.url("procs"), storage_options=s3.options)
    node = tmp_path / "node"
    (node / "shards").mkdir(parents=True)
    lock = os.path.join(node, "shards", f"{m.shards[1].key}-0.lock")  # rows 40, 41: shard 1's first row group
    ctx = multiprocessing.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=read_one, args=(m.to_json(), s3.options, str(node), 40 + k, ready, out))
             for k in range(2)]
    fd = hold(lock)  # both readers find the shard's fetch under way
    try:
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=120)
        until("both readers waiting on the row group's lock",
              lambda: lock_waiters(lock) == 2 or not all(p.is_alive() for p in procs))
        before = s3.gets(m.shards[1].path)  # both read the footer (once: the node's index) before the lock
    finally:
        os.close(fd)
    got = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert [row for row, _ in got] == [40, 41]
    assert sum(fetches for _, fetches in got) == 1
    assert s3.gets(m.shards[1].path) - before == 1  # one ranged read of the row group


def test_dataloader_workers_share_the_node_cache(s3: S3Server, tmp_path: pathlib.Path) -> None:
    s3.put(write_parquet(tmp_path / "d", [30] * 4, row_group=7), "loader")
    m = Manifest.build(s3.url("loader"), storage_options=s3.options)
    ds = ShardedDataset(m, storage_options=s3.options, cache_dir=tmp_path / "node", transform=row_id)
    before = [s3.gets(s.path) for s in m.shards]
    # Batches of 10 dealt to the two workers in turn: both read every shard. NOTE: workers that start safely
    # (worker_options: spawned before CPython 3.12): this process runs the S3 server's and the store client's
    # threads, and a fork beside them can leave a worker stuck before it runs a line (CPython gh-112275).
    loader = torch.utils.data.DataLoader(ds, batch_size=10, **worker_options(2))
    assert [i for batch in loader for i in batch.tolist()] == list(range(120))
    fetched = [s3.gets(s.path) - b for s, b in zip(m.shards, before)]
    assert fetched == _gets_of_one_fetch(s3, m, tmp_path, every_row=True)  # each row group fetched once by the two
