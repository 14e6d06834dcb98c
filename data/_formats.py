"""The shard formats: one protocol (a shard's index from its metadata, a reader of a local copy) and one registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import IO, Any, Protocol

from croupier.core.checks import check_choice
from croupier.data._index import Pieces
from croupier.data._parquet import Parquet
from croupier.data._webdataset import WebDataset


class Reader(Protocol):
    """Reads the samples of one shard held in a local file.

    A reader MUST return the same sample for a row however often and in whatever order it is asked, and
    MUST raise IndexError for a row outside ``[0, samples)``.
    """

    def row(self, r: int) -> Any:
        """Row `r` of the shard, decoded."""
        ...

    def close(self) -> None:
        """Lets go of the file."""
        ...


class Format(Protocol):
    """A kind of shard file.

    `index` MUST read metadata only where the format keeps it apart from the data (parquet's footer), and
    its answer MUST be JSON (it is cached on local disk) holding the shard's sample count as ``samples``.
    A format whose shards are read in parts (parquet's row groups) names them in `pieces`; a reader from
    `open_pieces` MUST then ask `read_piece` only for the pieces of the rows it is asked for.
    """

    name: str
    suffixes: tuple[str, ...]
    ranged: bool
    """Whether its shards in object storage are read in pieces (:meth:`pieces`) rather than fetched whole."""

    def index(self, f: IO[bytes]) -> dict[str, Any]:
        """The index of the shard read from the seekable file `f`: its ``samples`` and what its reader needs."""
        ...

    def open(self, path: str, index: dict[str, Any] | None, decode: bool) -> Reader:
        """A reader of the local file `path`, with the shard's `index` if known (else it reads it itself);
        `decode`: the fields decoded as the format's defaults say, else as stored."""
        ...

    def pieces(self, index: dict[str, Any]) -> Pieces | None:
        """The parts of the shard read apart from object storage (their rows and byte ranges), or None when
        `index` does not name them (one kept by an older release: build it again)."""
        ...

    def open_pieces(self, index: dict[str, Any], size: int, read_piece: Callable[[int], bytes],
                    decode: bool) -> Reader:
        """A reader of a shard of `size` bytes whose piece k's bytes ``read_piece(k)`` gives (only for a format
        and index with :meth:`pieces`)."""
        ...


FORMATS: dict[str, Format] = {f.name: f for f in (Parquet(), WebDataset())}
"""Every format by name: ``parquet`` (``.parquet``, ``.pq``), ``webdataset`` (``.tar``)."""


def format_of(path: str, name: str | None = None) -> Format:
    """The format named `name`, or else the one whose suffix `path` has.

    Raises:
        ValueError: `name` is no format's, or `path`'s suffix is none of theirs.
    """
    if name is not None:
        return FORMATS[check_choice("format", name, tuple(FORMATS))]
    for f in FORMATS.values():
        if path.lower().endswith(f.suffixes):
            return f
    known = [s for f in FORMATS.values() for s in f.suffixes]
    raise ValueError(f"no shard format reads {path!r}: its name ends in none of {known} (or name one with format=)")
