"""`croupier data inspect`: a dataset's shards, rows and bytes, the shard sizes a job's spec takes, its manifest."""

from __future__ import annotations

import pathlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from croupier.data import Manifest
from croupier.tools.cli import main
from croupier.tools.data import sizes_summary


def _shards(folder: pathlib.Path, sizes: list[int]) -> list[pathlib.Path]:
    folder.mkdir()
    out, n = [], 0
    for i, size in enumerate(sizes):
        path = folder / f"{i:03d}.parquet"
        pq.write_table(pa.table({"id": list(range(n, n + size))}), path, row_group_size=4)
        out.append(path)
        n += size
    return out


def test_inspect_prints_shards_rows_bytes_and_the_spec(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = _shards(tmp_path / "d", [10, 25, 7])
    assert main(["data", "inspect", str(tmp_path / "d"), "--save-manifest", str(tmp_path / "m.json")]) == 0
    out = capsys.readouterr().out
    total = sum(f.stat().st_size for f in files)
    assert f"3 shards, 42 rows, {total:,} bytes (parquet)" in out
    assert f"     1         25 {files[1].stat().st_size:>14,}           10  {files[1]}" in out
    assert "spec: n=42, shard_sizes=[10, 25, 7]" in out
    m = Manifest.load(tmp_path / "m.json")
    assert m.sizes == (10, 25, 7) and m.fingerprint in out
    assert main(["data", "inspect", str(tmp_path / "m.json")]) == 0  # a manifest reads as the shards it names
    assert "spec: n=42, shard_sizes=[10, 25, 7]" in capsys.readouterr().out


def test_inspect_names_what_is_not_there(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "inspect", str(tmp_path / "none")]) == 2
    assert str(tmp_path / "none") in capsys.readouterr().err


def test_sizes_summary() -> None:
    assert sizes_summary((3, 4)) == "[3, 4]"
    assert sizes_summary((500,) * 64) == "[500] * 64"
    assert sizes_summary(tuple(range(1, 11))) == "10 shards: min 1, median 5.5, max 10"
