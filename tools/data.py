"""`croupier data inspect`: a sharded dataset's shards, rows and bytes, and the shard sizes a job's spec takes."""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

#: Shards the table shows unless --all.
SHOWN = 20


def add_parser(sub: Any) -> None:
    """Adds ``croupier data inspect`` to the command's subparsers `sub`."""
    d = sub.add_parser("data", help="sharded datasets (parquet, webdataset), local or in object storage (docs/data.md)")
    dsub = d.add_subparsers(dest="data_command", required=True)
    i = dsub.add_parser("inspect", help="print a dataset's shards, rows and bytes, and the shard sizes a job's spec "
                                        "takes, from the shards' metadata (parquet footers, tar headers)")
    i.add_argument("path", metavar="PATH",
                   help="a folder, glob or file of shards, local or an fsspec URL (s3://bucket/train/*.parquet), "
                        "or a manifest (.json) that Manifest.save or --save-manifest wrote")
    i.add_argument("--format", choices=("parquet", "webdataset"), default=None,
                   help="the shards' format (default: from each file's suffix)")
    i.add_argument("--storage-options", default="{}", metavar="JSON",
                   help='fsspec options as JSON, e.g. \'{"client_kwargs": {"endpoint_url": "http://HOST:PORT"}}\' '
                        "(default: none; credentials as the store's client finds them)")
    i.add_argument("--save-manifest", metavar="FILE",
                   help="also write the dataset's manifest (each shard's size, samples, etag or mtime) to FILE")
    i.add_argument("--all", action="store_true", help=f"list every shard (default: the first {SHOWN})")
    i.set_defaults(func=data_cmd)


def sizes_summary(sizes: tuple[int, ...]) -> str:
    """The shard sizes in a line: the list when short, ``[500] * 64`` when all equal, else min, median, max."""
    if len(sizes) <= 8:
        return str(list(sizes))
    if len(set(sizes)) == 1:
        return f"[{sizes[0]}] * {len(sizes)}"
    return f"{len(sizes)} shards: min {min(sizes)}, median {statistics.median(sizes):g}, max {max(sizes)}"


def data_cmd(args: argparse.Namespace) -> int:
    """``croupier data inspect PATH``."""
    from croupier.data import Manifest

    options = json.loads(args.storage_options)
    if not isinstance(options, dict):
        raise ValueError(f"--storage-options must be a JSON object (got {args.storage_options!r})")
    if args.path.endswith(".json"):
        manifest = Manifest.load(args.path, options)
    else:
        manifest = Manifest.build(args.path, format=args.format, storage_options=options)
    if args.save_manifest:
        manifest.save(args.save_manifest)
    shards = manifest.shards
    sizes = manifest.sizes
    formats = sorted({s.format for s in shards})
    print(f"{len(shards)} shards, {sum(sizes):,} rows, {sum(s.bytes for s in shards):,} bytes ({', '.join(formats)}); "
          f"manifest {manifest.fingerprint}")
    print(f"{'shard':>6} {'rows':>10} {'bytes':>14} {'first index':>12}  path")
    first = 0
    for i, s in enumerate(shards):
        if i < SHOWN or args.all:
            print(f"{i:>6} {s.samples:>10,} {s.bytes:>14,} {first:>12,}  {s.path}")
        first += s.samples
    if len(shards) > SHOWN and not args.all:
        print(f"({len(shards) - SHOWN} more shards: --all lists them)")
    print(f"spec: n={sum(sizes)}, shard_sizes={sizes_summary(sizes)}")
    kept = args.save_manifest or (args.path if args.path.endswith(".json") else None)
    print(f"  ds = croupier.data.ShardedDataset({f'Manifest.load({kept!r})' if kept else repr(args.path)}, ...)")
    print("  sampler = DistributedSampler(ds, shard_sizes=ds.shard_sizes, ...)")
    if args.save_manifest:
        print(f"manifest written to {args.save_manifest}")
    return 0
