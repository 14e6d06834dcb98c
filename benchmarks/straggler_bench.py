"""One slow rank among four: static dealing (fixed stripes) against dynamic dealing (the next batches to whoever asks).

Four worker processes with the torchrun environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ...) against one ``croupier serve`` (SQLite store, every deal journaled before
it is answered) go through one epoch each way; every rank works through its batches on its own
(no lockstep: inference, or DDP's ``Join``). Ranks 0-2 take ``t`` per batch and rank 3 takes
``2t`` (simulated work: a sleep). The epoch's time runs from the first batch any worker gets to
the last worker's end; ideal is the total work over the total speed,
``batches / (3 / t + 1 / (2 t))``. Static dealing gives each rank a quarter, so the slow rank
alone sets the time (1.75x ideal); dynamic dealing should come within 10% of ideal.

    python benchmarks/straggler_bench.py           # 2,000 batches of 8, t = 20 ms: about a minute
    python benchmarks/straggler_bench.py --quick   # 400 batches, t = 10 ms: seconds (tests/benchmarks/test_straggler_bench.py)

Prints a markdown table and writes it to ``OUT/straggler.md``; the full run exits 1 when
dynamic dealing misses its target. Every run also checks that each mode dealt every index once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORLD = 4
SLOW_RANK = 3
SLOWDOWN = 2.0
TARGET = 1.10  # dynamic dealing's epoch time over ideal, at most
MODES = ("static", "dynamic")


# ============================================================================ worker (child process)


def _worker(args: argparse.Namespace) -> None:
    """One rank: goes through its batches of one epoch, prints its timings as one JSON line."""
    import numpy as np

    from croupier.client import DistributedBatchSampler

    rank = int(os.environ["RANK"])
    per_batch = args.t_ms / 1000 * (SLOWDOWN if rank == SLOW_RANK else 1.0)
    if args.mode == "static":
        sampler = DistributedBatchSampler(args.n, args.batch, dealing="static", tail="uneven")
    else:
        sampler = DistributedBatchSampler(args.n, args.batch, dealing="dynamic", lockstep=False)
    seen: list[list[int]] = []
    first = 0.0
    waited = 0.0  # time spent waiting for the next batch (the dealing's cost the loop sees)
    it = iter(sampler)
    t = time.time()
    while True:
        try:
            batch = next(it)
        except StopIteration:
            break
        now = time.time()
        if not seen:
            first = now  # the join (waiting for the other ranks) is before this
        else:
            waited += now - t
        seen.append(batch)
        time.sleep(per_batch)  # simulated work: the model's time on one batch
        t = time.time()
    end = time.time()
    sampler.close()
    np.save(Path(args.indices) / f"{args.mode}-r{rank}.npy", np.asarray([i for b in seen for i in b], dtype=np.int64))
    print(json.dumps({"rank": rank, "first": first, "end": end, "batches": len(seen), "waited": waited}), flush=True)


# ================================================================================== driver (parent)


@dataclasses.dataclass
class Result:
    """One mode's epoch."""

    mode: str
    seconds: float  # first batch of any worker to the last worker's end
    batches: list[int]  # per rank
    waited_ms: list[float]  # per rank: mean wait for the next batch
    exactly_once: bool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _epoch(mode: str, address: str, args: argparse.Namespace, indices: Path) -> Result:
    """Runs one epoch on WORLD worker processes; their timings."""
    port = _free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("CROUPIER_")}
    procs = []
    for rank in range(WORLD):
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
               "LOCAL_WORLD_SIZE": str(WORLD), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(WORLD),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": f"straggler-{mode}",
               "TORCHELASTIC_RESTART_COUNT": "0", "OMP_NUM_THREADS": "1",
               "CROUPIER_ADDRESS": address, "CROUPIER_JOB": f"straggler-{mode}", "CROUPIER_INCARNATION": f"{mode}-1"}
        cmd = [sys.executable, __file__, "--worker", "--mode", mode, "--n", str(args.batches * args.batch),
               "--batch", str(args.batch), "--t-ms", str(args.t_ms), "--indices", str(indices)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    reports = []
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"{mode} rank {rank} exited {p.returncode}:\n{err[-3000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    reports.sort(key=lambda r: r["rank"])
    seconds = max(r["end"] for r in reports) - min(r["first"] for r in reports)
    return Result(mode, seconds, [r["batches"] for r in reports],
                  [1000 * r["waited"] / max(1, r["batches"] - 1) for r in reports], _exactly_once(mode, indices, args))


def _exactly_once(mode: str, indices: Path, args: argparse.Namespace) -> bool:
    import numpy as np

    got = np.concatenate([np.load(indices / f"{mode}-r{r}.npy") for r in range(WORLD)])
    counts = np.bincount(got, minlength=args.batches * args.batch)
    return bool(counts.size == args.batches * args.batch and (counts == 1).all())


def _table(results: list[Result], ideal: float, args: argparse.Namespace, quick: bool) -> str:
    t = args.t_ms
    rows = [
        f"Straggler: {WORLD} ranks, rank {SLOW_RANK} {SLOWDOWN:g}x slower; {args.batches} batches of {args.batch}, "
        f"t = {t:g} ms per batch ({SLOWDOWN * t:g} ms on rank {SLOW_RANK}); ideal = batches / (3/t + 1/(2t)) "
        f"= {ideal:.2f} s",
        "",
        "| mode | epoch time (s) | ideal (s) | ratio to ideal | batches per rank | mean wait for a batch (ms) "
        "| every index once |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    label = {"static": 'static (`tail="uneven"`: fixed stripes)', "dynamic": "dynamic (`lockstep=False`)"}
    for r in results:
        rows.append(f"| {label[r.mode]} | {r.seconds:.2f} | {ideal:.2f} | {r.seconds / ideal:.2f} | "
                    f"{' / '.join(map(str, r.batches))} | {' / '.join(f'{w:.2f}' for w in r.waited_ms)} | "
                    f"{'yes' if r.exactly_once else 'NO'} |")
    dyn = next(r for r in results if r.mode == "dynamic").seconds / ideal
    verdict = "not judged (--quick)" if quick else ("PASS" if dyn <= TARGET else "FAIL")
    rows += ["", f"target: dynamic within {100 * (TARGET - 1):.0f}% of ideal: ratio {dyn:.2f} -> {verdict}"]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="400 batches, t = 10 ms: seconds (what the test suite runs)")
    parser.add_argument("--batches", type=int, default=None, help="batches in the epoch (default 2000; --quick 400)")
    parser.add_argument("--batch", type=int, default=8, help="samples per batch (default 8)")
    parser.add_argument("--t-ms", type=float, default=None, help="simulated time per batch of a fast rank, ms "
                                                                 "(default 20; --quick 10)")
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="where straggler.md goes (default out/bench)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--indices", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    from croupier.tools.serve import ServeProcess

    args.batches = args.batches or (400 if args.quick else 2000)
    args.t_ms = args.t_ms or (10.0 if args.quick else 20.0)
    t = args.t_ms / 1000
    ideal = args.batches / ((WORLD - 1) / t + 1 / (SLOWDOWN * t))
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="croupier-straggler-") as tmp:
        server = ServeProcess(f"sqlite:///{tmp}/coordinator.db", sys.stderr).start()  # its log on this one's stderr
        try:
            results = []
            for mode in MODES:
                print(f"{mode}: {WORLD} workers ...", file=sys.stderr, flush=True)
                results.append(_epoch(mode, server.address, args, Path(tmp)))
        finally:
            server.terminate(30)
    table = _table(results, ideal, args, args.quick)
    took = time.monotonic() - began
    text = f"{table}\n\n(command: {' '.join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])])}; {took:.0f} s in all)\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "straggler.md").write_text(text)
    if not all(r.exactly_once for r in results):
        print("FAILED: a mode did not deal every index exactly once", file=sys.stderr)
        return 1
    dyn = results[1].seconds / ideal
    if not args.quick and dyn > TARGET:
        print(f"FAILED: dynamic dealing took {dyn:.2f}x ideal (target <= {TARGET:.2f})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
