"""The manifest kept for a dataset (data/_manifest.py's `Manifest.find_or_build`), on local files: found beside the
data or in the node's cache, a fresh node reads no footer, a changed folder builds it again, a place that takes no
write keeps the old behaviour, and the manifest's JSON carries each parquet shard's index (version 1 still read)."""

from __future__ import annotations

import gzip
import json
import os
import pathlib
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _shard_files import write_parquet, write_tars

from croupier.data import Manifest, ShardChanged, ShardedDataset
from croupier.data._manifest import KEPT_NAME
from croupier.data._parquet import Parquet


def _kept(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(folder.glob(KEPT_NAME.format(key="*")))


@pytest.fixture
def footers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the parquet files whose footer is read (each call of the format's index), in order."""
    read: list[int] = []
    real = Parquet.index

    def counted(self: Parquet, f: IO[bytes]) -> dict[str, Any]:
        read.append(f.seek(0, os.SEEK_END))
        return real(self, f)

    monkeypatch.setattr(Parquet, "index", counted)
    return read


def test_a_fresh_node_finds_the_manifest_beside_the_data_and_reads_no_footer(tmp_path: pathlib.Path,
                                                                             footers: list[int]) -> None:
    files = write_parquet(tmp_path / "d", [7, 5, 9], row_group=3)
    first = ShardedDataset(tmp_path / "d", cache_dir=tmp_path / "node-a")
    assert len(footers) == 3
    (kept,) = _kept(tmp_path / "d")
    doc = json.loads(gzip.decompress(kept.read_bytes()))
    assert doc["version"] == 2 and [s["index"]["row_groups"] for s in doc["shards"]] == [[3, 3, 1], [3, 2], [3, 3, 3]]
    assert list((tmp_path / "node-a" / "manifest").glob("*.json.gz"))  # and on the node
    fresh = ShardedDataset(tmp_path / "d", cache_dir=tmp_path / "node-b")  # another node: nothing of its own
    assert len(footers) == 3  # no footer read: the manifest found beside the data
    assert fresh.manifest == first.manifest and fresh.manifest.indices == first.manifest.indices
    assert [fresh[i]["id"] for i in range(21)] == list(range(21))
    assert list((tmp_path / "node-b" / "manifest").glob("*.json.gz"))  # kept on that node too
    kept.unlink()
    ShardedDataset(tmp_path / "d", cache_dir=tmp_path / "node-b")  # the node's own copy
    assert len(footers) == 3 and not _kept(tmp_path / "d")
    # the kept manifest is never a shard, even for a glob that matches it
    ShardedDataset(str(tmp_path / "d" / "*"), cache_dir=tmp_path / "node-c")
    glob = ShardedDataset(str(tmp_path / "d" / "*"), cache_dir=tmp_path / "node-d")
    assert glob.shard_sizes == (7, 5, 9) and [s.path for s in glob.manifest.shards] == [str(f) for f in files]


def test_a_changed_folder_builds_it_again_reading_only_what_changed(tmp_path: pathlib.Path,
                                                                    footers: list[int]) -> None:
    files = write_parquet(tmp_path / "d", [4, 4, 4], row_group=2)
    ShardedDataset(tmp_path / "d", cache_dir=tmp_path / "node-a")
    pq.write_table(pa.table({"id": list(range(4, 10)), "text": ["new"] * 6}), files[1], row_group_size=2)
    del footers[:]
    ds = ShardedDataset(tmp_path / "d", cache_dir=tmp_path / "node-b")  # a fresh node, after the change
    assert ds.shard_sizes == (4, 6, 4) and [ds[i]["id"] for i in range(4, 10)] == list(range(4, 10))
    assert footers == [files[1].stat().st_size]  # the others' indices from the stale manifest
    (kept,) = _kept(tmp_path / "d")  # replaced, one file still
    assert Manifest.from_json(gzip.decompress(kept.read_bytes()).decode()).sizes == (4, 6, 4)


def test_a_shard_that_changes_under_a_job_is_still_refused(tmp_path: pathlib.Path) -> None:
    files = write_parquet(tmp_path / "d", [5, 6])
    ShardedDataset(tmp_path / "d", cache_dir=tmp_path / "node-a")
    running = ShardedDataset(tmp_path / "d", cache_dir=tmp_path / "node-b")  # from the kept manifest
    pq.write_table(pa.table({"id": list(range(5, 14))}), files[1])
    with pytest.raises(ShardChanged, match=str(files[1])):
        running[5]


def test_where_nothing_can_be_written_it_is_built_as_before(tmp_path: pathlib.Path, footers: list[int]) -> None:
    write_parquet(tmp_path / "d", [3, 3])
    Manifest.find_or_build(tmp_path / "d", beside=True)  # to learn the kept file's name
    (kept,) = _kept(tmp_path / "d")
    kept.unlink()
    kept.mkdir()  # a folder in its place: nothing written there
    (tmp_path / "node").mkdir()
    (tmp_path / "node" / "manifest").write_text("")  # a file in place of the node's folder of manifests
    del footers[:]
    ds = ShardedDataset(tmp_path / "d", cache_dir=tmp_path / "node")
    assert [ds[i]["id"] for i in range(6)] == list(range(6)) and len(footers) == 2
    assert kept.is_dir() and not list(kept.iterdir()) and (tmp_path / "node" / "manifest").read_text() == ""
    assert not list(tmp_path.rglob("*.tmp"))
    ShardedDataset(tmp_path / "d", cache_dir=tmp_path / "other")
    assert len(footers) == 4  # nothing kept where another node looks: read again, as before


def test_beside_false_writes_nothing_beside_the_data(tmp_path: pathlib.Path) -> None:
    write_parquet(tmp_path / "d", [3])
    m = Manifest.find_or_build(tmp_path / "d", cache_dir=tmp_path / "node", beside=False)
    assert m.sizes == (3,) and not _kept(tmp_path / "d") and list((tmp_path / "node" / "manifest").glob("*.gz"))


def test_the_json_carries_parquet_indices_and_reads_version_1(tmp_path: pathlib.Path) -> None:
    write_parquet(tmp_path / "p", [5, 6], row_group=4)
    write_tars(tmp_path / "t", [3])
    m = Manifest.build(tmp_path / "p")
    again = Manifest.from_json(m.to_json())
    assert again == m and again.indices == m.indices and m.index(0) is not None and m.index(0)["samples"] == 5
    assert Manifest.build(tmp_path / "t").indices == (None,)  # a tar is fetched whole: its index stays on the node
    old = json.loads(m.to_json())
    old["version"] = 1
    for s in old["shards"]:
        del s["index"]
    v1 = Manifest.from_json(json.dumps(old))
    assert v1 == m and v1.indices is None and v1.fingerprint == m.fingerprint
    assert [ShardedDataset(v1, cache_dir=tmp_path / "c")[i]["id"] for i in range(11)] == list(range(11))
    bad = json.loads(m.to_json())
    bad["shards"][1]["index"]["samples"] = 7
    with pytest.raises(ValueError, match="shard 1's index must name its pieces and its 6 samples"):
        Manifest.from_json(json.dumps(bad))
    bad["version"] = 3
    with pytest.raises(ValueError, match=r"version 1 or 2 \(got version=3\)"):
        Manifest.from_json(json.dumps(bad))


#: A manifest as version 1 wrote it (before manifests carried indices): still read, its fingerprint unchanged.
_V1 = """{
 "shards": [
  {"bytes": 1551, "etag": "5d1b0b7f0fd1c7a3e1f6e0e3a1c2b9d4", "format": "parquet", "mtime": 1765000000.5,
   "path": "s3://bucket/train/000.parquet", "samples": 10}
 ],
 "version": 1
}"""


def test_a_manifest_of_version_1_still_loads() -> None:
    m = Manifest.from_json(_V1)
    assert m.indices is None and m.index(0) is None and m.sizes == (10,)
    assert m.shards[0].etag == "5d1b0b7f0fd1c7a3e1f6e0e3a1c2b9d4" and m.shards[0].mtime == 1765000000.5
    assert m.fingerprint == "ca4f91848b6bce18"  # as version 1 named it
    assert json.loads(m.to_json())["version"] == 2 and Manifest.from_json(m.to_json()) == m
