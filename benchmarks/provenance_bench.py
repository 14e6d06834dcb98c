"""Benchmark: a step's samples and a sample's steps from croupier's ledger, beside an OLMo-style order file and a step log."""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from croupier.core.cursor import Cursor, bind, fresh
from croupier.core.ledger import Ledger, Segment
from croupier.core.plan import EpochPlan
from croupier.core.registry import plan_epoch
from croupier.core.schedule import Schedule
from croupier.core.spec import Spec

STEP_TARGET_MS = 10.0
INDEX_TARGET_MS = 100.0
DTYPE = np.uint32  # OLMo writes its global indices as uint32 when the dataset's indices fit, as they do here


@dataclasses.dataclass(frozen=True)
class Params:
    """A run's shape: its data, its trainer's global batch, its worlds and its restarts."""

    n: int  # dataset size: a multiple of every world's round so that every step is a full global batch
    batch_size: int
    global_batch: int
    worlds: tuple[int, ...]  # world sizes the restarts move between (the first generation has the largest)
    steps: int  # optimizer steps of the timeline
    generations: int
    every: int  # checkpoint interval, in steps
    rollback_every: int  # every k-th restart rolls back a few checkpoints (a loss spike)
    back: tuple[int, int]  # how many checkpoints a rollback goes back (low, high exclusive)
    queries: int  # step and index queries of croupier, and step queries of the peers
    scans: int  # index queries of the peers (each a full scan)
    prefix: int  # entries of the peers' files measured (the first steps of the run)
    seed: int = 7


FULL = Params(n=12288 * 32500, batch_size=4, global_batch=12288, worlds=(512, 768, 1024), steps=10**6,
              generations=101, every=250, rollback_every=5, back=(2, 4), queries=200, scans=5, prefix=10**8)
QUICK = Params(n=48 * 40, batch_size=2, global_batch=48, worlds=(4, 6, 8), steps=1500, generations=11, every=10,
               rollback_every=5, back=(2, 4), queries=50, scans=5, prefix=48 * 1500)


# --------------------------------------------------------------------------- the run's history


@dataclasses.dataclass
class Run:
    """A run: its spec, the segments a coordinator records, and the steps every generation trained."""

    params: Params
    spec: Spec
    segments: list[Segment]
    trained: list[tuple[int, int, int]]  # (generation, first step, last step) of every generation

    @property
    def records(self) -> int:
        """Steps trained, kept or abandoned (a step log's records)."""
        return sum(last - first for _, first, last in self.trained)


#: Called with (generation, epoch's plan, world, accumulation, first step, last step) for each epoch of each
#: generation, by a trainer that takes the batches of steps first + 1 .. last (the plan's micro-batch 0 is
#: the first of step first + 1).
Trainer = Callable[[int, EpochPlan, int, int, int, int], None]


def restarts(p: Params) -> list[tuple[int, int, int]]:
    """(world, resume step, last step trained) of each generation: each resumes at a checkpoint of the one
    before, which trained past it (preempted after it, or, every `rollback_every`-th, rolled back)."""
    rng = np.random.default_rng(p.seed)
    resume = [0, *(round(k * p.steps / p.generations / p.every) * p.every for k in range(1, p.generations))]
    out, world = [], max(p.worlds)
    for k in range(p.generations):
        if k == p.generations - 1:
            end = p.steps
        else:
            back = int(rng.integers(*p.back)) if (k + 1) % p.rollback_every == 0 else 0
            end = resume[k + 1] + back * p.every + int(rng.integers(0, p.every))
        out.append((world, resume[k], end))
        world = int(rng.choice([w for w in p.worlds if w != world]))
    return out


