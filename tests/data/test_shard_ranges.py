"""Reading well from an S3-API server on loopback (tests/_s3.py), counted in the bytes the server sends: a
manifest reads footers only, a partial read of a parquet shard reads its footer and the row groups it needs,
and read-ahead fetches the sampler's next lease before the loop asks for it."""

from __future__ import annotations

import pathlib
import threading
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _s3 import S3Server, serve_s3
from _shard_files import write_parquet

from croupier.client import DistributedBatchSampler
from croupier.data import Manifest, Retry, ShardChanged, ShardedDataset, ShardError
from croupier.data._parquet import FOOTER_GUESS
from croupier.server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.paired]  # the S3-API server takes seconds to start: as tests/data's

FAST = Retry(attempts=3, first_wait_s=0.001, max_wait_s=0.01)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    """The module's S3-API server on loopback."""
    yield from serve_s3()


def _wide(folder: pathlib.Path, sizes: list[int]) -> list[pathlib.Path]:
    """Parquet files of rows of ~300 random bytes of text (which no codec shrinks), 50 rows a row group, each
    row's ``id`` its dataset index: a file of 400 rows is past pyarrow's 64 KiB footer read."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    out, n = [], 0
    for i, size in enumerate(sizes):
        text = rng.integers(97, 123, size=(size, 300), dtype=np.uint8)
        table = pa.table({"id": pa.array(range(n, n + size), pa.int64()), "text": [r.tobytes().decode() for r in text]})
        out.append(folder / f"{i:05d}.parquet")
        pq.write_table(table, out[-1], row_group_size=50)
        n += size
    return out


def _group_bytes(path: pathlib.Path) -> list[int]:
    """Each row group's bytes in the file, from its column chunks (the test's own reading of the footer)."""
    md = pq.read_metadata(path)
    out = []
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        out.append(sum(rg.column(c).total_compressed_size for c in range(rg.num_columns)))
    return out


def _footer_bytes(path: pathlib.Path) -> int:
    """The footer, its length and the closing magic: what a reader that knows nothing else must read."""
    data = path.read_bytes()
    return int.from_bytes(data[-8:-4], "little") + 8


def test_a_manifest_reads_footers_once_a_node(s3: S3Server, tmp_path: pathlib.Path) -> None:
    files = _wide(tmp_path / "d", [400, 400, 400])
    urls = s3.put(files, "footers")
    assert all(f.stat().st_size > 4 * FOOTER_GUESS for f in files)
    Manifest.build(s3.url("footers"), storage_options=s3.options, cache_dir=tmp_path / "node")
    got = [s3.get_bytes(u) for u in urls]
    assert all(_footer_bytes(f) <= g <= FOOTER_GUESS for f, g in zip(files, got)), got  # the file's end alone
    Manifest.build(s3.url("footers"), storage_options=s3.options, cache_dir=tmp_path / "node")
    assert [s3.get_bytes(u) for u in urls] == got  # another process of the node: the footers from its index


def test_a_partial_read_gets_the_footer_and_its_row_groups_only(s3: S3Server, tmp_path: pathlib.Path) -> None:
    (file,) = _wide(tmp_path / "d", [400])
    (url,) = s3.put([file], "partial")
    groups = _group_bytes(file)
    # a manifest carrying no index (as version 1's), none kept on the node: a node reads the footer
    m = Manifest(Manifest.build(s3.url("partial"), storage_options=s3.options).shards)
    ds = ShardedDataset(m, storage_options=s3.options, cache_dir=tmp_path / "a", retry=FAST)
    before, gets = s3.get_bytes(url), s3.gets(url)
    batch = ds.__getitems__(list(range(260, 350)))  # a DataLoader worker's batch: rows of groups 5 and 6
    assert [row["id"] for row in batch] == list(range(260, 350))
    assert s3.gets(url) - gets == 3  # the footer, then each group in one ranged read
    read = s3.get_bytes(url) - before
    assert read <= FOOTER_GUESS + groups[5] + groups[6] and read < file.stat().st_size / 2, (read, groups)
    # A resume on another node (an empty cache) needs the epoch's last rows: the footer and two groups.
    other = ShardedDataset(m, storage_options=s3.options, cache_dir=tmp_path / "b", retry=FAST)
    before = s3.get_bytes(url)
    assert [other[i]["id"] for i in range(300, 400)] == list(range(300, 400))
    read = s3.get_bytes(url) - before
    assert read <= FOOTER_GUESS + groups[6] + groups[7] and read < file.stat().st_size / 2, (read, groups)
    # Row groups read again come from the cache.
    before = s3.get_bytes(url)
    ds.close()
    assert [ds[i]["id"] for i in range(260, 350)] == list(range(260, 350)) and s3.get_bytes(url) == before


def test_a_garbled_row_group_with_page_checksums_is_named_corrupt(s3: S3Server, tmp_path: pathlib.Path) -> None:
    """A range carries no checksum of the store's: parquet's page checksums catch a row group garbled in the
    cache (or in transit), which is named and dropped, never read as other text."""
    folder = tmp_path / "d"
    folder.mkdir()
    table = pa.table({"id": pa.array(range(40), pa.int64()), "text": [f"row {i} " * 20 for i in range(40)]})
    pq.write_table(table, folder / "00000.parquet", row_group_size=10, write_page_checksum=True,
                   compression="none", use_dictionary=False)
    (url,) = s3.put([folder / "00000.parquet"], "checksums")
    ds = ShardedDataset(s3.url("checksums"), storage_options=s3.options, cache_dir=tmp_path / "node", retry=FAST)
    for f in ds.read_ahead([15]):
        f.result(timeout=30)
    copy = pathlib.Path(ds.cache.path(f"{ds.manifest.shards[0].key}-1"))  # row 15: the second row group
    data = bytearray(copy.read_bytes())
    at = data.rindex(b"row 1")  # a byte of the text, not of a page header
    data[at] ^= 0x01
    copy.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="corrupt") as e:
        ds[15]
    assert url in str(e.value) and not copy.exists()
    assert ds[5]["id"] == 5  # the shard's other groups read on


def test_read_ahead_fetches_what_the_indices_need(s3: S3Server, tmp_path: pathlib.Path) -> None:
    s3.put(write_parquet(tmp_path / "d", [40, 40, 40], row_group=10), "ahead")
    ds = ShardedDataset(s3.url("ahead"), storage_options=s3.options, cache_dir=tmp_path / "node", retry=FAST)
    wanted = [95, 3, 97, 41]  # shard 2's group 1, shard 0's group 0, shard 1's group 0
    futures = ds.read_ahead(wanted)
    assert len(futures) == 3  # one a shard, in the order of their first index
    for f in futures:
        f.result(timeout=30)
    assert ds.cache.fetches == 3
    before = s3.get_bytes()
    assert [ds[i]["id"] for i in wanted] == wanted and s3.get_bytes() == before  # all in the cache
    assert ds[60]["id"] == 60 and s3.get_bytes() > before  # a group no index named: fetched when read
    with pytest.raises(IndexError, match="read_ahead: dataset index 120 is not in"):
        ds.read_ahead([0, 120])
    ds.close()


def test_the_sampler_hands_its_next_lease_to_read_ahead(s3: S3Server, server: Server, tmp_path: pathlib.Path) -> None:
    """The sampler tells read_ahead its next lease before the loop takes it; the lease's row groups are in the
    node's cache before the loop reads them (no request reaches the store then)."""
    s3.put(write_parquet(tmp_path / "d", [40] * 6, row_group=10), "lease")
    ds = ShardedDataset(s3.url("lease"), storage_options=s3.options, cache_dir=tmp_path / "node", retry=FAST)
    sampler = DistributedBatchSampler(ds, 8, num_replicas=1, rank=0, address=server.address, job="read-ahead",
                                      shard_sizes=ds.shard_sizes, shard_window=2, lanes=2, reader_group=1,
                                      lease_ahead=1, prefetch=2)
    told: list[list[int]] = []
    fetched: list[threading.Event] = []
    second = threading.Event()

    def read_ahead(idx: np.ndarray) -> None:
        told.append(idx.tolist())
        done = threading.Event()
        fetched.append(done)
        futures = ds.read_ahead(idx) if len(told) <= 2 else []  # the later leases' fetches would race the count
        threading.Thread(target=lambda: ([f.exception() for f in futures], done.set()), daemon=True).start()
        if len(told) == 2:
            second.set()

    sampler.read_ahead = read_ahead
    it = iter(sampler)
    assert next(it) == told[0]  # the loop takes batch 0: its lease was told first
    assert second.wait(30), "the next lease was not handed to read_ahead ahead of the loop"
    assert fetched[0].wait(30) and fetched[1].wait(30)
    before = s3.get_bytes()
    batch = next(it)
    assert batch == told[1]
    assert [ds[i]["id"] for i in batch] == batch
    assert s3.get_bytes() == before  # every row of the next batch was in the cache before it was asked for
    sampler.close()
    ds.close()


