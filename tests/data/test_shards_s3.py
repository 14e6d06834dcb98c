"""croupier.data against a real S3-API server on loopback (moto's server mode, through s3fs): sizes from the
footers, every index its row, the cache's bound in bytes, prefetch, a vanished, a changed and a corrupt shard."""

from __future__ import annotations

import pathlib
import random
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _s3 import S3Server, serve_s3
from _shard_files import write_parquet, write_tars

from croupier.client import FILTERED
from croupier.data import Manifest, Retry, ShardChanged, ShardedDataset, ShardError

# NOTE: a real S3-API server (moto) on loopback, started once for the module: with the end-to-end runs in
# make test (its start alone takes seconds), not in make check.
pytestmark = [pytest.mark.e2e, pytest.mark.paired]

FAST = Retry(attempts=3, first_wait_s=0.001, max_wait_s=0.01)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    """The module's S3-API server on loopback."""
    yield from serve_s3()


def _ds(source: object, s3: S3Server, tmp_path: pathlib.Path, **kw: object) -> ShardedDataset:
    return ShardedDataset(source, storage_options=s3.options, cache_dir=tmp_path / "cache",  # type: ignore[arg-type]
                          retry=FAST, **kw)  # type: ignore[arg-type]


def test_sizes_from_the_footers_fetch_no_shard(s3: S3Server, tmp_path: pathlib.Path) -> None:
    sizes = [30, 12, 0, 21]
    urls = s3.put(write_parquet(tmp_path / "d", sizes, row_group=5), "sizes")
    ds = _ds(s3.url("sizes"), s3, tmp_path)
    assert ds.shard_sizes == tuple(sizes)
    assert [s.path for s in ds.manifest.shards] == urls
    assert all(s.etag for s in ds.manifest.shards)  # S3 addresses content by etag
    assert ds.cache.fetches == 0 and ds.cache.held_bytes() == 0  # metadata only: nothing fetched


@pytest.mark.parametrize("kind", ["parquet", "webdataset"])
def test_every_index_reads_its_row(s3: S3Server, tmp_path: pathlib.Path, kind: str) -> None:
    sizes = [9, 17, 4]
    files = write_parquet(tmp_path / "d", sizes, row_group=4) if kind == "parquet" else write_tars(tmp_path / "d", sizes)
    s3.put(files, f"rows-{kind}")
    ds = _ds(f"s3://{s3.bucket}/rows-{kind}/*", s3, tmp_path, transform=lambda row: row["id"])
    order = list(range(len(ds)))
    random.Random(1).shuffle(order)
    assert [ds[i] for i in order] == order
    # each shard fetched once: a parquet file by row group (3, 5 and 1 of 4 rows), a tar whole
    assert ds.cache.fetches == (9 if kind == "parquet" else 3)


def test_the_cache_holds_its_bound_in_bytes(s3: S3Server, tmp_path: pathlib.Path) -> None:
    s3.put(write_parquet(tmp_path / "d", [50] * 6, row_group=10), "bound")
    probe = _ds(s3.url("bound"), s3, tmp_path / "probe")
    shard_bytes = max(s.bytes for s in probe.manifest.shards)
    bound = int(2.5 * shard_bytes)  # two shards fit, three do not
    ds = _ds(probe.manifest, s3, tmp_path, cache_bytes=bound, range_reads=False)
    for i in range(len(ds)):
        assert ds[i]["id"] == i
        assert ds.cache.held_bytes() <= bound
    assert ds.cache.fetches == 6
    ds.close()
    # Every shard read whole (done, to the plan): the least recently used of them out first: shard 4 read again
    # (no fetch), then shard 0 (fetched) evicts shard 5.
    assert ds[4 * 50]["id"] == 200 and ds.cache.fetches == 6
    assert ds[0]["id"] == 0 and ds.cache.fetches == 7
    ds.close()
    assert ds[4 * 50 + 1]["id"] == 201 and ds.cache.fetches == 7
    assert ds[5 * 50]["id"] == 250 and ds.cache.fetches == 8
    with pytest.raises(ValueError, match="smaller than shard"):
        _ds(probe.manifest, s3, tmp_path, cache_bytes=shard_bytes - 1)


