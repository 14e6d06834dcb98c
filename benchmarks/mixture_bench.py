"""A mixture's first batch after a resume: croupier's position function beside a blended index built over every sample.

The peer is the blended index Megatron-style mixtures build at the start of a run: two arrays
over all N samples of the run (which source, int16, and which sample of it, int64), filled so
that each source's share is exact, then read at the resume position. Here it is built with
numpy (each source's k-th sample is given the ideal time (k + 0.5) / w, and the times are
sorted): compiled code builds it no faster than a sort of N keys. croupier's side builds the
mixture (its tree over the sources) and computes the batch at the resume position, with no
array over the samples.

Each point runs in a fresh process and reports the time from nothing to the first batch of
256 at the middle of the run, and the process's peak RSS growth. Points whose peer would need
more than --max-gib of memory are reported as out of reach, with the memory they would need.

    python benchmarks/mixture_bench.py                  # N = 1e6 .. 1e9, 2 .. 1000 sources
    python benchmarks/mixture_bench.py --quick          # small N: checks that it runs
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np

BATCH = 256
#: Fresh processes per croupier point; the fastest counts (the others met a busier machine)
REPEATS = 5


def _weights(sources: int) -> list[float]:
    rng = np.random.default_rng(sources)
    return list(rng.uniform(0.1, 1.0, sources))


def _sizes(n: int, sources: int) -> list[int]:
    base = n // sources
    return [base + (1 if s < n - base * sources else 0) for s in range(sources)]


def croupier_point(n: int, sources: int) -> dict[str, float]:
    from croupier.core.mixture import parts_of
    from croupier.core.permute import mixture_order
    from croupier.core.spec import Spec

    sizes, weights = _sizes(n, sources), _weights(sources)  # the inputs, not timed (the peer's neither)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    # What a resumed process does: the sampler makes the spec (its mixture's tree included) ...
    spec = Spec(n=n, seed=1, sources=tuple(sizes), weights=((0, parts_of(weights)),))
    made = time.perf_counter()
    # ... then, its state loaded, the first batch at the resume position (one epoch of N: its middle).
    idx, _, _ = mixture_order(spec, 0, np.arange(n // 2, n // 2 + BATCH, dtype=np.int64))
    took = time.perf_counter() - t
    assert len(idx) == BATCH
    return {"s": took, "setup": made - t, "batch": took - (made - t),
            "mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024}


def blended_point(n: int, sources: int) -> dict[str, float]:
    weights = _weights(sources)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    w = np.array(weights)
    w = w / w.sum()
    counts = np.floor(w * n).astype(np.int64)
    counts[: n - int(counts.sum())] += 1  # the rest, one each
    times = np.concatenate([(np.arange(c, dtype=np.float64) + 0.5) / w[s] for s, c in enumerate(counts)])
    order = np.argsort(times, kind="stable")
    del times
    source_index = np.repeat(np.arange(sources, dtype=np.int16), counts)[order]
    sample_index = (order - np.repeat(np.cumsum(counts) - counts, counts)[order]).astype(np.int64)
    del order
    made = time.perf_counter()
    mid = n // 2
    batch = (source_index[mid:mid + BATCH], sample_index[mid:mid + BATCH])
    took = time.perf_counter() - t
    assert len(batch[0]) == BATCH
    return {"s": took, "setup": made - t, "batch": took - (made - t),
            "mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024}


def _run(side: str, n: int, sources: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--point", side, str(n), str(sources)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


#: Bytes per sample the peer holds at its peak: float64 times, int64 order, int16 + int64 arrays
#: and the int64 temporaries of the gather.
PEER_BYTES = 8 + 8 + 2 + 8 + 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--max-gib", type=float, default=16.0, help="skip peer points needing more memory")
    ap.add_argument("--point", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        side, n, sources = args.point[0], int(args.point[1]), int(args.point[2])
        print(json.dumps((croupier_point if side == "croupier" else blended_point)(n, sources)))
        return
    ns = [10**5, 10**6] if args.quick else [10**6, 10**7, 10**8, 10**9]
    grid = [2, 10, 100, 1000]
    print(f"first batch of {BATCH} at the middle of the run, fresh process per point, best of {REPEATS} (seconds; "
          "peak RSS growth MiB). croupier: the spec (its mixture's tree) is made when the sampler is made, then "
          "the batch at the resume position; the blended index is built, then read")
    print("| N | sources | croupier s (spec + batch) | croupier batch s | croupier MiB | blended index s | "
          "blended index MiB | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    total: list[float] = []
    batch: list[float] = []
    for n in ns:
        for sources in grid:
            c = min((_run("croupier", n, sources) for _ in range(REPEATS)), key=lambda r: r["s"])
            total.append(c["s"])
            batch.append(c["batch"])
            mine = f"| {n:.0e} | {sources} | {c['s']:.4f} | {c['batch']:.4f} | {c['mib']:.0f} |"
            need = n * PEER_BYTES / 2**30
            if need > args.max_gib:
                print(f"{mine} out of reach (needs ~{need:.0f} GiB) | - | - |")
                continue
            b = _run("blended", n, sources)
            print(f"{mine} {b['s']:.3f} | {b['mib']:.0f} | {b['s'] / c['s']:.0f}x |", flush=True)
    print(f"\ncroupier, slowest over fastest across N and sources: the first batch after the resume "
          f"{max(batch) / min(batch):.2f}, spec and batch together {max(total) / min(total):.2f} (target <= 1.5)")

if __name__ == "__main__":
    main()
