"""Writes tests/golden/orders.json and the checkpoint fixtures in tests/fixtures/; run by hand, never by a test."""

# Usage:
#     python tests/golden/make_golden.py orders     # after bumping ORDER_VERSION, on purpose
#     python tests/golden/make_golden.py fixtures   # adds this release's checkpoint fixtures
#     python tests/golden/make_golden.py mixtures   # the mixtures' orders (tests/golden/mixtures.json)
#
# The orders file is what tests/core/test_golden.py holds the engine to: regenerate it only in the
# change that bumps ORDER_VERSION (see the NOTE in core/spec.py), or that adds a new kind of
# order (which changes no existing spec's order: the vectors already in the file must not
# change). The fixtures are checkpoint states written by a release's samplers, with what the
# rest of their epoch yields; the fixture writer uses nothing but the samplers' public API, so
# it runs under older releases too (tests/fixtures/checkpoint-v1-*.json were written by running
# it against croupier 0.1), and it never overwrites a fixture: fixtures are kept forever (see
# tests/core/test_fixtures.py).

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

TESTS = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))  # the tests' helpers (run as a script, not under pytest)
from _ranks import on_ranks  # noqa: E402

ORDERS = TESTS / "golden" / "orders.json"
FIXTURES = TESTS / "fixtures"

# --------------------------------------------------------------------------- golden orders

#: The small plans: every permutation x partition x tail (x scope where valid) at these settings.
N, SEED, EPOCH, WORLD, BATCH_SIZE, BUFFER_SIZE, PACK_SIZE = 23, 7, 2, 3, 2, 5, 2
#: Sort keys of the small bucket plans: few distinct values, so ties (broken by index) abound.
LENGTHS = [5, 3, 8, 3, 1, 9, 3, 5, 5, 2, 7, 0, 4, 4, 6, 1, 8, 2, 9, 3, 5, 7, 1]
#: A resumed cursor's remaining positions: a plan over two intervals, not only a fresh epoch.
RESUMED = [[3, 9], [14, 23]]
#: Dataset sizes near 2**32 and 2**40, where the Feistel domain and the wire's index width change.
LARGE_NS = [2**32 - 1, 2**32, 2**32 + 1, 2**40 - 1, 2**40, 2**40 + 1]
#: The small shard plans' shards (they add up to N), windows of 2 shards, 2 heads, reader groups of 2.
SHARDS, SHARD_WINDOW, LANES, READER_GROUP = [4, 1, 6, 2, 3, 5, 2], 2, 2, 2
#: A shard order of 1,000 shards over each large size (the last shard holds what is left).
LARGE_SHARDS = 1000
#: A bucket order with many packs per window (25): its pack shuffle takes the vectorised path.
BUCKET_N, BUCKET_BUFFER, BUCKET_PACK = 1000, 100, 4


