"""WebDataset shards: tar files whose members are grouped into samples by key, read through an index of members."""

from __future__ import annotations

import json
import os
import re
import tarfile
from collections.abc import Callable
from typing import IO, Any

from croupier.data._index import Pieces

#: A member's key and extension: "dir/0001.seg.json" is key "dir/0001", extension "seg.json" (webdataset's rule).
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")
#: How a member is decoded by the last part of its extension (webdataset's basic handlers, minus pickle).
_TEXT = {"txt", "text", "transcript"}
_INT = {"cls", "cls2", "class", "count", "index", "inx", "id"}
_JSON = {"json", "jsn"}


def members(f: IO[bytes]) -> list[list[Any]]:
    """The samples of the tar read from `f`, reading its headers only (seeking past each member's data):
    ``[key, [[extension, offset, size], ...]]`` per sample, in the tar's order.

    Raises:
        ValueError: one sample has two members with the same extension.
        tarfile.TarError: `f` is no tar file.
    """
    out: list[list[Any]] = []
    with tarfile.open(fileobj=f, mode="r:") as tar:
        for m in tar:
            match = _KEY_EXT.match(m.name)
            if not m.isfile() or match is None:
                continue
            key, ext = match.groups()
            if not out or out[-1][0] != key:
                out.append([key, []])
            if any(e == ext for e, _, _ in out[-1][1]):
                raise ValueError(f"sample {key!r} has two members {ext!r}")
            out[-1][1].append([ext, m.offset_data, m.size])
    return out


def decode(ext: str, data: bytes) -> Any:
    """A member's bytes decoded by its extension's last part: text as str, a class or id as int, JSON parsed,
    anything else the bytes as they are."""
    last = ext.rsplit(".", 1)[-1].lower()
    if last in _TEXT:
        return data.decode("utf-8")
    if last in _INT:
        return int(data)
    if last in _JSON:
        return json.loads(data)
    return data


class WebDataset:
    """A tar file is one shard; each group of members sharing a key is one sample, a dict of extension to
    the member (decoded by :func:`decode`, or bytes) with the key as ``__key__``."""

    name: str = "webdataset"
    suffixes: tuple[str, ...] = (".tar",)
    ranged: bool = False

    def index(self, f: IO[bytes]) -> dict[str, Any]:
        """The samples and where each member lies, from the tar's headers."""
        samples = members(f)
        return {"samples": len(samples), "members": samples}

    def open(self, path: str, index: dict[str, Any] | None, decode: bool) -> TarReader:
        """A reader of the local tar `path`."""
        return TarReader(path, index, decode)

    def pieces(self, index: dict[str, Any]) -> Pieces | None:
        """None: a tar is fetched whole (its samples are small members, many to a range worth a request)."""
        return None

    def open_pieces(self, index: dict[str, Any], size: int, read_piece: Callable[[int], bytes],
                    decode: bool) -> TarReader:
        """Never called: a tar has no pieces (:meth:`pieces`).

        Raises:
            TypeError: always.
        """
        raise TypeError("a webdataset tar is read whole: it has no pieces to read apart")


class TarReader:
    """Samples of one local tar file, each read with one positioned read per member."""

    def __init__(self, path: str, index: dict[str, Any] | None, decode: bool) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        try:
            if index is None:
                with os.fdopen(os.dup(self._fd), "rb") as f:
                    index = {"members": members(f)}
            self._members: list[list[Any]] = index["members"]
            end = max((off + size for _, ms in self._members for _, off, size in ms), default=0)
            if end > os.fstat(self._fd).st_size:
                raise ValueError(f"its members end at byte {end}, past the file's {os.fstat(self._fd).st_size}")
        except BaseException:
            os.close(self._fd)
            raise
        self._decode = decode

    def row(self, r: int) -> dict[str, Any]:
        """Sample `r`: ``{"__key__": key, extension: member, ...}``."""
        if not 0 <= r < len(self._members):
            raise IndexError(f"row {r} is not in [0, {len(self._members)})")
        key, ms = self._members[r]
        out: dict[str, Any] = {"__key__": key}
        for ext, off, size in ms:
            data = os.pread(self._fd, size, off)
            if len(data) != size:
                raise ValueError(f"member {key}.{ext} is cut short: {len(data)} of {size} bytes")
            out[ext] = decode(ext, data) if self._decode else data
        return out

    def close(self) -> None:
        """Closes the file."""
        os.close(self._fd)
