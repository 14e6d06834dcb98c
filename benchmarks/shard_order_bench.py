"""Benchmark: the shard order's speed and memory at web scale, beside torch's DistributedSampler.

One dataset of S shards of equal size (1e9 samples in 1e5 shards), a world of 512 ranks (64 nodes x
8), batches of 64, reader groups of 1 (the default) and of 8 (torchrun's local world). Measured:

* **epoch start**: ``plan_epoch`` and the first batch of one rank (``plan.lease``), with every cache
  of the order cleared first (a process that has never seen the epoch), for a fresh job and for a
  resume mid-epoch on another world (48 nodes x 8, from a checkpoint of the 512-rank run);
* **memory per shard**: what tracemalloc sees held once the plan is made and one batch leased (the
  epoch's table, the shards' offsets, the plan), and its peak while making them, over S;
* **position -> index**: ``ShardOrder.indices`` of one random position (median and p99 over many,
  after one pass that derives each window's keys);
* **a batch of 64**: ``plan.lease(rank, j, 1)``, the lease path a client uses, over successive
  batches of a few ranks (median and p99).

torch's ``DistributedSampler`` deals an epoch from ``randperm(N).tolist()``: its epoch start and
memory are O(N), so it runs at a smaller N (``--torch-n``, 1e7: at 1e8 its lists alone take about
5 GB, more than a shared machine should be asked for) and its figures are stated per sample.

    python benchmarks/shard_order_bench.py            # the full run (results/shard_order.md)
    python benchmarks/shard_order_bench.py --quick    # tiny sizes, a few seconds (tests/benchmarks)
    python benchmarks/shard_order_bench.py --profile  # also a cProfile of each missed target beside the results
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import datetime
import functools
import io
import itertools
import os
import platform
import pstats
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from croupier.core import feistel, shards
from croupier.core.cursor import Cursor
from croupier.core.registry import SHARDS, plan_epoch
from croupier.core.spec import Spec

ROOT = Path(__file__).resolve().parents[1]

#: What each target's cost is made of, and what would close it when missed (the profiles beside the results show it).
WHY = {
    "epoch start": "the epoch's table (a Feistel pass over the S shard ids, a gather and a cumulative sum: O(S) "
                   "numpy) and the asking rank's reader group (O(lanes) numpy calls); the rest of the plan is O(groups) "
                   "Python. Past the target, the table could be made once per epoch ahead of time (it is a pure "
                   "function of the seed and the epoch), or the shard order kept as a Feistel evaluated per slot.",
    "memory per shard": "the epoch's table (uint32 below 2**32 samples) and the shards' offsets.",
    "position -> index": "about two thirds is the window's Feistel walk in plain Python (6 rounds of ~16 int "
                         "operations a pass, 1.6 passes on average when the window holds 0.61 of its power-of-two "
                         "domain), the rest two binary searches and the caches' lookups. A compiled Feistel (a C "
                         "routine through ctypes, as benchmarks/shards_sim.py compiles its caches, or numba) is what "
                         "would close it.",
    "batch of 64": "one numpy pass of the Feistel network costs ~95 numpy calls whatever the size, and the walk "
                   "takes one or two before its last few elements are finished in plain Python; the lease's "
                   "bookkeeping (layout, windows, keys, slots) is ~50 numpy calls more. At numpy's per-call cost that "
                   "path stays several times the target; a compiled Feistel kernel for the walk (the same C routine) "
                   "would close most of it.",
}

#: The issue's targets (issue 50): (name, unit, bound).
TARGETS = {"epoch start": ("ms", 50.0), "memory per shard": ("B", 16.0), "position -> index": ("us", 5.0),
           "batch of 64": ("us", 50.0)}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """One run's sizes."""

    shards: int
    per_shard: int
    world: int
    resume_world: int
    batch: int
    repeats: int  # epoch starts timed (each from cold caches)
    lookups: int  # random positions timed
    leases: int  # batches timed
    torch_n: int


FULL = Sizes(shards=100_000, per_shard=10_000, world=512, resume_world=384, batch=64, repeats=5, lookups=20_000,
             leases=2_000, torch_n=10_000_000)
QUICK = Sizes(shards=2_000, per_shard=50, world=16, resume_world=12, batch=64, repeats=2, lookups=500, leases=100,
              torch_n=100_000)


@dataclasses.dataclass
class Row:
    """One measured figure: the median (and p99 where timed many times) beside its target."""

    measure: str
    setting: str
    value: float
    p99: float | None
    target: str
    note: str = ""

    @property
    def met(self) -> bool | None:
        got = TARGETS.get(self.target)
        return None if got is None else self.value <= got[1]


def _cold() -> None:
    """Clears every cache of the shard order and of its plans: as a process that has not seen the epoch."""
    for cache in (shards._epoch_table, shards._offsets, shards._window_keys, shards._window_rounds,
                  feistel.round_keys, SHARDS.make):
        cache.cache_clear()  # type: ignore[attr-defined]