def _sample_positions(n: int) -> list[int]:
    """The first 8, the last 8 and five in the middle of [0, n)."""
    middle = [n // 3, n // 2 - 1, n // 2, n // 2 + 1, 2 * n // 3]
    return list(range(8)) + middle + list(range(n - 8, n))


def _spec_kwargs(permutation: str, partition: str, tail: str, scope: str) -> dict[str, Any]:
    """The small plans' spec settings; ``lengths`` as a list of ints (or None)."""
    kw: dict[str, Any] = dict(n=N, seed=SEED, permutation=permutation, partition=partition, tail=tail, scope=scope,
                              batch_size=BATCH_SIZE, buffer_size=None, pack_size=None, lengths=None)
    if permutation in ("window", "bucket"):
        kw["buffer_size"] = BUFFER_SIZE
    if permutation == "bucket":
        kw["pack_size"] = PACK_SIZE
        kw["lengths"] = LENGTHS
    if permutation == "shards":
        kw.update(shards=SHARDS, shard_window=SHARD_WINDOW, lanes=LANES, reader_group=READER_GROUP)
    return kw


def large_shards(n: int) -> list[int]:
    """:data:`LARGE_SHARDS` shards of n samples: equal ones and the rest in the last."""
    each = n // LARGE_SHARDS
    return [each] * (LARGE_SHARDS - 1) + [n - each * (LARGE_SHARDS - 1)]


def spec_of(kw: dict[str, Any]) -> Any:
    """The spec a golden case describes (``lengths`` and ``shards`` as lists of ints)."""
    from croupier.core.spec import Spec

    if kw.get("lengths") is not None:
        rest = {k: v for k, v in kw.items() if k not in ("n", "lengths")}
        return Spec.with_lengths(kw["lengths"], **rest)
    if kw.get("shards") is not None:
        rest = {k: v for k, v in kw.items() if k not in ("n", "shards", "lengths")}
        return Spec.with_shards(kw["shards"], **rest)
    return Spec(**{k: v for k, v in kw.items() if k != "lengths"})


def make_orders() -> dict[str, Any]:
    """The golden file's content, computed by this release's engine."""
    from croupier.core.order import Cursor, bind, fresh, order
    from croupier.core.registry import plan_epoch
    from croupier.core.spec import ORDER_VERSION, PARTITIONS, PERMUTATIONS, TAILS, Spec

    plans = []
    for permutation in PERMUTATIONS:
        for partition in PARTITIONS:
            for tail in TAILS:
                for scope in ("global", "rank"):
                    kw = _spec_kwargs(permutation, partition, tail, scope)
                    try:
                        spec = spec_of(kw)
                    except ValueError:
                        continue  # scope="rank" needs a contiguous partition and a keyed shuffle
                    for name, cursor in (("fresh", fresh(spec, EPOCH)),
                                         ("resumed", Cursor(EPOCH, tuple((a, b) for a, b in RESUMED)))):
                        cursor = bind(spec, cursor, WORLD)
                        p = plan_epoch(spec, cursor, WORLD, EPOCH)
                        ranks = []
                        for r in range(WORLD):
                            batches, j = [], 0
                            while (b := p.batch_indices(r, j)) is not None:
                                batches.append(b.tolist())
                                j += 1
                            ranks.append(batches)
                        full = order(spec, EPOCH, np.arange(N), cursor.base_world).tolist()
                        plans.append({
                            "id": f"{permutation}/{partition}/{tail}/{scope}/{name}", "spec": kw, "epoch": EPOCH,
                            "world": WORLD, "remaining": [list(iv) for iv in cursor.remaining],
                            "base_world": cursor.base_world, "order": full, "ranks": ranks,
                        })

    samples = []
    large: list[tuple[str, str, int | None]] = [("feistel", "global", None), ("window", "global", 1000),
                                                ("feistel", "rank", None)]
    for n in LARGE_NS:
        for permutation, scope, buffer_size in large:
            kw = dict(n=n, seed=SEED, permutation=permutation, partition="contiguous", scope=scope,
                      buffer_size=buffer_size)
            spec = Spec(**kw)
            base_world = WORLD if scope == "rank" else 0
            pos = _sample_positions(n)
            samples.append({
                "id": f"{permutation}/{scope}/n={n}", "spec": kw, "epoch": EPOCH, "base_world": base_world,
                "positions": pos, "indices": order(spec, EPOCH, np.array(pos), base_world).tolist(),
            })
    for n in LARGE_NS:
        kw = dict(n=n, seed=SEED, shards=large_shards(n))
        pos = _sample_positions(n)
        samples.append({
            "id": f"shards/global/n={n}", "spec": kw, "epoch": EPOCH, "base_world": 0, "positions": pos,
            "indices": order(spec_of(kw), EPOCH, np.array(pos), 0).tolist(),
        })
    lengths = [(i * 7919) % 97 for i in range(BUCKET_N)]
    kw = dict(n=BUCKET_N, seed=SEED, permutation="bucket", buffer_size=BUCKET_BUFFER, pack_size=BUCKET_PACK,
              lengths=lengths)  # 25 packs a window: more than feistel.SMALL, the vectorised path
    spec = spec_of(kw)
    pos = list(range(BUCKET_N))
    samples.append({
        "id": f"bucket/global/n={BUCKET_N}", "spec": kw, "epoch": EPOCH, "base_world": 0, "positions": pos,
        "indices": order(spec, EPOCH, np.array(pos), 0).tolist(),
    })
    return {
        "about": "Golden orders of croupier's order engine. Written by tests/golden/make_golden.py; checked by "
                 "tests/core/test_golden.py. Regenerate only with a bump of ORDER_VERSION (core/spec.py) or for a new "
                 "kind of order.",
        "order_version": ORDER_VERSION,
        "plans": plans,
        "samples": samples,
    }


def dump(data: dict[str, Any]) -> str:
    """JSON with one plan or sample per line: readable diffs without a line per index."""
    lines = ["{"]
    items = list(data.items())
    for k, (key, value) in enumerate(items):
        end = "," if k < len(items) - 1 else ""
        if isinstance(value, list):
            lines.append(f"  {json.dumps(key)}: [")
            lines += [f"    {json.dumps(v)}{',' if i < len(value) - 1 else ''}" for i, v in enumerate(value)]
            lines.append(f"  ]{end}")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}{end}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def compact(data: Any) -> str:
    """Indented JSON whose lists of numbers stay on one line."""
    def one_line(m: re.Match[str]) -> str:
        return "[" + ", ".join(x.strip() for x in m.group(1).split(",") if x.strip()) + "]"

    return re.sub(r"\[([-0-9,\s]*)\]", one_line, json.dumps(data, indent=1)) + "\n"


