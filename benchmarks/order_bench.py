"""Benchmark: the Feistel order at N = 1e9 (first-batch latency, memory, rate) beside torch's DistributedSampler."""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import cast

# One core: numpy's elementwise ops are single-threaded anyway; this keeps BLAS and torch there too.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

from croupier.core import feistel as _feistel  # noqa: E402
from croupier.core.order import Cursor, fixed_plan, fresh, order  # noqa: E402
from croupier.core.spec import Spec  # noqa: E402

TABLE_HEADER = (
    "| N | croupier feistel first batch (ms) | torch DistributedSampler first batch (ms) | torch / croupier "
    "| croupier peak RSS growth (MiB) | torch peak RSS growth (MiB) |"
)
LATENCY_TARGET_MS = 10.0
RATE_TARGET = 5e6
MIB = 1024 * 1024


# --------------------------------------------------------------------------- memory


def _reset_peak() -> bool:
    """Resets the kernel's peak-RSS mark (VmHWM) of this process; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    """Peak resident set size of this process in bytes (since the last reset, where supported)."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"VmHWM:\s+(\d+) kB", f.read())
        if m:
            return int(m.group(1)) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def _current_rss() -> int:
    """Current resident set size in bytes."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"VmRSS:\s+(\d+) kB", f.read())
        if m:
            return int(m.group(1)) * 1024
    except OSError:
        pass
    return _peak_rss()


@dataclass
class Measured:
    """Wall times of repeated calls (ms) and how far the peak RSS rose above the RSS before them."""

    times_ms: list[float]
    peak_growth: int

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)


def _measure(calls: list[Callable[[], object]]) -> Measured:
    """Runs each call once, timing it; the peak RSS is measured over all of them."""
    _reset_peak()
    base = _current_rss()
    times = []
    keep = []  # hold every result until the peak is read, as a training loop holds its sampler
    for call in calls:
        t0 = time.perf_counter()
        keep.append(call())
        times.append((time.perf_counter() - t0) * 1e3)
    growth = max(0, _peak_rss() - base)
    del keep
    return Measured(times, growth)


# --------------------------------------------------------------------------- the two samplers


def _croupier_first_batch(spec: Spec, position: int, world: int, rank: int) -> np.ndarray:
    """The first batch of `rank` for a job resumed at `position` of epoch 1 (a fresh epoch at 0)."""
    cursor = fresh(spec, 1) if position == 0 else Cursor(epoch=1, remaining=((position, spec.n),))
    batch = fixed_plan(spec, cursor, world).batch_indices(rank, 0)
    assert batch is not None
    return batch


def _torch_first_batch(n: int, world: int, rank: int, batch_size: int) -> list[int]:
    """The first batch of torch's sampler in epoch 1: set_epoch, iter, take batch_size indices."""
    dataset = cast("Dataset[int]", range(n))  # any sized object will do, as in torch's own tests
    sampler: DistributedSampler[int] = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(1)
    it = iter(sampler)
    return [next(it) for _ in range(batch_size)]


def _rate(fn: Callable[[np.ndarray], np.ndarray], n: int, chunk: int, seconds: float) -> float:
    """Indices per CPU-second of `fn` over consecutive chunks of positions of [0, n)."""
    rng = np.random.default_rng(0)
    fn(np.arange(chunk, dtype=np.int64))  # warm up
    done = 0
    t0 = time.process_time()
    while (elapsed := time.process_time() - t0) < seconds:
        start = int(rng.integers(0, n - chunk))
        fn(np.arange(start, start + chunk, dtype=np.int64))
        done += chunk
    return done / elapsed


# --------------------------------------------------------------------------- report


def _fmt_n(n: int) -> str:
    return f"{n:,}"