def test_reads_are_conditional_on_the_etag(s3: S3Server, tmp_path: pathlib.Path) -> None:
    """A store that takes a condition (S3's If-Match) is asked the reads alone: a footer and a row group cost one
    request each, no stat before them (what a resumed rank's first batch waits on); a row group of a shard that
    changed after its footer was read is refused by the store, and the shard named."""
    files = write_parquet(tmp_path / "d", [40, 40], row_group=10)
    urls = s3.put(files, "conditional")
    m = Manifest(Manifest.build(urls, storage_options=s3.options).shards)  # carrying no index: footers read
    ds = ShardedDataset(m, storage_options=s3.options, cache_dir=tmp_path / "node", retry=FAST, verify=False)
    stats: list[str] = []
    real = ds._storage.stat
    ds._storage.stat = lambda url, fresh=True: (stats.append(url), real(url, fresh))[1]  # type: ignore[method-assign]
    gets = [s3.gets(u) for u in urls]
    assert [r["id"] for r in ds.__getitems__([3, 45, 47])] == [3, 45, 47]
    assert stats == [] and [s3.gets(u) - g for u, g in zip(urls, gets)] == [2, 2]  # a footer and a group each
    pq.write_table(pa.table({"id": list(range(40, 80)), "text": ["other"] * 40}), files[1], row_group_size=10)
    s3.put([files[1]], "conditional")  # shard 1 changes under the running job
    with pytest.raises(ShardChanged, match=f"shard {urls[1]} changed since the manifest recorded it"):
        ds[75]  # another of its row groups
    ds.close()