# --------------------------------------------------------------------------- checkpoint fixtures

#: Each fixture: a sampler, its arguments, the world that writes the state at `epoch` after `taken`
#: items per rank, and the world 1 that reads it back and records the rest of the epoch.
FIXTURE_CASES: list[dict[str, Any]] = [
    {"name": "feistel", "sampler": "DistributedSampler", "writer_world": 3, "epoch": 1, "taken": 9,
     "args": {"dataset": 101, "seed": 3, "partition": "contiguous", "tail": "pad"}},
    {"name": "bucket", "sampler": "DistributedBatchSampler", "writer_world": 1, "epoch": 2, "taken": 5,
     "args": {"dataset": 64, "batch_size": 4, "seed": 5, "lengths": [(i * 37) % 29 for i in range(64)],
              "buffer_size": 16, "pack_size": 4, "tail": "uneven"}},
    {"name": "torch", "sampler": "DistributedSampler", "writer_world": 1, "epoch": 3, "taken": 17,
     "args": {"dataset": 50, "seed": 11, "permutation": "torch", "drop_last": True}},
]


def make_fixture(case: dict[str, Any], address: str) -> dict[str, Any]:
    """Writes a checkpoint state with `case`'s writer world, and reads the rest of its epoch back at world 1."""
    from croupier.client import DistributedBatchSampler, DistributedSampler

    cls = {"DistributedSampler": DistributedSampler, "DistributedBatchSampler": DistributedBatchSampler}[case["sampler"]]
    job, world, args = f"golden-{case['name']}", case["writer_world"], case["args"]

    def write(rank: int) -> tuple[dict[str, Any], list[Any]]:
        s = cls(num_replicas=world, rank=rank, address=address, job=job, token="golden-writer", **args)
        s.set_epoch(case["epoch"])
        it = iter(s)
        taken = [next(it) for _ in range(case["taken"])]
        state = s.state_dict()
        s.close()
        return state, taken

    written = on_ranks(world, write)
    state = written[0][0]
    if any(w[0] != state for w in written):
        raise RuntimeError(f"the ranks wrote different states (got {[w[0] for w in written]})")
    reader = cls(num_replicas=1, rank=0, job=job, **args)  # world 1: the embedded coordinator
    reader.load_state_dict(state)
    rest = list(reader)
    reader.close()
    flat = [i for _, taken in written for item in taken for i in (item if isinstance(item, list) else [item])]
    flat += [i for item in rest for i in (item if isinstance(item, list) else [item])]
    if sorted(flat) != list(range(args["dataset"])):
        raise RuntimeError(f"fixture {case['name']!r}: written and read back is not every index once (got {sorted(flat)})")
    fmt, order_version = state["version"], state.get("order", 1)  # format 1 had no order key: order version 1
    return {
        "about": f"A checkpoint state of format {fmt} (order version {order_version}), written by {case['sampler']} "
                 f"at world {world} after {case['taken']} items per rank of epoch {case['epoch']}, and the items "
                 "the rest of that epoch yields at world 1. Keep forever (see tests/core/test_fixtures.py).",
        "format": fmt,
        "order": order_version,
        "sampler": case["sampler"],
        "job": job,
        "args": args,
        "written_at_world": world,
        "state": state,
        "world": 1,
        "rest": rest,
    }


def make_fixtures(names: Sequence[str]) -> list[pathlib.Path]:
    """Writes the fixtures of this release that are not on disk yet; returns their paths."""
    from croupier.server import Server

    server = Server("memory://").start()
    made = []
    try:
        for case in FIXTURE_CASES:
            if names and case["name"] not in names:
                continue
            fx = make_fixture(case, server.address)
            path = FIXTURES / f"checkpoint-v{fx['format']}-{case['name']}.json"
            if path.exists():
                print(f"kept {path.relative_to(TESTS.parent)} (fixtures are never overwritten)")
                continue
            FIXTURES.mkdir(exist_ok=True)
            path.write_text(compact(fx))
            made.append(path)
            print(f"wrote {path.relative_to(TESTS.parent)}")
    finally:
        server.stop(grace=0.5)
    return made


