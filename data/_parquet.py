"""Parquet shards: the sample count and row groups from the footer, rows read a row group at a time."""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

#: Decoded row groups one open shard keeps in memory, in bytes (at least the one being read).
DECODED_BYTES = 256 * 2**20


class Parquet:
    """A parquet file is one shard; its rows are its samples, each a dict of column name to Python value.

    NOTE: the file, not the row group, is the shard: it is what the store addresses (its size and etag in
    the manifest), what the shard order deals from, and what the cache fetches in one piece. Its row
    groups are the unit of decoding: a read decodes the row's whole group and keeps it for the next rows
    (up to DECODED_BYTES of them per open shard), so rows read in any order within a shard decode each
    group about once.
    """

    name: str = "parquet"
    suffixes: tuple[str, ...] = (".parquet", ".pq")

    def index(self, f: IO[bytes]) -> dict[str, Any]:
        """The rows of each row group, from the footer alone."""
        md = pq.read_metadata(f)
        groups = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
        return {"samples": md.num_rows, "row_groups": groups}

    def open(self, path: str, index: dict[str, Any] | None, decode: bool) -> ParquetReader:
        """A reader of the local parquet file `path` (`decode` changes nothing: rows are Python values)."""
        return ParquetReader(path, index)


class ParquetReader:
    """Rows of one local parquet file, their row groups decoded on first use and kept (least recently used
    out first) up to DECODED_BYTES."""

    def __init__(self, path: str, index: dict[str, Any] | None) -> None:
        self._file = pa.memory_map(path)
        try:
            self._pf = pq.ParquetFile(self._file)
            md = self._pf.metadata
            groups = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
            if index is not None and list(index["row_groups"]) != groups:
                raise ValueError(f"its row groups hold {groups} rows, its index says {index['row_groups']}")
        except BaseException:
            self._file.close()
            raise
        self._starts = list(itertools.accumulate(groups, initial=0))  # (groups + 1,)
        self._groups: OrderedDict[int, pa.Table] = OrderedDict()
        self._bytes = 0

    def row(self, r: int) -> Any:
        """Row `r` as a dict of column name to Python value."""
        if not 0 <= r < self._starts[-1]:
            raise IndexError(f"row {r} is not in [0, {self._starts[-1]})")
        g = bisect.bisect_right(self._starts, r) - 1
        table = self._groups.get(g)
        if table is None:
            table = self._pf.read_row_group(g)
            self._groups[g] = table
            self._bytes += table.nbytes
            while self._bytes > DECODED_BYTES and len(self._groups) > 1:
                self._bytes -= self._groups.popitem(last=False)[1].nbytes
        else:
            self._groups.move_to_end(g)
        return table.slice(r - self._starts[g], 1).to_pylist()[0]

    def close(self) -> None:
        """Closes the file (the decoded groups go with the reader)."""
        self._groups.clear()
        self._file.close()