def _mib(b: int) -> str:
    return f"{b / MIB:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes and shorter runs (a few seconds)")
    parser.add_argument("--n", type=int, default=10**9, help="dataset size for the Feistel figures (default 1e9)")
    parser.add_argument("--world", type=int, default=8, help="world size W (default 8)")
    parser.add_argument("--batch-size", type=int, default=1024, help="indices per batch (default 1024)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    n, world, batch = args.n, args.world, args.batch_size
    positions_count = 8 if args.quick else 32
    rate_seconds = 0.5 if args.quick else 5.0
    torch_sizes = [10**5, 10**6] if args.quick else [10**6, 10**7]
    rng = np.random.default_rng(2024)

    print(f"croupier order engine benchmark ({'quick' if args.quick else 'full'} run)")
    print(f"python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}, "
          f"1 thread, {platform.machine()}")
    print(f"peak RSS reset per measurement: {'yes (VmHWM)' if _reset_peak() else 'no (peak since start)'}")

    spec = Spec(n=n, seed=0, permutation="feistel", batch_size=batch)
    _croupier_first_batch(Spec(n=1000, permutation="feistel", batch_size=batch), 0, world, 0)  # warm up imports

    # First batch at random positions of a 1e9 epoch: a resume anywhere costs the same as a start.
    picks = [(int(p), int(r)) for p, r in zip(rng.integers(0, n - batch * world, positions_count),
                                              rng.integers(0, world, positions_count))]
    rss_before = _current_rss()
    first = _measure([partial(_croupier_first_batch, spec, p, world, r) for p, r in picks])
    rss_after_first = _current_rss()

    # Vectorised rate, one core: the engine's order() and the bare Feistel permute().
    chunk = 1 << 20
    keys = _feistel.round_keys(_feistel.derive_key(0, 1, 0, 0))
    _reset_peak()
    rate_order = _rate(lambda pos: order(spec, 1, pos), n, chunk, rate_seconds)
    rate_permute = _rate(lambda pos: _feistel.permute(pos, n, keys), n, chunk, rate_seconds)
    peak_after_rate = _peak_rss()

    print()
    print(f"Feistel order at N = {_fmt_n(n)}, W = {world}, batch_size = {batch}")
    print(f"  first batch at {len(picks)} random positions: median {first.median_ms:.3f} ms, "
          f"max {max(first.times_ms):.3f} ms (target < {LATENCY_TARGET_MS:g} ms: "
          f"{'met' if max(first.times_ms) < LATENCY_TARGET_MS else 'MISSED'})")
    print(f"  RSS: {_mib(rss_before)} MiB before, {_mib(rss_after_first)} MiB after the first batches "
          f"(peak growth {_mib(first.peak_growth)} MiB); peak {_mib(peak_after_rate)} MiB while permuting "
          f"chunks of {_fmt_n(chunk)} positions")
    print(f"  vectorised rate, per core: order() {rate_order / 1e6:.1f} M indices/s, "
          f"permute() {rate_permute / 1e6:.1f} M indices/s (target >= {RATE_TARGET / 1e6:g} M/s: "
          f"{'met' if rate_order >= RATE_TARGET else 'MISSED'})")

    # Side by side with torch: the same first batch (epoch 1, rank 0) at sizes torch can hold.
    print()
    print(f"First batch of rank 0 (W = {world}, batch_size = {batch}); croupier at random resume positions, "
          "torch from the start (a torch resume costs the same randperm, plus skipping)")
    print(TABLE_HEADER)
    print("|" + "---|" * 6)
    repeats = 3 if args.quick else 5
    for size in torch_sizes:
        s = Spec(n=size, seed=0, permutation="feistel", batch_size=batch)
        pos = [int(p) for p in rng.integers(0, size - batch * world, repeats)]
        ours = _measure([partial(_croupier_first_batch, s, p, world, 0) for p in pos])
        theirs = _measure([partial(_torch_first_batch, size, world, 0, batch) for _ in range(repeats)])
        print(f"| {_fmt_n(size)} | {ours.median_ms:.3f} | {theirs.median_ms:.1f} | "
              f"{theirs.median_ms / ours.median_ms:,.0f}x | {_mib(ours.peak_growth)} | {_mib(theirs.peak_growth)} |")
    print(f"| {_fmt_n(n)} | {first.median_ms:.3f} | not run (a randperm of {_fmt_n(n)} int64 is "
          f"{n * 8 / 2**30:.0f} GiB before .tolist()) | - | {_mib(first.peak_growth)} | - |")

    # A sample order, to see what a rank gets: the first batch of each rank, epoch 0.
    sample = Spec(n=n, seed=0, permutation="feistel", batch_size=6)
    p = fixed_plan(sample, fresh(sample, 0), 4)
    print()
    print(f"Sample: epoch 0 of N = {_fmt_n(n)}, feistel, seed 0, W = 4, batch_size = 6, first batch of each rank")
    for r in range(4):
        b = p.batch_indices(r, 0)
        print(f"  rank {r}: {[] if b is None else b.tolist()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