def test_prefetch_fetches_in_the_background(s3: S3Server, tmp_path: pathlib.Path) -> None:
    urls = s3.put(write_parquet(tmp_path / "d", [8, 8, 8]), "prefetch")
    ds = _ds(s3.url("prefetch"), s3, tmp_path)
    before = s3.gets(urls[2])
    for f in ds.prefetch([2, 1]):
        f.result(timeout=30)
    assert ds.cache.fetches == 4 and s3.gets(urls[2]) > before  # each shard's two row groups
    got = s3.gets(urls[2])
    assert [ds[i]["id"] for i in range(8, 24)] == list(range(8, 24))
    assert ds.cache.fetches == 4 and s3.gets(urls[2]) == got  # read from the cache: no request
    ds.close()


def test_a_vanished_shard_is_named_or_skipped(s3: S3Server, tmp_path: pathlib.Path) -> None:
    urls = s3.put(write_parquet(tmp_path / "d", [5, 6, 4]), "vanish")
    m = Manifest.build(s3.url("vanish"), storage_options=s3.options)
    s3.fs.rm(urls[1].removeprefix("s3://"))
    ds = _ds(m, s3, tmp_path)
    assert ds[4]["id"] == 4
    with pytest.raises(ShardError) as e:
        ds[5]
    assert urls[1] in str(e.value) and "missing" in str(e.value) and "indices 5 to 10 (6 samples)" in str(e.value)
    skip = _ds(m, s3, tmp_path, on_error="skip")
    got = [skip[i] for i in range(15)]
    assert [g["id"] for g in got[:5] + got[11:]] == [0, 1, 2, 3, 4, 11, 12, 13, 14]
    assert all(g is FILTERED for g in got[5:11])


def test_a_changed_shard_is_refused(s3: S3Server, tmp_path: pathlib.Path) -> None:
    files = write_parquet(tmp_path / "d", [5, 6])
    urls = s3.put(files, "changed")
    m = Manifest.build(s3.url("changed"), storage_options=s3.options)
    running = _ds(m, s3, tmp_path)
    assert running[0]["id"] == 0
    pq.write_table(pa.table({"id": list(range(5, 11)), "text": ["other"] * 6}), files[1])  # other content
    s3.put([files[1]], "changed")
    with pytest.raises(ShardChanged) as e:
        _ds(m, s3, tmp_path)
    msg = str(e.value)
    assert urls[1] in msg and (f"{m.shards[1].bytes} bytes" in msg or f"{m.shards[1].etag!r}" in msg), msg
    with pytest.raises(ShardChanged, match=urls[1]):
        running[5]  # a job already running refuses it when it fetches it


@pytest.mark.parametrize("range_reads", [True, False])
def test_a_corrupt_copy_is_named_and_dropped(s3: S3Server, tmp_path: pathlib.Path, range_reads: bool) -> None:
    urls = s3.put(write_parquet(tmp_path / "d", [6]), f"corrupt-{range_reads}")
    ds = _ds(s3.url(f"corrupt-{range_reads}"), s3, tmp_path, range_reads=range_reads)
    (f,) = ds.prefetch([0])
    f.result(timeout=30)
    key = ds.manifest.shards[0].key
    copy = pathlib.Path(ds.cache.path(f"{key}-0" if range_reads else key))  # row 3: the first row group
    copy.write_bytes(b"\0" * copy.stat().st_size)  # the copy on disk damaged
    with pytest.raises(ShardError, match="corrupt") as e:
        ds[3]
    assert urls[0] in str(e.value) and "indices 0 to 5" in str(e.value)
    assert not copy.exists()  # dropped: the next read fetches it again
    assert ds[3]["id"] == 3
