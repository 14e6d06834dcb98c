"""Benchmark: token-budget batches (fill beside fixed-size batches) and the time to a first batch after a resume, by N."""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import numpy as np

from croupier.core.order import Cursor, fresh, order
from croupier.core.spec import Spec
from croupier.core.tokens import TokenPlan, token_plan

BUDGET = 8192
WINDOW = 4096
MEDIAN = 200
SIGMA = 1.0  # lognormal shape: a long tail (1 % of samples over 10x the median)
WORLD = 8
RESUME_WORLD = 6  # the resumed job runs on another world size
RESUME_STEPS = 3  # steps the earlier plan took before its state was saved
REPEATS = 5


def lengths_bytes(n: int, seed: int = 0) -> bytes:
    """n lognormal lengths (median MEDIAN) clipped to [1, BUDGET], as the little-endian int64 bytes Spec holds."""
    x = np.random.default_rng(seed).lognormal(np.log(MEDIAN), SIGMA, n)
    np.clip(x, 1, BUDGET, out=x)
    return x.astype("<i8").tobytes()


def _stats(spec: Spec, batches: list[np.ndarray]) -> dict[str, float]:
    """Fill (cost / budget), batches over budget and padding waste of index batches."""
    keys = spec.sort_keys
    tokens = np.array([keys[b].sum() for b in batches], dtype=np.float64)
    padded = np.array([keys[b].max() * len(b) for b in batches], dtype=np.float64)
    cost = tokens if spec.cost == "sum" else padded
    return {
        "batches": float(len(batches)),
        "fill": float(np.mean(cost / BUDGET)),
        "tokens": float(np.mean(tokens / BUDGET)),
        "over": float(np.mean(cost > BUDGET)),
        "waste": float(1 - tokens.sum() / padded.sum()),
    }


def _token_batches(p: TokenPlan) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for r in range(p.world):
        idx, sizes = p.lease(r, 0, 1 << 40)
        out += np.split(idx, np.cumsum(sizes)[:-1])
    return out


def fill_table(n: int) -> None:
    """Fill of token-budget batches beside fixed batches whose mean token count is the budget."""
    blob = lengths_bytes(n)
    mean = float(np.frombuffer(blob, dtype="<i8").mean())
    fixed = max(1, round(BUDGET / mean))
    print(f"## Fill: N = {n:,} lognormal lengths (median {MEDIAN}, sigma {SIGMA}, clipped to [1, {BUDGET}], "
          f"mean {mean:.0f}), budget {BUDGET}, window {WINDOW}, W = {WORLD}")
    print()
    print("| batching | cost | batches | mean fill (cost / budget) | mean tokens / budget | batches over budget "
          "| padding waste (padded tensor) |")
    print("|---|---|---|---|---|---|---|")
    for cost in ("sum", "padded"):
        spec = Spec(n=n, lengths=blob, max_tokens=BUDGET, cost=cost, token_window=WINDOW, tail="uneven")
        s = _stats(spec, _token_batches(token_plan(spec, fresh(spec, 0), WORLD)))
        print(f"| token budget | {cost} | {s['batches']:,.0f} | {s['fill']:.3f} | {s['tokens']:.3f} | {s['over']:.1%} "
              f"| {s['waste']:.1%} |")
    shuffled = order(Spec(n=n), 0, np.arange(n, dtype=np.int64))
    batches = [shuffled[i : i + fixed] for i in range(0, n - fixed + 1, fixed)]
    for cost in ("sum", "padded"):
        spec = Spec(n=n, lengths=blob, max_tokens=BUDGET, cost=cost, token_window=WINDOW, tail="uneven")
        s = _stats(spec, batches)
        print(f"| fixed batch_size={fixed} | {cost} | {s['batches']:,.0f} | {s['fill']:.3f} | {s['tokens']:.3f} "
              f"| {s['over']:.1%} | {s['waste']:.1%} |")
    print()
    print("Token-budget batches never go over the budget; a `sum` batch mixes long and short samples (for packed "
          "sequences), hence its padding waste were it padded.")


def _resume(spec: Spec, cursor: Cursor, rank: int) -> float:
    """Seconds from a saved cursor to rank's first batch: a new plan and one lease."""
    t0 = time.perf_counter()
    p = token_plan(spec, cursor, RESUME_WORLD)
    idx, sizes = p.lease(rank, 0, 1)
    elapsed = time.perf_counter() - t0
    assert len(sizes) == 1 and len(idx) == sizes[0] and p._packs <= 2
    return elapsed


def resume_table(sizes: list[int]) -> None:
    """Time to the first batch after a resume mid-epoch, by N."""
    print()
    print(f"## Resume: a plan of W = {WORLD} resumed at the middle of epoch 1 takes {RESUME_STEPS} steps; its "
          f"state resumes on W = {RESUME_WORLD} (median of {REPEATS}, one rank each)")
    print()
    print("| N | first batch after resume (ms) | peer: pack the rest of the epoch first (ms) | croupier vs peer "
          "| advance of the earlier plan (ms) | state intervals | spec construction (s, not in resume) |")
    print("|---|---|---|---|---|---|---|")
    medians = {}
    for n in sizes:
        blob = lengths_bytes(n)
        t0 = time.perf_counter()
        spec = Spec(n=n, lengths=blob, max_tokens=BUDGET, token_window=WINDOW, tail="pad")
        built = time.perf_counter() - t0
        del blob
        earlier = token_plan(spec, Cursor(epoch=1, remaining=((n // 2, n),)), WORLD)
        for r in range(WORLD):
            earlier.lease(r, 0, RESUME_STEPS)
        t0 = time.perf_counter()
        cursor = earlier.advance(RESUME_STEPS)
        advanced = time.perf_counter() - t0
        times = [_resume(spec, cursor, r % RESUME_WORLD) for r in range(REPEATS)]
        medians[n] = statistics.median(times)
        # The peer: a sampler that builds the epoch's batch list before its first batch (as samplers
        # that bucket by length at the epoch's start do), here the rest of the epoch from the state.
        t0 = time.perf_counter()
        token_plan(spec, cursor, RESUME_WORLD).steps(0)
        peer = time.perf_counter() - t0
        print(f"| {n:,} | {medians[n] * 1e3:.2f} | {peer * 1e3:,.0f} | **{peer / medians[n]:,.0f}x faster** "
              f"| {advanced * 1e3:.2f} | {len(cursor.remaining):,} | {built:.2f} |")
        del spec, earlier
    lo, hi = min(sizes), max(sizes)
    print()
    print(f"Ratio first batch after resume, N = {hi:,} / N = {lo:,}: {medians[hi] / medians[lo]:.2f}x "
          f"(data {hi // lo:,}x larger)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes (a few seconds)")
    args = parser.parse_args(argv)
    print(f"croupier token-budget batches benchmark ({'quick' if args.quick else 'full'} run)")
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}")
    print()
    fill_table(10**5 if args.quick else 10**6)
    resume_table([10**4, 10**5] if args.quick else [10**5, 10**6, 10**7, 10**8])
    return 0


if __name__ == "__main__":
    sys.exit(main())
