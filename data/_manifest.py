"""A dataset's manifest: its shards in order, each addressed by its content (size, etag or mtime) with its sample count."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec

from croupier.core.checks import check_choice, check_int
from croupier.data._formats import FORMATS, format_of
from croupier.data._index import IndexCache
from croupier.data._storage import Retry, Stat, Storage

#: The manifest's JSON format; a manifest of another version is refused.
VERSION = 1
#: Footers (or tar headers) :meth:`Manifest.build` reads at once.
BUILD_THREADS = 16


class ShardChanged(ValueError):
    """A shard is not the one its manifest names: its size or etag (or, with no etag, its mtime) differ."""


@dataclasses.dataclass(frozen=True)
class Shard:
    """One shard as its manifest records it.

    Attributes:
        path: Its URL (``s3://bucket/train/00000.parquet``) or local path.
        format: The name of its format (``parquet``, ``webdataset``).
        bytes: Its size in bytes.
        samples: Its samples (rows of a parquet file, keys of a tar).
        etag: The store's etag of it, or None where the store keeps none (a local file).
        mtime: Its modification time in seconds, or None where unknown.
    """

    path: str
    format: str
    bytes: int
    samples: int
    etag: str | None = None
    mtime: float | None = None

    @property
    def key(self) -> str:
        """The name of its content: what the cache and the index cache hold it as."""
        return content_key(self.path, Stat(self.bytes, self.etag, self.mtime))

    def check(self, now: Stat) -> None:
        """Refuses the shard if `now` (what the store says of it) is not what the manifest recorded.

        Raises:
            ShardChanged: its size differs, or its etag, or (without an etag on both sides) its mtime.
        """
        if now.size != self.bytes:
            what = f"its size was {self.bytes} bytes, it is {now.size} bytes now"
        elif self.etag is not None and now.etag is not None and now.etag != self.etag:
            what = f"its etag was {self.etag!r}, it is {now.etag!r} now"
        elif (self.etag is None or now.etag is None) and self.mtime is not None and now.mtime is not None \
                and now.mtime != self.mtime:
            what = f"its mtime was {self.mtime!r}, it is {now.mtime!r} now"
        else:
            return
        raise ShardChanged(f"shard {self.path} changed since the manifest recorded it: {what}; "
                           f"rebuild the manifest (Manifest.build) to read the shard as it is")


def _suffixes(format: str | None) -> list[str]:
    return [s for f in FORMATS.values() if format in (None, f.name) for s in f.suffixes]


def _shard_name(url: str, format: str | None) -> bool:
    """Whether a folder's file `url` is one of its shards: of the format's suffixes, not hidden."""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    return not name.startswith((".", "_")) and name.lower().endswith(tuple(_suffixes(format)))


def content_key(path: str, stat: Stat) -> str:
    """A file name for the content of `path` as `stat` describes it."""
    ident = stat.etag if stat.etag is not None else repr(stat.mtime)
    return hashlib.sha256(f"{path}\0{stat.size}\0{ident}".encode()).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The shards of a dataset in order; dataset index ``offsets[i] + r`` is row r of shard i.

    Build one with :meth:`build`, keep it with :meth:`save` and give it to a job's every rank
    (:meth:`load`): each rank then reads no footer, and refuses a shard that changed since.

    Attributes:
        shards: The shards, in the dataset's order.
    """

    shards: tuple[Shard, ...]

    def __post_init__(self) -> None:
        if not self.shards:
            raise ValueError("a manifest needs at least one shard (got none)")

    @property
    def sizes(self) -> tuple[int, ...]:
        """The samples of each shard, in order: the shard sizes of a job's spec."""
        return tuple(s.samples for s in self.shards)

    @property
    def fingerprint(self) -> str:
        """A name for the whole content: equal for two manifests of the same shards with the same contents."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    @classmethod
    def build(cls, source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *, format: str | None = None,
              storage_options: Mapping[str, Any] | None = None, cache_dir: str | os.PathLike[str] | None = None,
              retry: Retry | None = None) -> Manifest:
        """The manifest of the shards `source` names, their sizes from their metadata.

        Args:
            source: A URL or path of a folder (its files of the format, recursively, sorted by path; names
                starting with ``.`` or ``_`` left out, as Spark's markers), a glob
                (``s3://bucket/train/*.parquet``: every match, sorted), one file, or a list of files (in the
                order given).
            format: The shards' format (``parquet`` or ``webdataset``); default: from each file's suffix.
            storage_options: The file systems' options (credentials, endpoint), as fsspec takes them.
            cache_dir: Where shard indices are cached (a tar's index of members, a parquet file's row
                groups), keyed by content: a second build reads no footer. Default: not cached.
            retry: How transient errors are retried.

        Raises:
            FileNotFoundError: a shard named is not there, or `source` names none.
            ValueError: a file's format is unknown, or it is not of its format.
        """
        storage = Storage(storage_options, retry)
        if isinstance(source, (str, os.PathLike)):
            found, folder = storage.expand(os.fspath(source))
            if folder:
                found = [(url, stat) for url, stat in found if _shard_name(url, format)]
                if not found:
                    raise FileNotFoundError(f"no shards in {os.fspath(source)}: no file of "
                                            f"{format or 'a known format'} (suffixes {_suffixes(format)})")
        else:
            found = [(os.fspath(p), storage.stat(os.fspath(p), fresh=False)) for p in source]
        index = IndexCache(cache_dir)

        def shard(url: str, stat: Stat) -> Shard:
            fmt = format_of(url, format)

            def read() -> dict[str, Any]:
                with storage.open(url, block_size=2**16, size=stat.size) as f:
                    try:
                        return fmt.index(f)
                    except OSError:
                        raise
                    except Exception as e:
                        raise ValueError(f"{url} is not a {fmt.name} file: {type(e).__name__}: {e}") from e

            idx = index.get_or_build(content_key(url, stat), lambda: storage.retry.run(f"read the index of {url}", read))
            return Shard(url, fmt.name, stat.size, int(idx["samples"]), stat.etag, stat.mtime)

        # NOTE: the footers are read BUILD_THREADS at a time (an object store answers each after a round trip),
        # each process of a node starting at a place of its own: processes building one manifest at once
        # (a node's ranks) read different footers, and find the others' in the index cache.
        start = os.getpid() % len(found) if found else 0
        turn = found[start:] + found[:start]
        with ThreadPoolExecutor(min(BUILD_THREADS, max(1, len(found))), thread_name_prefix="croupier-manifest") as pool:
            built = dict(zip((url for url, _ in turn), pool.map(lambda f: shard(*f), turn)))
        return cls(tuple(built[url] for url, _ in found))

    def to_json(self) -> str:
        """The manifest as JSON text."""
        return json.dumps({"version": VERSION, "shards": [dataclasses.asdict(s) for s in self.shards]},
                          indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """The manifest written as `text` by :meth:`to_json`.

        Raises:
            ValueError: `text` is not a manifest of this version, naming what is wrong.
        """
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.get("version") != VERSION:
            got = doc.get("version") if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"not a shard manifest of version {VERSION} (got version={got!r})")
        fields = {f.name for f in dataclasses.fields(Shard)}
        shards = []
        for i, s in enumerate(doc.get("shards", [])):
            if not isinstance(s, dict) or set(s) != fields:
                raise ValueError(f"shard {i} of the manifest must have the fields {sorted(fields)} (got {s!r})")
            shards.append(Shard(path=str(s["path"]),
                                format=check_choice(f"shard {i}'s format", s["format"], tuple(FORMATS)),
                                bytes=check_int(f"shard {i}'s bytes", s["bytes"], 0),
                                samples=check_int(f"shard {i}'s samples", s["samples"], 0),
                                etag=None if s["etag"] is None else str(s["etag"]),
                                mtime=None if s["mtime"] is None else float(s["mtime"])))
        return cls(tuple(shards))

    def save(self, path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> None:
        """Writes the manifest as JSON to `path` (a local path or an fsspec URL)."""
        with fsspec.open(os.fspath(path), "w", **dict(storage_options or {})) as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Manifest:
        """The manifest :meth:`save` wrote to `path`.

        Raises:
            ValueError: the file is not a manifest of this version.
        """
        with fsspec.open(os.fspath(path), "r", **dict(storage_options or {})) as f:
            return cls.from_json(f.read())