# --------------------------------------------------------------------------- golden mixtures

MIXTURES = TESTS / "golden" / "mixtures.json"
#: Mixtures by their spec's settings (weights as given to the samplers; the spec holds their parts):
#: two sources, a schedule with a capped source, in order, and a thousand sources far into the run.
MIXTURE_CASES: list[dict[str, Any]] = [
    dict(n=50, seed=7, sources=[13, 40], weights=[(0, [0.7, 0.3])]),
    dict(n=64, seed=11, sources=[5, 30, 200], weights=[(0, [5, 3, 2]), (100, [1, 1, 8])], max_epochs=[3, 0, 0]),
    dict(n=40, seed=0, sources=[9, 21, 4], weights=[(0, [1, 1, 1])], permutation="none"),
    dict(n=10**6, seed=5, sources=[1000 + k for k in range(1000)], weights=[(0, [1 + k % 7 for k in range(1000)])]),
    # each source in its shard order: 3, 4 and 2 shards, windows of 2 shards
    dict(n=60, seed=3, sources=[30, 44, 15], weights=[(0, [2, 3, 1])], permutation="shards",
         shards=[10, 12, 8, 11, 9, 13, 11, 7, 8], shard_window=2),
]
#: (epoch, first position, count) of each case: its first two epochs' starts, and one far along
MIXTURE_POINTS = [(0, 0, 24), (1, 0, 24), (123, 7, 16)]


def mixture_spec(case: dict[str, Any]) -> Any:
    """The spec of a golden mixture case."""
    from croupier.core.mixture import parts_of
    from croupier.core.spec import Spec

    kw = dict(case)
    kw["sources"] = tuple(kw["sources"])
    kw["weights"] = tuple((at, parts_of(w)) for at, w in kw["weights"])
    if "max_epochs" in kw:
        kw["max_epochs"] = tuple(kw["max_epochs"])
    if "shards" in kw:
        return Spec.with_shards(kw.pop("shards"), **kw)
    return Spec(**kw)


def make_mixtures() -> dict[str, Any]:
    """(index, source, source epoch, seed) at a few points of each golden mixture, by this release's engine."""
    from croupier.core.mixture import sample_seeds
    from croupier.core.permute import mixture_order
    from croupier.core.spec import ORDER_VERSION

    out = []
    for case in MIXTURE_CASES:
        spec = mixture_spec(case)
        points = []
        for epoch, first, count in MIXTURE_POINTS:
            idx, src, sep = mixture_order(spec, epoch, np.arange(first, first + count, dtype=np.int64))
            seeds = sample_seeds(spec.seed, src, sep, idx)
            points.append({"epoch": epoch, "first": first, "index": idx.tolist(), "source": src.tolist(),
                           "source_epoch": sep.tolist(), "seed": seeds.tolist()})
        out.append({"case": case, "points": points})
    return {"order_version": ORDER_VERSION, "mixtures": out}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").strip())
    ap.add_argument("what", choices=("orders", "fixtures", "mixtures"))
    ap.add_argument("--only", nargs="*", default=[], help="fixture names to write (default: all)")
    a = ap.parse_args(argv)
    if a.what == "orders":
        ORDERS.write_text(dump(make_orders()))
        print(f"wrote {ORDERS.relative_to(TESTS.parent)}")
    elif a.what == "mixtures":
        golden = make_mixtures()
        lines = [f'{{"order_version": {golden["order_version"]}, "mixtures": [']
        for k, m in enumerate(golden["mixtures"]):
            lines.append(f' {{"case": {json.dumps(m["case"])}, "points": [')
            lines += [f"  {json.dumps(p)}{',' if j < len(m['points']) - 1 else ''}" for j, p in enumerate(m["points"])]
            lines.append(f" ]}}{',' if k < len(golden['mixtures']) - 1 else ''}")
        lines.append("]}")
        MIXTURES.write_text("\n".join(lines) + "\n")
        print(f"wrote {MIXTURES.relative_to(TESTS.parent)}")
    else:
        make_fixtures(a.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
