"""The manifest kept beside a dataset in object storage (tests/_s3.py's S3-API server on loopback, which counts each
object's GETs and bytes): a fresh process on a fresh node reads the manifest once and no footer, and a shard that
changed is still refused, by name."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _s3 import S3Server, serve_s3
from _shard_files import write_parquet

from croupier.data import Retry, ShardChanged, ShardedDataset
from croupier.data._manifest import KEPT_NAME

pytestmark = [pytest.mark.e2e, pytest.mark.paired]  # the S3-API server takes seconds to start: as tests/data's

FAST = Retry(attempts=3, first_wait_s=0.001, max_wait_s=0.01)

#: A fresh process: opens the dataset at argv[1] with the options argv[2] and the cache folder argv[3], reads
#: the dataset indices argv[4], prints their ids.
_FRESH = """
import json, sys
from croupier.data import Retry, ShardedDataset
ds = ShardedDataset(sys.argv[1], storage_options=json.loads(sys.argv[2]), cache_dir=sys.argv[3],
                    retry=Retry(attempts=3, first_wait_s=0.001, max_wait_s=0.01))
print(json.dumps([row["id"] for row in ds.__getitems__(json.loads(sys.argv[4]))]))
"""


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    """The module's S3-API server on loopback."""
    yield from serve_s3()


def _kept_url(s3: S3Server, prefix: str) -> str:
    (key,) = [p for p in s3.fs.ls(f"{s3.bucket}/{prefix}") if p.rsplit("/", 1)[-1].startswith("_croupier-manifest-")]
    assert key.endswith(KEPT_NAME.rsplit("}", 1)[-1])
    return f"s3://{key}"


def test_a_fresh_process_reads_the_kept_manifest_once_and_no_footer(s3: S3Server, tmp_path: pathlib.Path) -> None:
    urls = s3.put(write_parquet(tmp_path / "d", [12, 12, 12, 12], row_group=4), "fresh")
    first = ShardedDataset(s3.url("fresh"), storage_options=s3.options, cache_dir=tmp_path / "node-a", retry=FAST)
    assert [s3.gets(u) for u in urls] == [1, 1, 1, 1]  # building it: each footer once
    kept = _kept_url(s3, "fresh")
    assert s3.gets(kept) == 0
    wanted = [5, 13, 28, 29, 47]  # row group 1 of shard 0, 0 of shard 1, 1 of shard 2, 2 of shard 3
    ranges = [first.manifest.index(s)["ranges"][g] for s, g in ((0, 1), (1, 0), (2, 1), (3, 2))]  # type: ignore[index]
    gets, sent = [s3.gets(u) for u in urls], [s3.get_bytes(u) for u in urls]
    out = subprocess.run([sys.executable, "-c", _FRESH, s3.url("fresh"), json.dumps(s3.options),
                          str(tmp_path / "node-b"), json.dumps(wanted)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == wanted
    assert s3.gets(kept) == 1  # the manifest in one read
    # each shard: one ranged GET of the row group its row lies in, of exactly that group's bytes; no footer
    assert [s3.gets(u) - g for u, g in zip(urls, gets)] == [1, 1, 1, 1]
    assert [s3.get_bytes(u) - b for u, b in zip(urls, sent)] == [end - start for start, end in ranges]


def test_a_shard_changed_since_the_manifest_was_kept_is_refused(s3: S3Server, tmp_path: pathlib.Path) -> None:
    files = write_parquet(tmp_path / "d", [8, 8, 8], row_group=4)
    urls = s3.put(files, "changed")
    ShardedDataset(s3.url("changed"), storage_options=s3.options, cache_dir=tmp_path / "node-a", retry=FAST)
    running = ShardedDataset(s3.url("changed"), storage_options=s3.options, cache_dir=tmp_path / "node-b", retry=FAST)
    assert running[0]["id"] == 0
    size = files[1].stat().st_size
    pq.write_table(pa.table({"id": list(range(8, 16)), "text": [f"wor {i}" for i in range(8, 16)]}), files[1],
                   row_group_size=4)
    assert files[1].stat().st_size == size  # the same size: the etag alone tells
    s3.put([files[1]], "changed")
    with pytest.raises(ShardChanged, match=f"shard {urls[1]} changed since the manifest recorded it"):
        running[9]  # its index from the manifest, its read refused by the store (If-Match)
    # a node that opens the dataset now finds the kept manifest stale: built again, reading the changed footer only
    gets = [s3.gets(u) for u in urls]
    now = ShardedDataset(s3.url("changed"), storage_options=s3.options, cache_dir=tmp_path / "node-c", retry=FAST)
    assert [s3.gets(u) - g for u, g in zip(urls, gets)] == [0, 1, 0]
    assert [now[i]["text"] for i in (7, 8, 16)] == ["row 7", "wor 8", "row 16"]
