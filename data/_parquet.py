"""Parquet shards: the sample count, row groups and their byte ranges from the footer, rows read a row group at
a time (from a local file, or from row groups fetched apart)."""

from __future__ import annotations

import base64
import bisect
import itertools
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from croupier.data._index import Pieces

#: Decoded row groups a process keeps in memory, over all its open shards, in bytes (of their arrow form).
DECODED_BYTES = 256 * 2**20
#: Bytes read from a file's end first to find its footer (a footer longer than this costs a second read).
FOOTER_GUESS = 16 * 2**10
_MAGIC = b"PAR1"


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
    ranged: bool = True

    def index(self, f: IO[bytes]) -> dict[str, Any]:
        """The rows and byte range of each row group, and the footer itself (base64), read from the end of `f`
        alone: its last FOOTER_GUESS bytes (one read), and the rest of a longer footer (a second)."""
        size = f.seek(0, os.SEEK_END)
        if size < 12:
            raise ValueError(f"{size} bytes is too short for a parquet file")
        f.seek(size - min(size, FOOTER_GUESS))
        tail = f.read(min(size, FOOTER_GUESS))
        if tail[-4:] != _MAGIC:
            raise ValueError(f"its last 4 bytes are {tail[-4:]!r}, not parquet's {_MAGIC!r}")
        length = int.from_bytes(tail[-8:-4], "little") + 8
        if length + 4 > size:
            raise ValueError(f"its footer of {length - 8} bytes does not fit in its {size} bytes")
        if length > len(tail):
            f.seek(size - length)
            tail = f.read(length - len(tail)) + tail
        footer = tail[-length:]
        md = pq.read_metadata(pa.BufferReader(footer))
        groups = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
        return {"samples": md.num_rows, "row_groups": groups, "ranges": _ranges(md),
                "footer": base64.b64encode(footer).decode()}

    def open(self, path: str, index: dict[str, Any] | None, decode: bool) -> ParquetReader:
        """A reader of the local parquet file `path` (`decode` changes nothing: rows are Python values)."""
        return ParquetReader(path, index)

    def pieces(self, index: dict[str, Any]) -> Pieces | None:
        """The row groups, read apart; None for an index without their byte ranges (kept by an older release)."""
        if "ranges" not in index or "footer" not in index:
            return None
        return Pieces(tuple(itertools.accumulate(index["row_groups"], initial=0)),
                      tuple((int(a), int(b)) for a, b in index["ranges"]))

    def open_pieces(self, index: dict[str, Any], size: int, read_piece: Callable[[int], bytes],
                    decode: bool) -> RangedReader:
        """A reader of the shard of `size` bytes whose row group g's bytes ``read_piece(g)`` gives (`decode`: as
        :meth:`open`)."""
        return RangedReader(index, size, read_piece)


def _ranges(md: pq.FileMetaData) -> list[list[int]]:
    """Each row group's bytes in the file, [start, end): from its first column chunk's first page (its
    dictionary page, if any) to its last chunk's end."""
    out = []
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        lo, hi = None, 0
        for c in range(rg.num_columns):
            cc = rg.column(c)
            start = cc.dictionary_page_offset if cc.has_dictionary_page and cc.dictionary_page_offset else \
                cc.data_page_offset
            lo = start if lo is None else min(lo, start)
            hi = max(hi, start + cc.total_compressed_size)
        out.append([lo or 0, hi])
    return out


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


class _At:
    """A read-only file of `size` bytes of which only ``[base, base + len(data))`` is at hand: what pyarrow reads
    a row group through (it reads that group's column chunks only, at their offsets in the whole file)."""

    def __init__(self, data: bytes, base: int, size: int) -> None:
        self._data, self._base, self._size, self._pos = memoryview(data), base, size, 0
        self.closed = False

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._pos = offset + (0 if whence == os.SEEK_SET else self._pos if whence == os.SEEK_CUR else self._size)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self._size - self._pos
        lo = self._pos - self._base
        if lo < 0 or lo + n > len(self._data):
            raise OSError(f"read of bytes [{self._pos}, {self._pos + n}) outside the row group's "
                          f"[{self._base}, {self._base + len(self._data)})")
        self._pos += n
        return bytes(self._data[lo:lo + n])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


class RangedReader:
    """Rows of one parquet file in object storage whose row groups are fetched apart: the footer comes from
    the shard's index, row group g's bytes from `read_piece(g)` (the node's cache, fetching the group's
    range when it is not held), decoded on first use and kept as a local file's are."""

    def __init__(self, index: dict[str, Any], size: int, read_piece: Callable[[int], bytes]) -> None:
        self._md = pq.read_metadata(pa.BufferReader(base64.b64decode(index["footer"])))
        groups = [self._md.row_group(g).num_rows for g in range(self._md.num_row_groups)]
        if list(index["row_groups"]) != groups:
            raise ValueError(f"its row groups hold {groups} rows, its index says {index['row_groups']}")
        self._ranges = [(int(a), int(b)) for a, b in index["ranges"]]
        self._size = size
        self._read_piece = read_piece
        self._starts = list(itertools.accumulate(groups, initial=0))  # (groups + 1,)
        self._serial = next(_SERIAL)

    def row(self, r: int) -> Any:
        """Row `r` as a dict of column name to Python value.

        Raises:
            IndexError: `r` is out of range.
            Exception: what `read_piece` raised (a fetch that failed), or pyarrow's error for a garbled group.
        """
        if not 0 <= r < self._starts[-1]:
            raise IndexError(f"row {r} is not in [0, {self._starts[-1]})")
        g = bisect.bisect_right(self._starts, r) - 1
        rows = _DECODED.get((self._serial, g))
        if rows is None:
            data = self._read_piece(g)
            start, end = self._ranges[g]
            if len(data) != end - start:
                raise ValueError(f"row group {g} has {len(data)} bytes, its range [{start}, {end}) {end - start}")
            table = pq.ParquetFile(_At(data, start, self._size), metadata=self._md,
                                   page_checksum_verification=True).read_row_group(g)
            rows = table.to_pylist()
            _DECODED.put((self._serial, g), rows, table.nbytes)
        return rows[r - self._starts[g]]

    def close(self) -> None:
        """Forgets its decoded groups."""
        _DECODED.drop(self._serial)
