"""Parquet shards: the sample count and row groups from the footer, rows read a row group at a time."""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

#: Decoded row groups a process keeps in memory, over all its open shards, in bytes (of their arrow form).
DECODED_BYTES = 256 * 2**20


class _Decoded:
    """The row groups a process decoded, as lists of rows, least recently used out first past DECODED_BYTES.

    NOTE: one budget for the process, not one per open shard: a shard order reads a few hundred shards in
    turn (a window of each reading head), and a rank's reads hop between them from one batch to the next.
    """

    def __init__(self) -> None:
        self.groups: OrderedDict[tuple[int, int], tuple[list[Any], int]] = OrderedDict()
        self.bytes = 0

    def get(self, key: tuple[int, int]) -> list[Any] | None:
        hit = self.groups.get(key)
        if hit is None:
            return None
        self.groups.move_to_end(key)
        return hit[0]

    def put(self, key: tuple[int, int], rows: list[Any], nbytes: int) -> None:
        self.groups[key] = (rows, nbytes)
        self.bytes += nbytes
        while self.bytes > DECODED_BYTES and len(self.groups) > 1:
            self.bytes -= self.groups.popitem(last=False)[1][1]

    def drop(self, reader: int) -> None:
        for key in [k for k in self.groups if k[0] == reader]:
            self.bytes -= self.groups.pop(key)[1]


_DECODED = _Decoded()
#: Names each reader in the decoded groups (never reused, unlike ``id``).
_SERIAL = itertools.count()


class Parquet:
    """A parquet file is one shard; its rows are its samples, each a dict of column name to Python value.

    NOTE: the file, not the row group, is the shard: it is what the store addresses (its size and etag in
    the manifest), what the shard order deals from, and what the cache fetches in one piece. Its row
    groups are the unit of decoding: a read decodes the row's whole group into Python rows and keeps them
    for the next rows (up to DECODED_BYTES of groups in a process), so rows read in any order within a
    shard decode each group about once.
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
        self._serial = next(_SERIAL)

    def row(self, r: int) -> Any:
        """Row `r` as a dict of column name to Python value."""
        if not 0 <= r < self._starts[-1]:
            raise IndexError(f"row {r} is not in [0, {self._starts[-1]})")
        g = bisect.bisect_right(self._starts, r) - 1
        rows = _DECODED.get((self._serial, g))
        if rows is None:
            table = self._pf.read_row_group(g)
            rows = table.to_pylist()
            _DECODED.put((self._serial, g), rows, table.nbytes)
        return rows[r - self._starts[g]]

    def close(self) -> None:
        """Closes the file (its decoded groups go with it)."""
        _DECODED.drop(self._serial)
        self._file.close()
