"""The `croupier` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np

from croupier.server._order import fresh, plan
from croupier.server._spec import PARTITIONS, PERMUTATIONS, TAILS, Spec


def _order_cmd(args: argparse.Namespace) -> int:
    spec = Spec(
        n=args.n,
        seed=args.seed,
        permutation=args.permutation,
        partition=args.partition,
        tail=args.tail,
        batch_size=args.batch_size,
    )
    p = plan(spec, fresh(spec, args.epoch), args.world)
    np.set_printoptions(threshold=64, linewidth=120)
    print(f"spec {spec.fingerprint}: {spec.describe()}")
    print(f"epoch {args.epoch}, world {args.world}: rank {args.rank} gets {p.samples(args.rank)} indices")
    for j in range(args.batches):
        b = p.batch_indices(args.rank, j)
        if b is None:
            print(f"batch {j}: (end of epoch)")
            break
        print(f"batch {j}: {b}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `croupier` command."""
    parser = argparse.ArgumentParser(prog="croupier", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    o = sub.add_parser("order", help="print the first batches one rank gets in one epoch")
    o.add_argument("--n", type=int, required=True, help="dataset size")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--epoch", type=int, default=0)
    o.add_argument("--world", type=int, default=1)
    o.add_argument("--rank", type=int, default=0)
    o.add_argument("--batch-size", type=int, default=8)
    o.add_argument("--batches", type=int, default=3)
    o.add_argument("--permutation", choices=PERMUTATIONS, default="feistel")
    o.add_argument("--partition", choices=PARTITIONS, default="strided")
    o.add_argument("--tail", choices=TAILS, default="pad")
    o.set_defaults(func=_order_cmd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `croupier` command."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, TypeError) as e:
        print(f"croupier: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
