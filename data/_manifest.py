"""A dataset's manifest: its shards in order, each addressed by its content (size, etag or mtime) with its sample count."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gzip
import hashlib
import json
import logging
import os
import secrets
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec

from croupier.core.checks import check_choice, check_int
from croupier.data._formats import FORMATS, format_of
from croupier.data._index import IndexCache
from croupier.data._storage import Retry, Stat, Storage

log = logging.getLogger("croupier.data")

#: The manifest's JSON format, written; a manifest of a version not in READS is refused.
VERSION = 2
#: The versions :meth:`Manifest.from_json` reads: 1 (no shard indices), 2 (each shard's index where its format reads
#: by ranges).
READS = (1, 2)
#: The name of the manifest :meth:`Manifest.find_or_build` keeps beside the data and in a node's cache folder; KEY
#: names the source (its URL and format). A name starting with ``_``: never taken for a shard.
KEPT_NAME = "_croupier-manifest-{key}.json.gz"
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


def _kept(url: str) -> bool:
    """Whether `url` is a manifest :meth:`Manifest.find_or_build` kept (never a shard, even where a glob matches it)."""
    return url.rstrip("/").rsplit("/", 1)[-1].startswith(KEPT_NAME.split("{", 1)[0])


def content_key(path: str, stat: Stat) -> str:
    """A file name for the content of `path` as `stat` describes it."""
    ident = stat.etag if stat.etag is not None else repr(stat.mtime)
    return hashlib.sha256(f"{path}\0{stat.size}\0{ident}".encode()).hexdigest()[:32]


def _found(storage: Storage, source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
           format: str | None) -> tuple[list[tuple[str, Stat]], str | None]:
    """The shards `source` names, each with its :class:`Stat` (one listing of a folder or glob, a stat of each file
    of a list), and the folder a manifest of them is kept in beside the data (None for a list)."""
    if not isinstance(source, (str, os.PathLike)):
        return [(os.fspath(p), storage.stat(os.fspath(p), fresh=False)) for p in source], None
    src = os.fspath(source)
    found, folder = storage.expand(src)
    found = [(url, stat) for url, stat in found if not _kept(url)]
    if folder:
        found = [(url, stat) for url, stat in found if _shard_name(url, format)]
        if not found:
            raise FileNotFoundError(f"no shards in {src}: no file of "
                                    f"{format or 'a known format'} (suffixes {_suffixes(format)})")
        return found, src.rstrip("/")
    if not found:
        raise FileNotFoundError(f"no shards at {src}")
    wild = min((i for i, c in enumerate(src) if c in "*?["), default=len(src))
    return found, src[:wild].rsplit("/", 1)[0] if "/" in src[:wild] else None


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The shards of a dataset in order; dataset index ``offsets[i] + r`` is row r of shard i.

    Build one with :meth:`build` (or have :meth:`find_or_build` find the one kept for the data), keep it with
    :meth:`save` and give it to a job's every rank (:meth:`load`): each rank then reads no footer, and refuses a
    shard that changed since.

    Attributes:
        shards: The shards, in the dataset's order.
        indices: Each shard's index where its format reads it by ranges (a parquet file: its row groups' rows and
            byte ranges, and its footer, what decoding a row group read by range needs), else None; None for a
            manifest that carries none (of version 1). A reader of a shard whose index the manifest carries reads
            no footer.
    """

    shards: tuple[Shard, ...]
    indices: tuple[dict[str, Any] | None, ...] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.shards:
            raise ValueError("a manifest needs at least one shard (got none)")
        if self.indices is not None and len(self.indices) != len(self.shards):
            raise ValueError(f"a manifest needs one index (or None) per shard (got {len(self.indices)} for "
                             f"{len(self.shards)} shards)")

    @property
    def sizes(self) -> tuple[int, ...]:
        """The samples of each shard, in order: the shard sizes of a job's spec."""
        return tuple(s.samples for s in self.shards)

    @property
    def fingerprint(self) -> str:
        """A name for the whole content: equal for two manifests of the same shards with the same contents.

        NOTE: of the shards alone (the JSON of version 1), not of the indices they carry: the same for a manifest
        kept by an older release, and for one with or without its indices.
        """
        doc = {"version": 1, "shards": [dataclasses.asdict(s) for s in self.shards]}
        return hashlib.sha256(json.dumps(doc, indent=1, sort_keys=True).encode()).hexdigest()[:16]

    def index(self, s: int) -> dict[str, Any] | None:
        """The index of shard `s` the manifest carries, or None."""
        return None if self.indices is None else self.indices[s]

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
        return cls._build(storage, _found(storage, source, format)[0], format, cache_dir, {})

    @classmethod
    def _build(cls, storage: Storage, found: list[tuple[str, Stat]], format: str | None,
               cache_dir: str | os.PathLike[str] | None, known: Mapping[str, dict[str, Any]]) -> Manifest:
        """The manifest of the shards `found`, each index from `known` (by content key), the node's index cache, or
        the shard's metadata."""
        index = IndexCache(cache_dir)

        def shard(url: str, stat: Stat) -> tuple[Shard, dict[str, Any] | None]:
            fmt = format_of(url, format)

            def read() -> dict[str, Any]:
                with storage.open(url, block_size=2**16, size=stat.size) as f:
                    try:
                        return fmt.index(f)
                    except OSError:
                        raise
                    except Exception as e:
                        raise ValueError(f"{url} is not a {fmt.name} file: {type(e).__name__}: {e}") from e

            key = content_key(url, stat)
            idx = known.get(key) or index.get_or_build(
                key, lambda: storage.retry.run(f"read the index of {url}", read))
            carried = idx if fmt.ranged and fmt.pieces(idx) is not None else None
            return Shard(url, fmt.name, stat.size, int(idx["samples"]), stat.etag, stat.mtime), carried

        # NOTE: the footers are read BUILD_THREADS at a time (an object store answers each after a round trip),
        # each process of a node starting at a place of its own: processes building one manifest at once
        # (a node's ranks) read different footers, and find the others' in the index cache.
        start = os.getpid() % len(found) if found else 0
        turn = found[start:] + found[:start]
        with ThreadPoolExecutor(min(BUILD_THREADS, max(1, len(found))), thread_name_prefix="croupier-manifest") as pool:
            built = dict(zip((url for url, _ in turn), pool.map(lambda f: shard(*f), turn)))
        got = [built[url] for url, _ in found]
        return cls(tuple(s for s, _ in got), tuple(i for _, i in got))

    @classmethod
    def find_or_build(cls, source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
                      format: str | None = None, storage_options: Mapping[str, Any] | None = None,
                      cache_dir: str | os.PathLike[str] | None = None, retry: Retry | None = None,
                      beside: bool = True) -> Manifest:
        """The manifest of the shards `source` names (as :meth:`build` takes it), kept once built: a fresh node finds
        it in one read and reads no footer.

        `source` is listed (a folder or glob: one listing; a list: a stat of each file), then the manifest kept for
        it is looked for in the node's `cache_dir` (``manifest/``), then beside the data (a folder's own, a glob's
        folder before its first wildcard, a file's folder; a list has none): the file KEPT_NAME (gzip-compressed
        JSON, its KEY naming the source and `format`). A kept manifest is taken only if it names exactly the shards
        listed, each of the size and etag (without one, mtime) listed; else the manifest is built, each index taken
        from the stale kept manifest where the shard's content is the same, and kept: by the first process of the
        node to get the node's lock (the others wait, and find it), in `cache_dir` and, where the data's folder
        takes a write (`beside`), beside the data for every other node. Where neither can be written, it is built
        as :meth:`build` builds it.

        NOTE: the kept manifest carries each parquet shard's index (row groups and footer), so a reader reads no
        footer; a shard whose content changes later is still refused when read (:class:`ShardChanged`).

        Args:
            source, format, storage_options, retry: As :meth:`build` takes them.
            cache_dir: The node's cache folder (shard indices under ``index/``, manifests under ``manifest/``);
                None: nothing kept on the node, nor a lock shared.
            beside: Keep the manifest beside the data where the data's folder takes a write (False: look for one
                there, write none).

        Raises:
            As :meth:`build`.
        """
        storage = Storage(storage_options, retry)
        found, folder = _found(storage, source, format)
        names = [os.fspath(p) for p in source] if not isinstance(source, (str, os.PathLike)) else [os.fspath(source)]
        key = hashlib.sha256("\0".join([n.rstrip("/") for n in names] + [format or ""]).encode()).hexdigest()[:16]
        name = KEPT_NAME.format(key=key)
        node = None if cache_dir is None else os.path.join(os.fspath(cache_dir), "manifest", name)
        there = None if folder is None else f"{folder}/{name}"
        stale: list[Manifest] = []
        for where in (node, there):
            got = _read_kept(storage, where)
            if got is not None and got._names(found):
                if where == there and node is not None:
                    _write_kept(storage, node, got)
                return got
            stale += [got] if got is not None else []
        with _node_lock(node):
            got = _read_kept(storage, node)
            if got is not None and got._names(found):
                return got
            known = {s.key: i for m in stale for s, i in zip(m.shards, m.indices or ()) if i is not None}
            built = cls._build(storage, found, format, cache_dir, known)
            for where in (node, there if beside else None):
                _write_kept(storage, where, built)
            return built

    def _names(self, found: Sequence[tuple[str, Stat]]) -> bool:
        """Whether the manifest names exactly the shards `found`, in order, each of the content listed."""
        return len(self.shards) == len(found) and all(
            s.path == url and s.bytes == st.size and s.etag == st.etag and (s.etag is not None or s.mtime == st.mtime)
            for s, (url, st) in zip(self.shards, found))

    def to_json(self) -> str:
        """The manifest as JSON text (each shard's carried index, or null, as its ``index``)."""
        shards = [{**dataclasses.asdict(s), "index": self.index(i)} for i, s in enumerate(self.shards)]
        return json.dumps({"version": VERSION, "shards": shards}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """The manifest written as `text` by :meth:`to_json` (of a version in READS).

        Raises:
            ValueError: `text` is not a manifest of a version read here, naming what is wrong.
        """
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.get("version") not in READS:
            got = doc.get("version") if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"not a shard manifest of version {' or '.join(map(str, READS))} (got version={got!r})")
        fields = {f.name for f in dataclasses.fields(Shard)} | ({"index"} if doc["version"] >= 2 else set())
        shards, indices = [], []
        for i, s in enumerate(doc.get("shards", [])):
            if not isinstance(s, dict) or set(s) != fields:
                raise ValueError(f"shard {i} of the manifest must have the fields {sorted(fields)} (got {s!r})")
            shards.append(Shard(path=str(s["path"]),
                                format=check_choice(f"shard {i}'s format", s["format"], tuple(FORMATS)),
                                bytes=check_int(f"shard {i}'s bytes", s["bytes"], 0),
                                samples=check_int(f"shard {i}'s samples", s["samples"], 0),
                                etag=None if s["etag"] is None else str(s["etag"]),
                                mtime=None if s["mtime"] is None else float(s["mtime"])))
            idx = s.get("index")
            if idx is not None and not _names_pieces(shards[-1], idx):
                raise ValueError(f"shard {i}'s index must name its pieces and its {shards[-1].samples} samples "
                                 f"(got {str(idx)[:200]!r})")
            indices.append(idx)
        return cls(tuple(shards), tuple(indices) if doc["version"] >= 2 else None)

    def save(self, path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> None:
        """Writes the manifest as JSON to `path` (a local path or an fsspec URL; gzip-compressed if it ends in ``.gz``)."""
        with fsspec.open(os.fspath(path), "w", compression="infer", **dict(storage_options or {})) as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Manifest:
        """The manifest :meth:`save` wrote to `path`.

        Raises:
            ValueError: the file is not a manifest of a version read here.
        """
        with fsspec.open(os.fspath(path), "r", compression="infer", **dict(storage_options or {})) as f:
            return cls.from_json(f.read())


def _names_pieces(shard: Shard, index: Any) -> bool:
    """Whether `index` is an index of `shard`'s format that names its pieces, of its samples."""
    try:
        return isinstance(index, dict) and index.get("samples") == shard.samples \
            and FORMATS[shard.format].pieces(index) is not None
    except (KeyError, TypeError, ValueError):
        return False


def _read_kept(storage: Storage, url: str | None) -> Manifest | None:
    """The manifest kept at `url` (one read), or None where there is none or it cannot be read (an unreadable or
    older one is built again)."""
    if url is None:
        return None
    try:
        return Manifest.from_json(gzip.decompress(storage.read_all(url)).decode())
    except FileNotFoundError:
        return None
    except Exception as e:
        log.info("the manifest kept at %s is not read (%s: %s); it is built again", url, type(e).__name__, e)
        return None


def _write_kept(storage: Storage, url: str | None, manifest: Manifest) -> None:
    """Keeps `manifest` at `url`, whole or not at all (a local file under a temporary name renamed; an object in one
    request); a place that takes no write (no such folder, no permission, a read-only store) keeps none."""
    if url is None:
        return
    data = gzip.compress(manifest.to_json().encode(), mtime=0)
    try:
        if storage.is_local(url):
            path = storage.local_path(url)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        else:
            storage.write_all(url, data)
    except Exception as e:
        log.info("no manifest kept at %s (%s: %s)", url, type(e).__name__, e)


@contextlib.contextmanager
def _node_lock(path: str | None) -> Iterator[None]:
    """Holds the node's lock of the manifest kept at `path` (an exclusive flock of ``PATH.lock``); none where `path` is
    None or the lock file cannot be made (nothing is kept there either)."""
    try:
        if path is None:
            raise FileNotFoundError("no cache folder")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        if path is not None:
            log.info("no lock of the manifest kept at %s (%s: %s)", path, type(e).__name__, e)
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # lets go of the lock
