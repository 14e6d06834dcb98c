"""Benchmark: `croupier provenance --export` of a long run to an OLMo-style order file, beside numpy writing the same array.

The run: a job of a global batch of 1,024 samples (batch_size 32) on 8 ranks, resized to 4 and back,
whose second restart rolls back 50 checkpoints, 1,000,000 optimizer steps on its timeline (1.024e9
samples, 4.1 GB of uint32). The export (``croupier.tools.provenance.export``) runs in a child
process of its own, so that its peak resident memory (``ru_maxrss``) is its own; the floor is
``np.save`` of the same array, already in memory, in another child. Before it: the step-by-step
export that this one replaced (one ``History.steps`` record a step, written into a memory map),
timed on the run's first steps and extrapolated. ``--profile`` saves a cProfile of the export.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import os
import platform
import pstats
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from provenance_bench import Params, build

from croupier.core.ledger import Ledger
from croupier.tools import provenance as prov

TARGET_S = 10.0
HERE = Path(__file__).resolve()


@dataclasses.dataclass(frozen=True)
class Shape:
    """The run exported, and how much of it the step-by-step export is timed on."""

    params: Params
    before_steps: int  # steps the step-by-step export writes (its time is extrapolated to the run)


def _params(n: int, batch_size: int, global_batch: int, steps: int, every: int, back: int) -> Params:
    # 3 generations: 8 ranks, then 4 (a resize), then 8 again resuming `back` checkpoints before where the
    # second stopped (a rollback); provenance_bench.build makes their segments as a coordinator records them
    return Params(n=n, batch_size=batch_size, global_batch=global_batch, worlds=(8, 4), steps=steps, generations=3,
                  every=every, rollback_every=2, back=(back, back + 1), queries=0, scans=0, prefix=0, seed=11)


FULL = Shape(_params(1024 * 125_000, 32, 1024, 10**6, 1000, 50), before_steps=2000)
QUICK = Shape(_params(64 * 250, 4, 64, 3000, 50, 5), before_steps=1000)


def ledger_of(shape: Shape) -> Ledger:
    run = build(shape.params)
    return Ledger("bench", run.spec, run.segments)


def step_by_step(led: Ledger, path: Path, steps: int) -> None:
    """The export as it was: each step's record from the history (kept and abandoned versions, with ranks,
    sources and seeds), its kept indices written into a memory map of the order file."""
    batch = led.constant_batch()
    assert batch is not None
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint32, shape=(steps * batch,))
    for first in range(1, steps + 1, 256):
        for rec in led.steps(first, min(steps, first + 255)):
            assert rec.kept is not None and rec.kept.indices.size == batch
            out[(rec.step - 1) * batch: rec.step * batch] = rec.kept.indices
    out.flush()
    del out


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB


# --------------------------------------------------------------------------- the children


def child_export(shape: Shape, out: Path, profile: Path | None) -> dict[str, Any]:
    """Builds the run's history, then times its export to `out` (with cProfile when `profile` names a file)."""
    led = ledger_of(shape)
    _ = led.last_step  # the timeline's chunks, as a coordinator's GetLedger answer would be read first
    rss0 = _maxrss_mb()
    prof = cProfile.Profile() if profile is not None else None
    t0, cpu0 = time.perf_counter(), time.process_time()
    if prof is not None:
        prof.enable()
    done = prov.export(led, out)
    if prof is not None:
        prof.disable()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if prof is not None and profile is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        profile.write_text(f"# cProfile of croupier.tools.provenance.export: {done.steps:,} steps of {done.batch:,} samples "
                           f"(load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores); the profiler's own cost "
                           f"included\n\n{text.getvalue()}")
    return {"seconds": seconds, "cpu": cpu, "rss_before_mb": rss0, "rss_peak_mb": _maxrss_mb(), "steps": done.steps,
            "batch": done.batch, "dtype": done.dtype, "bytes": out.stat().st_size}


def child_floor(src: Path, out: Path) -> dict[str, Any]:
    """``np.save`` of the order file's array, read into memory first (not timed)."""
    arr = np.fromfile(src, dtype=np.uint32, offset=128)  # the whole array in memory: the floor's input
    rss0 = _maxrss_mb()
    t0, cpu0 = time.perf_counter(), time.process_time()
    np.save(out, arr)
    return {"seconds": time.perf_counter() - t0, "cpu": time.process_time() - cpu0, "rss_before_mb": rss0,
            "rss_peak_mb": _maxrss_mb()}


def child_before(shape: Shape, out: Path) -> dict[str, Any]:
    led = ledger_of(shape)
    _ = led.last_step
    t0, cpu0 = time.perf_counter(), time.process_time()
    step_by_step(led, out, shape.before_steps)
    return {"seconds": time.perf_counter() - t0, "cpu": time.process_time() - cpu0}