def _start(spec: Spec, cursor: Cursor, world: int, rank: int) -> float:
    """Seconds from cold caches to `rank`'s first batch: the plan, then its lease."""
    _cold()
    t = time.perf_counter()
    plan = plan_epoch(spec, cursor, world, cursor.epoch)
    assert plan is not None
    plan.lease(rank, 0, 1)
    return time.perf_counter() - t


def _percentiles(ns: list[int]) -> tuple[float, float]:
    """(median, p99) of durations in ns, in us."""
    arr = np.sort(np.array(ns, dtype=np.float64)) / 1e3
    return float(np.median(arr)), float(arr[min(arr.size - 1, int(0.99 * arr.size))])


def _timed(calls: list[Callable[[], Any]]) -> tuple[float, float]:
    """(median, p99) in us of each call, timed one by one."""
    ns = []
    for call in calls:
        t = time.perf_counter_ns()
        call()
        ns.append(time.perf_counter_ns() - t)
    return _percentiles(ns)


def measure_order(sz: Sizes, group: int, profile: Path | None) -> list[Row]:
    """The four figures of the shard order at reader groups of `group` ranks."""
    spec = Spec.with_shards(np.full(sz.shards, sz.per_shard, dtype=np.int64), batch_size=sz.batch, seed=0,
                            reader_group=group)
    setting = f"reader_group {group}"
    fresh = Cursor(0, ((0, spec.n),))
    rows = []
    starts = [_start(spec, fresh, sz.world, 3) for _ in range(sz.repeats)]
    rows.append(Row("epoch start, fresh job", setting, statistics.median(starts) * 1e3, max(starts) * 1e3, "epoch start",
                    f"{sz.world} ranks; worst of {sz.repeats} in the p99 column"))
    plan = plan_epoch(spec, fresh, sz.world, 0)
    assert plan is not None
    mid = plan.advance(plan.steps(0) // 2)  # a checkpoint half way through the epoch
    starts = [_start(spec, mid, sz.resume_world, 3) for _ in range(sz.repeats)]
    rows.append(Row("epoch start, resume mid-epoch", setting, statistics.median(starts) * 1e3, max(starts) * 1e3,
                    "epoch start", f"{sz.world} -> {sz.resume_world} ranks, {len(mid.remaining)} intervals left"))
    if profile is not None and (rows[-2].met is False or rows[-1].met is False):
        _profile(profile / f"shard_order_profile_epoch_start_rg{group}.txt",
                 lambda: (_start(spec, fresh, sz.world, 3), _start(spec, mid, sz.resume_world, 3)))

    _cold()
    tracemalloc.start()
    plan = plan_epoch(spec, fresh, sz.world, 0)
    assert plan is not None
    plan.lease(3, 0, 1)
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    table = shards._epoch_table(shards.ShardOrder(spec.shards or b"", spec.seed, spec.shard_window), 0)
    parts = (f"table {(table.first.nbytes + table.cum.nbytes + table.wins.nbytes) / sz.shards:.2f} B "
             f"(first {table.first.dtype}, cum {table.cum.dtype}), offsets "
             f"{shards._offsets(spec.shards or b'').nbytes / sz.shards:.2f} B")
    rows.append(Row("memory per shard, held", setting, held / sz.shards, None, "memory per shard", parts))
    rows.append(Row("memory per shard, peak while made", setting, peak / sz.shards, None, "",
                    "the shard permutation and its sizes, freed once the table is made"))

    order = shards.ShardOrder(spec.shards or b"", spec.seed, spec.shard_window)
    rng = np.random.default_rng(group)
    positions = rng.integers(0, spec.n, sz.lookups)
    one = [np.array([p]) for p in positions.tolist()]
    expect = order.indices(0, positions)  # the vectorised path: the scalar one must agree
    got = np.array([int(order.indices(0, p)[0]) for p in one])  # also derives every window's keys once
    assert np.array_equal(got, expect), "the one-position path disagrees with the vectorised path"
    med, p99 = _timed([functools.partial(order.indices, 0, p) for p in one])
    rows.append(Row("position -> index", setting, med, p99, "position -> index", "ShardOrder.indices of one position"))
    if profile is not None and rows[-1].met is False:
        _profile(profile / f"shard_order_profile_position_rg{group}.txt", lambda: [order.indices(0, p) for p in one])

    ranks = [0, 3, sz.world // 2, sz.world - 1]
    per = sz.leases // len(ranks)
    for r in ranks:
        plan.lease(r, 0, 1)  # the rank's epoch start: what the lease of its next batches follows
    calls = [functools.partial(plan.lease, r, j, 1) for r in ranks for j in range(1, per + 1)]
    med, p99 = _timed(calls)
    rows.append(Row("batch of 64", setting, med, p99, "batch of 64",
                    f"plan.lease(rank, j, 1), j = 1..{per} of ranks {ranks}"))
    if profile is not None and rows[-1].met is False:
        _profile(profile / f"shard_order_profile_batch_rg{group}.txt", lambda: [c() for c in calls])
    return rows


def measure_torch(sz: Sizes) -> list[Row]:
    """torch's DistributedSampler at `sz.torch_n`: its epoch start (O(N)), memory and a batch of 64."""
    import torch.utils.data as tud

    n, world = sz.torch_n, sz.world
    data = range(n)
    starts, batches = [], []
    for _ in range(sz.repeats):
        sampler = tud.DistributedSampler(data, num_replicas=world, rank=3, shuffle=True, seed=0)  # type: ignore[arg-type]
        sampler.set_epoch(0)
        t = time.perf_counter()
        it = iter(sampler)
        list(itertools.islice(it, sz.batch))
        starts.append(time.perf_counter() - t)
        batches.append(_timed([functools.partial(_take, it, sz.batch) for _ in range(200)])[0])
        del it, sampler
    tracemalloc.start()
    sampler = tud.DistributedSampler(data, num_replicas=world, rank=3, shuffle=True, seed=0)  # type: ignore[arg-type]
    it = iter(sampler)
    next(it)
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del it, sampler
    setting = f"N = {n:.0e}"
    return [
        Row("epoch start", setting, statistics.median(starts) * 1e3, max(starts) * 1e3, "",
            f"O(N): {statistics.median(starts) * 1e3 / n * 1e9 / 1e3:,.0f} s at 1e9"),
        Row("memory per sample, held (peak)", setting, held / n, peak / n, "",
            f"Python lists of the epoch: {peak / n * 1e9 / 2**30:,.0f} GiB at 1e9 (tracemalloc; the randperm tensor "
            "is not traced)"),
        Row("batch of 64", setting, statistics.median(batches), None, "", "the next 64 of its iterator"),
    ]


def _take(it: Any, k: int) -> list[int]:
    return list(itertools.islice(it, k))


def _profile(path: Path, run: Callable[[], Any]) -> None:
    """A cProfile of `run` (top 30 by own time), written to `path`."""
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    path.write_text(out.getvalue())


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def render(sz: Sizes, rows: list[Row], torch_rows: list[Row], load: tuple[str, str], quick: bool) -> str:
    """The results page."""
    def fmt(x: float | None) -> str:
        return "" if x is None else f"{x:,.1f}" if x >= 10 else f"{x:,.2f}"

    lines = [
        "# Shard order: epoch start, memory and lookups at web scale",
        "",
        f"`python benchmarks/shard_order_bench.py{' --quick' if quick else ''}`, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, numpy {np.__version__}; load average "
        f"(1, 5, 15 min) {load[0]} at the start, {load[1]} at the end.",
        "",
        f"{sz.shards * sz.per_shard:.0e} samples in {sz.shards:,} shards of {sz.per_shard:,}, {sz.world} ranks, "
        f"batches of {sz.batch}, `shard_window` 32, `lanes` 16.",
        "",
        "## Targets",
        "",
        "| measure | setting | median | p99 / worst | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        unit, bound = TARGETS.get(r.target, ("", 0.0))
        unit = unit or ("B" if "memory" in r.measure else "")
        target = f"<= {bound:g} {unit}" if r.target else ""
        met = "" if r.met is None else "met" if r.met else "**missed**"
        lines.append(f"| {r.measure} | {r.setting} | {fmt(r.value)} {unit} | {fmt(r.p99)} | {target} | {met} |")
    lines += ["", "Notes:", ""]
    lines += [f"- {r.measure}, {r.setting}: {r.note}" for r in rows if r.note]
    missed = sorted({r.target for r in rows if r.met is False}, key=list(TARGETS).index)
    lines += ["", "## What each target costs", ""]
    lines += [f"- {name}{' (**missed** here)' if name in missed else ''}: {WHY[name]}" for name in TARGETS]
    lines += ["", "## torch's DistributedSampler", "",
              "| measure | setting | median | worst | note |", "|---|---|---|---|---|"]
    for r in torch_rows:
        unit = "ms" if "start" in r.measure else "B" if "memory" in r.measure else "us"
        lines.append(f"| {r.measure} | {r.setting} | {fmt(r.value)} {unit} | {fmt(r.p99)} | {r.note} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a few seconds)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="where shard_order.md goes")
    parser.add_argument("--profile", action="store_true", help="a cProfile of each missed target, beside the results")
    parser.add_argument("--torch-n", type=int, default=None, help="N for torch's DistributedSampler")
    args = parser.parse_args(argv)
    sz = QUICK if args.quick else FULL
    if args.torch_n is not None:
        sz = dataclasses.replace(sz, torch_n=args.torch_n)
    args.out.mkdir(parents=True, exist_ok=True)
    before = _load()
    rows = [row for group in (1, 8) for row in measure_order(sz, group, args.out if args.profile else None)]
    torch_rows = measure_torch(sz)
    text = render(sz, rows, torch_rows, (before, _load()), args.quick)
    (args.out / "shard_order.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
