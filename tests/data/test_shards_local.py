"""croupier.data on local files: sizes from the metadata, every index its row, the manifest, errors named."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _shard_files import write_parquet, write_tars

from croupier.client import FILTERED
from croupier.data import Manifest, ShardChanged, ShardedDataset, ShardError

SIZES = [10, 25, 0, 7, 13]


def _ds(source: object, tmp_path: pathlib.Path, **kw: object) -> ShardedDataset:
    return ShardedDataset(source, cache_dir=tmp_path / "cache", **kw)  # type: ignore[arg-type]


def test_parquet_sizes_come_from_the_footers(tmp_path: pathlib.Path) -> None:
    files = write_parquet(tmp_path / "d", SIZES, row_group=4)
    ds = _ds(tmp_path / "d", tmp_path)
    assert ds.shard_sizes == tuple(SIZES) == tuple(pq.read_metadata(f).num_rows for f in files)
    assert len(ds) == sum(SIZES) and ds.offsets == (0, 10, 35, 35, 42, 55)
    assert [s.path for s in ds.manifest.shards] == [str(f) for f in files]  # the folder's files, sorted
    assert [s.bytes for s in ds.manifest.shards] == [f.stat().st_size for f in files]


def test_sizes_read_no_data(tmp_path: pathlib.Path) -> None:
    """A file whose data pages are garbage but whose footer is whole: its size is read all the same (the
    footer alone is read), and its rows fail only when read."""
    (f,) = write_parquet(tmp_path / "d", [40], row_group=10)
    raw = bytearray(f.read_bytes())
    footer = int.from_bytes(raw[-8:-4], "little") + 8
    raw[8:len(raw) - footer - 8] = os.urandom(len(raw) - footer - 16)
    f.write_bytes(bytes(raw))
    ds = _ds(tmp_path / "d", tmp_path)
    assert ds.shard_sizes == (40,)
    with pytest.raises(ShardError, match="corrupt"):
        ds[0]


@pytest.mark.parametrize("kind", ["parquet", "webdataset"])
def test_every_index_reads_its_row(tmp_path: pathlib.Path, kind: str) -> None:
    if kind == "parquet":
        write_parquet(tmp_path / "d", SIZES, row_group=3)
    else:
        write_tars(tmp_path / "d", SIZES)
    ds = _ds(str(tmp_path / "d") + "/*", tmp_path, transform=lambda s: s["id"])
    order = list(range(len(ds)))
    random.Random(0).shuffle(order)
    assert [ds[i] for i in order] == order
    assert ds.shard_of(35) == (3, 0) and ds.indices(1) == range(10, 35)
    with pytest.raises(IndexError, match="55"):
        ds[55]


def test_a_tar_sample_is_its_members_decoded(tmp_path: pathlib.Path) -> None:
    write_tars(tmp_path / "d", [3])
    ds = _ds(tmp_path / "d", tmp_path)
    assert ds[2] == {"__key__": "part/00000002", "id": 2, "txt": "text 2", "json": {"n": 2}}
    raw = _ds(tmp_path / "d", tmp_path, decode=False)
    assert raw[2]["txt"] == b"text 2"
    index = list((tmp_path / "cache" / "index").glob("*.json"))
    assert len(index) == 1 and json.loads(index[0].read_text())["samples"] == 3  # built once, kept by content


def test_a_list_keeps_its_order_and_a_dataset_pickles(tmp_path: pathlib.Path) -> None:
    files = write_parquet(tmp_path / "d", [5, 6])
    ds = _ds([str(files[1]), str(files[0])], tmp_path)
    assert ds.shard_sizes == (6, 5)
    assert ds[0]["id"] == 5 and ds[6]["id"] == 0
    copy = pickle.loads(pickle.dumps(ds))
    assert [copy[i]["id"] for i in range(11)] == [ds[i]["id"] for i in range(11)]


def test_the_manifest_saves_loads_and_refuses_a_changed_shard(tmp_path: pathlib.Path) -> None:
    files = write_parquet(tmp_path / "d", [5, 6])
    m = Manifest.build(tmp_path / "d")
    m.save(tmp_path / "m.json")
    assert Manifest.load(tmp_path / "m.json") == m and m.sizes == (5, 6)
    assert _ds(Manifest.load(tmp_path / "m.json"), tmp_path)[7]["id"] == 7
    pq.write_table(pa.table({"id": list(range(5, 14))}), files[1])  # shard 1 rewritten: other rows, other size
    with pytest.raises(ShardChanged) as e:
        _ds(m, tmp_path)
    assert str(files[1]) in str(e.value) and f"{m.shards[1].bytes} bytes" in str(e.value)
    assert f"{files[1].stat().st_size} bytes" in str(e.value)
    assert isinstance(e.value, ValueError)
    ds = _ds(m, tmp_path, verify=False)  # not checked at once: refused when the shard is opened
    assert ds[0]["id"] == 0
    with pytest.raises(ShardChanged, match=str(files[1])):
        ds[5]


def test_a_manifest_of_another_version_is_refused(tmp_path: pathlib.Path) -> None:
    write_parquet(tmp_path / "d", [5])
    doc = json.loads(Manifest.build(tmp_path / "d").to_json())
    doc["version"] = 99
    with pytest.raises(ValueError, match="version=99"):
        Manifest.from_json(json.dumps(doc))


def test_a_vanished_shard_is_named_or_skipped(tmp_path: pathlib.Path) -> None:
    files = write_parquet(tmp_path / "d", [5, 6, 4])
    m = Manifest.build(tmp_path / "d")
    files[1].unlink()
    with pytest.raises(ShardError) as e:
        _ds(m, tmp_path)[7]
    assert str(files[1]) in str(e.value) and "missing" in str(e.value) and "indices 5 to 10 (6 samples)" in str(e.value)
    assert e.value.reason == "missing" and e.value.indices == range(5, 11)
    ds = _ds(m, tmp_path, on_error="skip")
    got = [ds[i] for i in range(15)]
    assert [g["id"] for g in got[:5] + got[11:]] == [0, 1, 2, 3, 4, 11, 12, 13, 14]
    assert all(g is FILTERED for g in got[5:11])


def test_a_file_of_no_format_is_refused(tmp_path: pathlib.Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.csv").write_text("id\n1\n")
    with pytest.raises(FileNotFoundError, match="no shards in"):
        _ds(tmp_path / "d", tmp_path)  # a folder's shards are its files of a format
    with pytest.raises(ValueError, match="a.csv"):
        _ds(str(tmp_path / "d" / "*"), tmp_path)  # a glob's are every match
    write_parquet(tmp_path / "d", [3])
    (tmp_path / "d" / "_SUCCESS").write_text("")
    assert _ds(tmp_path / "d", tmp_path).shard_sizes == (3,)
    (tmp_path / "d" / "a.csv").rename(tmp_path / "d" / "a.parquet")
    with pytest.raises(ValueError, match="not a parquet file"):
        _ds(tmp_path / "d", tmp_path)
    with pytest.raises(ValueError, match="on_error"):
        _ds(tmp_path / "d", tmp_path, on_error="ignore")


def test_a_row_group_at_a_time(tmp_path: pathlib.Path) -> None:
    """A parquet file of several row groups: rows read across them in any order (groups decoded on demand)."""
    folder = tmp_path / "d"
    folder.mkdir()
    table = pa.table({"id": list(range(100)), "blob": [bytes([i]) * 100 for i in range(100)]})
    pq.write_table(table, folder / "a.parquet", row_group_size=7)
    ds = _ds(folder, tmp_path)
    assert [ds[i]["blob"] for i in (99, 0, 50, 6, 7)] == [bytes([i]) * 100 for i in (99, 0, 50, 6, 7)]