def _in_child(*args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, str(HERE), "--child", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the child {args} failed:\n{proc.stdout}{proc.stderr}")
    out: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return out


def same_bytes(a: Path, b: Path, chunk: int = 1 << 24) -> bool:
    """Whether files `a` and `b` hold the same bytes (read in chunks)."""
    if a.stat().st_size != b.stat().st_size:
        return False
    with a.open("rb") as fa, b.open("rb") as fb:
        while True:
            x, y = fa.read(chunk), fb.read(chunk)
            if x != y:
                return False
            if not x:
                return True


# --------------------------------------------------------------------------- the run


def run(shape: Shape, quick: bool, folder: Path, profile: Path | None) -> int:
    p = shape.params
    load0 = os.getloadavg()[0]
    exported, floor_path, before_path = folder / "global_indices.npy", folder / "floor.npy", folder / "before.npy"
    mode = "quick" if quick else "full"
    ours = _in_child("export", mode, str(exported), *([str(profile)] if profile else []))
    floor = _in_child("floor", str(exported), str(floor_path))
    identical_floor = same_bytes(exported, floor_path)
    floor_path.unlink()
    before = _in_child("before", mode, str(before_path))
    prefix_ok = _prefix_agrees(exported, before_path, shape.before_steps * p.global_batch)
    before_path.unlink()
    load1 = os.getloadavg()[0]
    samples = ours["steps"] * ours["batch"]
    before_all = before["seconds"] * ours["steps"] / shape.before_steps
    growth = ours["rss_peak_mb"] - ours["rss_before_mb"]
    met = "met" if ours["seconds"] <= TARGET_S else f"missed ({ours['seconds'] / TARGET_S:.1f}x the target)"
    met = "- (the target is the full run's)" if quick else met
    print(f"## The run: {ours['steps']:,} steps of a global batch of {ours['batch']:,} (batch_size {p.batch_size}, worlds "
          f"8, 4, 8: a resize at each restart, the second a rollback of {p.back[0]} checkpoints), N = {p.n:,}; "
          f"{samples:,} samples, {ours['bytes'] / 1e9:,.2f} GB of {ours['dtype']}")
    print()
    print("| export to .npy | time | CPU time | samples/s | peak RSS (growth during the export) | target | verdict |")
    print("|---|---|---|---|---|---|---|")
    print(f"| croupier (History.kept_order, pieces of 2^20 samples) | {ours['seconds']:,.2f} s | {ours['cpu']:,.2f} s | "
          f"{samples / ours['seconds'] / 1e6:,.1f} M | {ours['rss_peak_mb']:,.0f} MB (+{growth:,.0f} MB) | "
          f"<= {TARGET_S:g} s, memory bounded | {met} |")
    print(f"| floor: np.save of the array in memory | {floor['seconds']:,.2f} s | {floor['cpu']:,.2f} s | "
          f"{samples / floor['seconds'] / 1e6:,.1f} M | "
          f"{floor['rss_peak_mb']:,.0f} MB (the array) | - | croupier {ours['seconds'] / floor['seconds']:,.1f}x the floor |")
    cpu_all = before["cpu"] * ours["steps"] / shape.before_steps
    print(f"| before: step by step (History.steps, a memory map) | {before_all:,.0f} s (extrapolated from "
          f"{shape.before_steps:,} steps: {before['seconds']:,.2f} s) | {cpu_all:,.0f} s | "
          f"{samples / before_all / 1e6:,.2f} M | - | - | "
          f"croupier {before_all / ours['seconds']:,.0f}x faster |")
    print()
    print(f"Identical: the export and np.save of its array: {'same bytes' if identical_floor else 'DIFFER'}; "
          f"the step-by-step export's {shape.before_steps:,} steps and the export's first ones: "
          f"{'same indices' if prefix_ok else 'DIFFER'}")
    print(f"(load average {load0:.2f} before, {load1:.2f} after, on {os.cpu_count()} cores)")
    return 0 if identical_floor and prefix_ok else 1


def _prefix_agrees(exported: Path, before: Path, entries: int) -> bool:
    ours, old = np.load(exported, mmap_mode="r"), np.load(before, mmap_mode="r")
    return old.shape == (entries,) and bool(np.array_equal(ours[:entries], old))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a run of 3,000 steps (seconds), for the suite")
    parser.add_argument("--profile", metavar="FILE", help="save a cProfile of the export (by own time) to FILE")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child)
    shape = QUICK if args.quick else FULL
    print(f"croupier export benchmark ({'quick' if args.quick else 'full'} run)")
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}, {os.cpu_count()} cores",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="export-bench-") as folder:
        t0 = time.perf_counter()
        code = run(shape, args.quick, Path(folder), Path(args.profile).resolve() if args.profile else None)
        print(f"({time.perf_counter() - t0:,.0f} s in all)")
    return code


def _child(argv: list[str]) -> int:
    what, rest = argv[0], argv[1:]
    if what == "floor":
        got = child_floor(Path(rest[0]), Path(rest[1]))
    else:
        shape = QUICK if rest[0] == "quick" else FULL
        if what == "export":
            got = child_export(shape, Path(rest[1]), Path(rest[2]) if len(rest) > 2 else None)
        else:
            got = child_before(shape, Path(rest[1]))
    print(json.dumps(got))
    return 0


if __name__ == "__main__":
    sys.exit(main())