def build(p: Params, trainer: Trainer | None = None) -> Run:
    """The run's segments, each generation's start a real checkpoint cursor: the plan of the epoch it was
    taken in, advanced by the micro-batches taken (as a sampler's state_dict names it)."""
    spec = Spec(n=p.n, seed=p.seed, batch_size=p.batch_size)
    segments: list[Segment] = []
    trained: list[tuple[int, int, int]] = []
    start, parent = fresh(spec, 0), None
    plan_list = restarts(p)
    for g, (world, s0, end) in enumerate(plan_list, 1):
        nxt = plan_list[g][1] if g < len(plan_list) else None
        a = p.global_batch // (p.batch_size * world)
        seg = Segment(g, f"inc{g}", world, bind(spec, start, world), s0, parent, Schedule(global_batch=p.global_batch))
        t, epoch, resume_at = s0, seg.start.epoch, None
        while t < end:
            plan = plan_epoch(spec, seg.start, world, epoch)
            assert plan is not None
            micro = max(plan.steps(r) for r in range(world))
            assert micro % a == 0, "every step must be a full global batch (an order file's layout)"
            first, last = t, min(end, t + micro // a)
            if trainer is not None:
                trainer(g, plan, world, a, first, last)
            for c in range(first - first % p.every + p.every, last + 1, p.every):
                seg.checkpoint(c)
                if c == nxt:
                    resume_at = plan.advance((c - first) * a)
            seg.report(epoch, min((last - first) * a, micro))
            t, epoch = last, epoch + 1
        segments.append(seg)
        trained.append((g, s0, end))
        if nxt is not None:
            assert resume_at is not None
            start, parent = resume_at, g
    return Run(p, spec, segments, trained)


def segment_bytes(seg: Segment) -> int:
    """What the coordinator keeps of a segment, msgpack-encoded."""
    cur: Cursor = seg.start
    return len(msgpack.packb([seg.generation, seg.incarnation, seg.world,
                              [cur.epoch, [list(iv) for iv in cur.remaining], cur.base_world], seg.step, seg.parent,
                              seg.schedule.to_list(), sorted(seg.reached.items()), seg.checkpoints]))


def deal_bytes() -> int:
    """One dynamic deal as the journal keeps it (a ``BatchesDealt`` event, msgpack-encoded)."""
    from croupier.server import BatchesDealt
    from croupier.server._events import encode_event

    return len(msgpack.packb(encode_event(BatchesDealt("job", 57, 1000, 17, 12_345_678, 2))))


# --------------------------------------------------------------------------- the peers


class Files:
    """The peers' files, written as a trainer trains: an OLMo-style order file of the kept steps (step T is
    entries (T - 1) x B .. T x B - 1; a rollback's steps overwrite what they replace) and a log with one
    msgpack record ``[step, generation, indices]`` per step trained, with an offset index."""

    def __init__(self, folder: Path, batch: int, steps: int) -> None:
        self.batch, self.order_path, self.log_path = batch, folder / "global_indices.npy", folder / "steps.log"
        self.order = np.lib.format.open_memmap(self.order_path, mode="w+", dtype=DTYPE, shape=(steps * batch,))
        self.log = self.log_path.open("wb")
        self.offsets: list[tuple[int, int]] = []  # (step, offset) of each record

    def write(self, step: int, generation: int, indices: np.ndarray) -> None:
        assert indices.size == self.batch, f"step {step} has {indices.size} samples, not {self.batch}"
        if step * self.batch <= self.order.size:
            self.order[(step - 1) * self.batch : step * self.batch] = indices
        self.offsets.append((step, self.log.tell()))
        self.log.write(msgpack.packb([step, generation, indices.astype(DTYPE).tobytes()]))

    def close(self) -> tuple[OrderFile, StepLog]:
        self.order.flush()
        del self.order
        self.log.close()
        np.save(self.log_path.with_suffix(".offsets.npy"), np.array(self.offsets, dtype=np.int64).reshape(-1, 2))
        return OrderFile(self.order_path, self.batch), StepLog(self.log_path)


def batch_by_batch(files: Files) -> Trainer:
    """A trainer that takes each rank's micro-batches from the plan one by one (the sampler's lease) and logs
    every step it trains: rank by rank, micro-batch by micro-batch."""
    def train(g: int, plan: EpochPlan, world: int, a: int, first: int, last: int) -> None:
        for t in range(first + 1, last + 1):
            k = (t - 1 - first) * a
            got = [plan.lease(rank, k + m, 1)[0] for rank in range(world) for m in range(a)]
            files.write(t, g, np.concatenate(got))
    return train


class OrderFile:
    """An OLMo-style ``global_indices.npy``, memory-mapped."""

    def __init__(self, path: Path, batch: int) -> None:
        self.path, self.batch = path, batch
        self.mm = np.load(path, mmap_mode="r")

    def step(self, t: int) -> np.ndarray:
        return np.array(self.mm[(t - 1) * self.batch : t * self.batch])

    def index(self, i: int, chunk: int = 1 << 24) -> list[int]:
        """The steps that trained `i`: every position of it, by a scan of the file."""
        out: list[int] = []
        for lo in range(0, self.mm.size, chunk):
            out.extend((lo + np.flatnonzero(self.mm[lo : lo + chunk] == i)) // self.batch + 1)
        return [int(s) for s in out]


class StepLog:
    """A per-step log of row ids, with an offset index (steps sorted, for a lookup by step)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        offsets = np.load(path.with_suffix(".offsets.npy"))
        by_step = np.argsort(offsets[:, 0], kind="stable")
        self.steps, self.offsets = offsets[by_step, 0], offsets[by_step, 1]
        self.end = path.stat().st_size

    def step(self, t: int) -> list[tuple[int, np.ndarray]]:
        """Every (generation, indices) logged for step `t`, in the order trained (the last one kept)."""
        lo, hi = np.searchsorted(self.steps, [t, t + 1])
        out = []
        with self.path.open("rb") as f:
            for off in self.offsets[lo:hi].tolist():
                f.seek(off)
                _, g, blob = next(msgpack.Unpacker(f, read_size=1 << 20))
                out.append((g, np.frombuffer(blob, dtype=DTYPE)))
        return out

    def index(self, i: int) -> list[tuple[int, int]]:
        """(step, generation) of every record that holds `i`: a scan of every record."""
        out = []
        with self.path.open("rb") as f:
            for t, g, blob in msgpack.Unpacker(f, read_size=1 << 24):
                out.extend([(t, g)] * int(np.count_nonzero(np.frombuffer(blob, dtype=DTYPE) == i)))
        return out


def drop_cache(path: Path) -> None:
    """Evicts `path` from the page cache (a cold read)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cold(path: Path, fn: Callable[[int], object], i: int) -> float:
    """Milliseconds of fn(i) with `path` out of the page cache."""
    drop_cache(path)
    t0 = time.perf_counter()
    fn(i)
    return (time.perf_counter() - t0) * 1e3


# --------------------------------------------------------------------------- agreement


def agree(ledger: Ledger, order: OrderFile, log: StepLog, steps: list[int], indices: list[int]) -> None:
    """Raises AssertionError unless the ledger, the order file and the step log say the same of each step
    (kept and abandoned versions) and of each index (its kept steps, and every (step, generation))."""
    for t in steps:
        rec = ledger.step(t)
        assert rec.kept is not None, f"step {t}: no kept version"
        logged = log.step(t)
        assert np.array_equal(rec.kept.indices, order.step(t)), f"step {t}: the ledger and the order file differ"
        assert logged and logged[-1][0] == rec.kept.generation, f"step {t}: kept by another generation in the log"
        assert np.array_equal(rec.kept.indices, logged[-1][1]), f"step {t}: the ledger and the step log differ"
        ab = sorted((v.generation, v.indices.tolist()) for v in rec.abandoned)
        assert ab == sorted((g, x.tolist()) for g, x in logged[:-1]), f"step {t}: abandoned versions differ"
    for i in indices:
        occ = ledger.index(i)
        prefix = order.mm.size // order.batch
        kept = sorted(o.step for o in occ if o.kept and o.step <= prefix)
        assert kept == order.index(i), f"index {i}: kept steps differ from the order file's"
        every = sorted((o.step, o.generation) for o in occ if o.step <= log.steps[-1])
        assert every == sorted(log.index(i)), f"index {i}: steps differ from the step log's"


# --------------------------------------------------------------------------- timing


def timed(fn: Callable[[Any], object], args: list[Any]) -> list[float]:
    """Milliseconds of fn(a) for each a, after one warm-up call."""
    fn(args[0])
    out = []
    for a in args:
        t0 = time.perf_counter()
        fn(a)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def verdict(ms: float, target: float) -> str:
    return "met" if ms < target else f"missed ({ms / target:.1f}x the target)"


def pct(ms: list[float], q: float) -> float:
    return float(np.percentile(ms, q))


def show(ms: float) -> str:
    return f"{ms:,.3f} ms" if ms < 10 else f"{ms:,.0f} ms" if ms < 10_000 else f"{ms / 1e3:,.1f} s"


def gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.2f} MB" if n >= 1e6 else f"{n / 1e3:,.1f} kB"


def ratio(peer: float, ours: float, better: str = "faster", worse: str = "slower") -> str:
    r = max(peer, ours) / min(peer, ours)
    return f"croupier {r:,.1f}x {better if peer >= ours else worse}" if r < 10 else \
        f"croupier {r:,.0f}x {better if peer >= ours else worse}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a small run whose three answers are checked to agree")
    args = parser.parse_args(argv)
    p = QUICK if args.quick else FULL
    rng = np.random.default_rng(p.seed + 1)
    print(f"croupier provenance benchmark ({'quick' if args.quick else 'full'} run)")
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}, {os.cpu_count()} cores")
    folder = Path(tempfile.mkdtemp(prefix="provenance-bench-"))
    before, t0 = os.getloadavg()[0], time.perf_counter()
    try:
        return _run(p, args.quick, rng, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        print(f"({time.perf_counter() - t0:.0f} s in all; load average {before:.2f} before, "
              f"{os.getloadavg()[0]:.2f} after, on {os.cpu_count()} cores; a query is CPU-bound)")


def _run(p: Params, quick: bool, rng: np.random.Generator, folder: Path) -> int:
    t0 = time.perf_counter()
    prefix_steps = p.prefix // p.global_batch
    files = Files(folder, p.global_batch, prefix_steps)
    run = build(p, batch_by_batch(files) if quick else None)
    built = time.perf_counter() - t0
    worlds = sorted({s.world for s in run.segments})
    rollbacks = sum(1 for (_, _, end), s in zip(run.trained, run.segments[1:]) if s.step is not None
                    and end - s.step >= p.every)
    print()
    print(f"## The run: {p.steps:,} steps of a global batch of {p.global_batch:,} (batch_size {p.batch_size}, "
          f"accumulation {', '.join(str(p.global_batch // (p.batch_size * w)) for w in worlds)} on worlds "
          f"{', '.join(map(str, worlds))}), N = {p.n:,} ({p.steps * p.global_batch / p.n:.1f} epochs), "
          f"{len(run.segments)} generations ({len(run.segments) - 1} restarts, each a resize; "
          f"{rollbacks} of them past a checkpoint), {run.records - p.steps:,} steps abandoned, "
          f"checkpoints every {p.every} steps (history built in {built * 1e3:,.0f} ms)")
    t0 = time.perf_counter()
    ledger = Ledger("bench", run.spec, run.segments)
    made = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    assert ledger.last_step == p.steps, ledger.last_step
    first_query = ledger.step(p.steps)
    warm = (time.perf_counter() - t0) * 1e3
    assert first_query.kept is not None and first_query.kept.indices.size == p.global_batch
    print(f"Ledger built in {made:.2f} ms; its first query (the chunks of every generation, cached) {warm:.1f} ms")
    steps = rng.integers(1, p.steps + 1, p.queries).tolist()
    indices = rng.integers(0, p.n, p.queries).tolist()
    c_step = timed(ledger.step, steps)
    c_index = timed(ledger.index, indices)
    stored = [segment_bytes(s) for s in run.segments]

    if not quick:  # the peers' files: the first steps of the run, as the ledger answers them
        t0 = time.perf_counter()
        for t in range(1, prefix_steps + 1):
            rec = ledger.step(t)
            assert rec.kept is not None
            for v in (*rec.abandoned, rec.kept):
                files.write(t, v.generation, v.indices)
        print(f"Peers' files of the first {prefix_steps:,} steps written in {time.perf_counter() - t0:.0f} s")
    order, log = files.close()
    entries, records = order.mm.size, len(log.steps)
    p_steps = rng.integers(1, prefix_steps + 1, p.queries).tolist()
    o_step = timed(order.step, p_steps)
    l_step = timed(log.step, p_steps)
    o_index = timed(order.index, indices[: p.scans])
    l_index = timed(log.index, indices[: p.scans])
    if quick:
        agree(ledger, order, log, list(range(1, p.steps + 1)), indices)
        print(f"Agreement: the ledger, the order file and the step log agree on all {p.steps:,} steps (kept and "
              f"abandoned versions) and on {len(indices)} indices")
    else:
        agree(ledger, order, log, p_steps[:20], indices[:2])
        print("Agreement: the ledger, the order file and the step log agree on 20 of the peers' steps and 2 indices")
    path = order.path
    del order  # a page mapped by a process stays in the page cache: unmap before the cold scan
    cold_o = cold(path, lambda i: OrderFile(path, p.global_batch).index(i), indices[0])
    cold_l = cold(log.path, log.index, indices[0])

    full_entries = p.steps * p.global_batch
    x_o, x_l = full_entries / entries, run.records / records
    rec_bytes = log.end / records
    o_bytes = full_entries * np.dtype(DTYPE).itemsize + 128
    l_bytes = run.records * (rec_bytes + 16)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print()
    print(f"## Queries: croupier over the whole run; the peers measured on their first {entries:,} entries "
          f"({prefix_steps:,} steps, page cache warm), their scans extrapolated linearly to the whole run "
          f"({full_entries:,} entries; {run.records:,} log records)")
    print()
    print("| query | croupier | order file (memmap) | step log (msgpack records, offset index) | target | met |")
    print("|---|---|---|---|---|---|")
    for q in (50, 99):
        ours, o, lg = pct(c_step, q), pct(o_step, q), pct(l_step, q)
        print(f"| step T, p{q} | {show(ours)} | {show(o)} ({ratio(o, ours)}) | {show(lg)} ({ratio(lg, ours)}) "
              f"| < {STEP_TARGET_MS:.0f} ms | {verdict(ours, STEP_TARGET_MS)} |")
    for q in (50, 99):
        ours, o, lg = pct(c_index, q), pct(o_index, q), pct(l_index, q)
        print(f"| index I, p{q} | {show(ours)} | measured {show(o)}; whole run {show(o * x_o)} "
              f"({ratio(o * x_o, ours)}) | measured {show(lg)}; whole run {show(lg * x_l)} ({ratio(lg * x_l, ours)}) "
              f"| < {INDEX_TARGET_MS:.0f} ms | {verdict(ours, INDEX_TARGET_MS)} |")
    print(f"| index I, one scan from disk (page cache dropped) | - | measured {show(cold_o)}; whole run "
          f"{show(cold_o * x_o)} | measured {show(cold_l)}; whole run {show(cold_l * x_l)} | - | - |")
    ckpt = sum(len(msgpack.packb(s.checkpoints)) for s in run.segments)
    print(f"| bytes at {p.steps:,} steps | {gb(sum(stored))} ({len(stored)} segments, {sum(stored) / len(stored):,.0f} "
          f"B each, {gb(ckpt)} of them the checkpoints' steps) | {gb(o_bytes)} "
          f"({ratio(o_bytes, sum(stored), 'smaller', 'larger')}) | {gb(l_bytes)} "
          f"({ratio(l_bytes, sum(stored), 'smaller', 'larger')}) | grows with generations and checkpoints, not "
          f"steps x ranks | - |")
    print()
    print(f"Queries: croupier {p.queries} steps and {p.queries} indices drawn uniformly (after one warm-up each); "
          f"peers {p.queries} steps of their prefix and {p.scans} index scans (of the same indices).")
    fits = "fit in" if max(o_bytes, l_bytes) < ram else "are larger than"
    print(f"The peers' whole-run scans are their prefix's times x {x_o:,.1f} (order file) and x {x_l:,.1f} (step "
          f"log), page cache warm: the peers' best case. Their files at full size ({gb(o_bytes)}, {gb(l_bytes)}) "
          f"{fits} this machine's memory ({gb(ram)}){'' if fits == 'fit in' else ': a scan reads them from disk'}.")
    print(f"Bytes: a log record is {rec_bytes:,.0f} B (+16 B of offset index); the order file holds "
          f"{np.dtype(DTYPE).name}; croupier's segments {min(stored):,} to {max(stored):,} B (world, start cursor, "
          f"step, parent, schedule, reports, checkpoints).")
    per_deal = deal_bytes()
    micro = p.steps * p.global_batch // p.batch_size
    print(f"Dynamic dealing (not this run): the journal keeps a deal per lease call, {per_deal} B each; at the "
          f"default lease of 2 batches this run's {micro:,} micro-batches would be {micro // 2:,} deals, "
          f"{gb(micro // 2 * per_deal)}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
