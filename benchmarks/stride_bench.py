"""The start and the stride, and leases: a fresh job's first batch, the steady DataLoader loop, the Lease RPC, beside their peers.

Three parts, each beside its peer in the same run (method: benchmarks/README.md, "The start and the stride"):

- start: a fresh job's first batch of 256 through a DataLoader, from making the sampler, against a
  `croupier serve` on loopback (SQLite store): one rank alone (the other 7 joined before it) and all
  8 ranks in one process (a thread each), at N = 5e5, 5e7, 5e8; beside one rank of torch's
  DistributedSampler at 5e7 (targets: one rank <= 10 ms, 8 ranks <= 20 ms, >= 100x torch's at 5e7);
- stride: indices/s of a DataLoader loop after each epoch's first batch, N = 1e6, batch 256, with
  `sampler=` and `batch_sampler=`, croupier embedded (a `Server` in the process) and standalone
  (`croupier serve`), beside torch's sampler, in interleaved rounds: each round's ratio, the median
  round and the worst (target: >= 1.0x torch);
- leases: the Lease RPC (65,536 indices of N = 1e8) beside an empty gRPC call on the same server:
  one rank back to back, 64 ranks paced as bench.py paces them (a lease every 25.6 s per rank; the
  call timed is each rank's next lease, one interval after its first) and 64 ranks back to back
  (targets: paced p50 <= 2x the empty call's; saturated >= 50% of its rate).

``--quick``: small sizes, one round, short runs (tests/benchmarks/test_stride_bench.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baseline  # noqa: E402  (an older commit's coordinator, --baseline)
import bench  # noqa: E402  (the suite's shared helpers: coordinators, datasets, load drivers)

WORLD, RANK, BATCH = 8, 3, 256
TARGET_RANK_MS, TARGET_WORLD_MS, TARGET_START_X = 10.0, 20.0, 100.0
TARGET_STRIDE_X = 1.0
TARGET_LEASE_X, TARGET_LEASES_OF_FLOOR = bench.TARGET_LEASE_X, bench.TARGET_LEASES_OF_FLOOR
TORCH_START_N = 5 * 10**7
#: The benchmark's parts, in the order they run (``--parts``).
PARTS = ("start", "stride", "leases")


# --------------------------------------------------------------------------- start


def _first_batch(make: Callable[[], Any], dataset: Any) -> tuple[float, Any]:
    """Seconds from making a sampler to its first batch through a DataLoader; the sampler."""
    from torch.utils.data import DataLoader

    t0 = time.perf_counter()
    s = make()
    batch = next(iter(DataLoader(dataset, batch_size=BATCH, sampler=s)))
    seconds = time.perf_counter() - t0
    if len(batch) != BATCH:
        raise RuntimeError(f"a first batch of {len(batch)} indices, not {BATCH}")
    return seconds, s


def _start_alone(address: str, n: int, job: str) -> float:
    """Rank 0's first batch, ranks 1 .. WORLD - 1 joined before it."""
    from croupier.client import DistributedSampler

    dataset = bench._index_dataset(n)
    spec = DistributedSampler(n, WORLD, 0, address=address, job=job, incarnation="g1").spec  # never joins
    bench._join_others(address, job, spec, "g1")
    seconds, s = _first_batch(lambda: DistributedSampler(dataset, num_replicas=WORLD, rank=0, address=address, job=job,
                                                         incarnation="g1"), dataset)
    s.close()
    return seconds


def _start_world(address: str, n: int, job: str) -> tuple[float, float]:
    """All WORLD ranks of a fresh job in this process, a thread each: (rank RANK's first batch, the last rank's)."""
    from croupier.client import DistributedSampler

    dataset = bench._index_dataset(n)
    took: dict[int, float] = {}
    made: list[Any] = []
    errors: list[BaseException] = []
    begin = time.perf_counter()

    def rank(r: int) -> None:
        try:
            seconds, s = _first_batch(lambda: DistributedSampler(dataset, num_replicas=WORLD, rank=r, address=address,
                                                                 job=job, incarnation="g1"), dataset)
            took[r] = seconds
            made.append(s)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = time.perf_counter() - begin
    for s in made:
        s.close()
    if errors:
        raise errors[0]
    return took[RANK], every


def _start_torch(n: int) -> float:
    from torch.utils.data.distributed import DistributedSampler as TorchSampler

    seconds, _ = _first_batch(lambda: TorchSampler(bench._index_dataset(n), num_replicas=WORLD, rank=RANK, seed=0),
                              bench._index_dataset(n))
    return seconds


def measure_start(sizes: list[int], rounds: int, torch_rounds: int) -> dict[str, Any]:
    """Milliseconds to the first batch of fresh jobs, croupier (alone and 8 in a process) and torch."""
    out: dict[str, Any] = {}
    jobs = itertools.count()
    with tempfile.TemporaryDirectory() as tmp, bench._serve_process(f"sqlite:///{tmp}/start.db") as address:
        _start_world(address, sizes[0], "warm-up")  # this process's first sampler: the lease helper's start
        for n in sizes:
            alone, rank, every = [], [], []
            for _ in range(rounds):  # interleaved: one alone, then one of 8 ranks
                alone.append(_start_alone(address, n, f"alone-{next(jobs)}") * 1e3)
                r, e = _start_world(address, n, f"world-{next(jobs)}")
                rank.append(r * 1e3)
                every.append(e * 1e3)
            out[str(n)] = {"alone": alone, "rank": rank, "every": every}
    torch_n = min(TORCH_START_N, sizes[-1])
    out["torch"] = {"n": torch_n, "ms": [_start_torch(torch_n) * 1e3 for _ in range(torch_rounds)]}
    return out


# --------------------------------------------------------------------------- stride


def measure_stride(n: int, epochs: int, rounds: int) -> dict[str, list[float]]:
    """Indices/s after each epoch's first batch, per round, of each loop (interleaved in every round)."""
    from torch.utils.data import BatchSampler, DataLoader
    from torch.utils.data.distributed import DistributedSampler as TorchSampler

    from croupier.client import DistributedBatchSampler, DistributedSampler

    dataset = bench._index_dataset(n)
    jobs = itertools.count()
    Loop = tuple[Any, Callable[[int], None], Callable[[], None]]

    def croupier(address: str, batches: bool) -> Loop:
        job = f"stride-{next(jobs)}"
        s: Any
        if batches:
            s = DistributedBatchSampler(dataset, BATCH, num_replicas=WORLD, rank=0, address=address, job=job,
                                        incarnation="g1")
            loader = DataLoader(dataset, batch_sampler=s)
        else:
            s = DistributedSampler(dataset, num_replicas=WORLD, rank=0, address=address, job=job, incarnation="g1")
            loader = DataLoader(dataset, batch_size=BATCH, sampler=s)
        bench._join_others(address, job, s.spec, "g1")
        return loader, s.set_epoch, s.close

    def torch(batches: bool) -> Loop:
        s: TorchSampler[int] = TorchSampler(dataset, num_replicas=WORLD, rank=0, shuffle=True, seed=0)
        loader = (DataLoader(dataset, batch_sampler=BatchSampler(s, BATCH, drop_last=False)) if batches
                  else DataLoader(dataset, batch_size=BATCH, sampler=s))
        return loader, s.set_epoch, lambda: None

    def rate(loop: Loop) -> float:
        loader, set_epoch, close = loop
        done, busy = 0, 0.0
        for epoch in range(epochs):
            set_epoch(epoch)
            it = iter(loader)
            next(it)  # the epoch's start is not the stride
            t0 = time.perf_counter()
            for batch in it:
                done += len(batch)
            busy += time.perf_counter() - t0
        close()
        return done / busy

    out: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp, bench._serve_process(f"sqlite:///{tmp}/stride.db") as remote, \
            bench._in_process_coordinator() as local:
        cases: dict[str, Callable[[], Loop]] = {
            "torch": lambda: torch(False), "embedded": lambda: croupier(local, False),
            "standalone": lambda: croupier(remote, False), "torch_batch": lambda: torch(True),
            "embedded_batch": lambda: croupier(local, True), "standalone_batch": lambda: croupier(remote, True),
        }
        for name in ("embedded", "standalone"):  # warm-up: each coordinator's first job, the lease helper's start
            rate(cases[name]())
        for _ in range(rounds):
            for name, make in cases.items():
                out.setdefault(name, []).append(rate(make()))
    return out


# --------------------------------------------------------------------------- leases


def measure_leases(seconds: float, paced_s: float, ranks: int,
                   servings: tuple[baseline.Serving, ...] = (baseline.CURRENT,)) -> dict[str, dict[str, Any]]:
    """The Lease RPC beside an empty call on a `croupier serve` of each serving: one rank, `ranks` paced,
    `ranks` saturated; each phase run on every serving in turn (the same drivers), by serving name."""
    from croupier.core.spec import Spec

    spec = Spec(n=bench.CAPACITY_N, seed=0, permutation="feistel", batch_size=1)
    out: dict[str, dict[str, Any]] = {s.name: {} for s in servings}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        where = {s.name: stack.enter_context(bench._serve_process(f"sqlite:///{tmp}/leases-{s.name}.db", env=s.env))
                 for s in servings}
        drivers = bench.Drivers(2)
        try:
            gens = {name: [asyncio.run(bench._join_job(address, job, spec, w))
                           for job, w in (("one", 1), ("many", ranks), ("paced", ranks))] for name, address in where.items()}
            phases: list[tuple[str, Callable[[str, list[int]], dict[str, Any]]]] = [
                ("empty1", lambda a, g: drivers.run(a, "empty", 1, seconds, ranks=[0])),
                ("lease1", lambda a, g: drivers.run(a, "lease", 1, seconds, "one", g[0], ranks=[0])),
                ("paced_empty", lambda a, g: drivers.run(a, "empty", ranks, paced_s, interval=paced_s)),
                ("paced_lease", lambda a, g: drivers.run(a, "lease", ranks, paced_s, "paced", g[2], interval=paced_s,
                                                         warm=True)),
                ("empty", lambda a, g: drivers.run(a, "empty", ranks, seconds)),
                ("lease", lambda a, g: drivers.run(a, "lease", ranks, seconds, "many", g[1])),
            ]
            for key, phase in phases:
                for name, address in where.items():
                    out[name][key] = phase(address, gens[name])
        finally:
            drivers.close()
    return out


# --------------------------------------------------------------------------- report


def _verdict(ok: bool) -> str:
    return "met" if ok else "**MISSED**"


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ms (worst {max(xs):.1f})"


def report(start: dict[str, Any] | None, stride: dict[str, list[float]] | None, n: int,
           leases: dict[str, dict[str, Any]] | None, labels: dict[str, str] | None = None) -> list[str]:
    """The table's rows (Markdown), and the verdicts in them, of the parts measured (None: not measured); the
    leases by serving, each named by `labels` (by serving name) when there are several."""
    rows = ["| what | setting | croupier | peer | peer's | ratio | target |", "| --- | --- | --- | --- | --- | --- | --- |"]
    if start is not None:
        rows += _start_rows(start)
    if stride is not None:
        rows += _stride_rows(stride, n)
    for name, measured in (leases or {}).items():
        rows += _lease_rows(measured, f"{labels[name]}: " if labels and len(leases or {}) > 1 else "")
    return rows


def _start_rows(start: dict[str, Any]) -> list[str]:
    rows: list[str] = []
    torch_ms = statistics.median(start["torch"]["ms"])
    torch_n = start["torch"]["n"]
    for key, v in start.items():
        if key == "torch":
            continue
        size = int(key)
        peer = (f"{torch_ms:,.0f} ms (N={bench._n(torch_n)})", f"{torch_ms / statistics.median(v['alone']):,.0f}x faster")
        at = size == torch_n
        every_x = f"{torch_ms / statistics.median(v['every']):,.0f}x faster (all {WORLD})"
        rows.append(f"| start: first batch, one rank (7 joined before) | N={bench._n(size)}, rank 0 of {WORLD}, "
                    f"croupier serve | {_ms(v['alone'])} | torch DistributedSampler | {peer[0] if at else '-'} | "
                    f"{peer[1] if at else '-'} | <= {TARGET_RANK_MS:g} ms: "
                    f"{_verdict(statistics.median(v['alone']) <= TARGET_RANK_MS)}"
                    + (f"; >= {TARGET_START_X:g}x: {_verdict(torch_ms >= TARGET_START_X * statistics.median(v['alone']))}"
                       if at else "") + " |")
        rows.append(f"| start: first batch, {WORLD} ranks in one process | N={bench._n(size)}, rank {RANK} / all {WORLD} | "
                    f"{_ms(v['rank'])} / {_ms(v['every'])} | torch DistributedSampler | "
                    f"{peer[0] if at else '-'} | {every_x if at else '-'} | "
                    f"<= {TARGET_WORLD_MS:g} ms: {_verdict(statistics.median(v['every']) <= TARGET_WORLD_MS)} |")
    return rows


def _stride_rows(stride: dict[str, list[float]], n: int) -> list[str]:
    rows: list[str] = []
    for mine, peer, how in (("embedded", "torch", "sampler="), ("standalone", "torch", "sampler="),
                            ("embedded_batch", "torch_batch", "batch_sampler="),
                            ("standalone_batch", "torch_batch", "batch_sampler=")):
        ratios = [a / b for a, b in zip(stride[mine], stride[peer], strict=True)]
        med, worst = statistics.median(ratios), min(ratios)
        rows.append(f"| stride: indices/s, DataLoader({how}) | N={bench._n(n)}, batch {BATCH}, {mine.split('_')[0]} coordinator; "
                    f"{len(ratios)} interleaved rounds | {statistics.median(stride[mine]) / 1e6:.2f} M/s | torch "
                    f"{'BatchSampler(DistributedSampler)' if 'batch' in peer else 'DistributedSampler'} | "
                    f"{statistics.median(stride[peer]) / 1e6:.2f} M/s | median round {med:.2f}x, worst {worst:.2f}x "
                    f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)}) | >= {TARGET_STRIDE_X:g}x: "
                    f"{_verdict(med >= TARGET_STRIDE_X)} (median round) |")
    return rows


def _lease_rows(leases: dict[str, Any], serving: str) -> list[str]:
    rows: list[str] = []
    e1, l1 = leases["empty1"], leases["lease1"]
    rows.append(f"| leases: latency p50 / p99, one rank back to back | {serving}65,536 indices of N=1e8 | {l1['p50']:.2f} / "
                f"{l1['p99']:.2f} ms | empty gRPC call | {e1['p50']:.2f} / {e1['p99']:.2f} ms | "
                f"{l1['p50'] / e1['p50']:.1f}x / {l1['p99'] / e1['p99']:.1f}x the floor |  |")
    pe, pl = leases["paced_empty"], leases["paced_lease"]
    rows.append(f"| leases: latency p50 / p99, paced (each rank's next lease) | {serving}{pl['calls']} ranks asking once each, "
                f"spread evenly | {pl['p50']:.2f} / {pl['p99']:.2f} ms | empty gRPC call, same pace | {pe['p50']:.2f} / "
                f"{pe['p99']:.2f} ms | {pl['p50'] / pe['p50']:.1f}x / {pl['p99'] / pe['p99']:.1f}x the floor | "
                f"p50 <= {TARGET_LEASE_X:g}x: {_verdict(pl['p50'] <= TARGET_LEASE_X * pe['p50'])} |")
    em, le = leases["empty"], leases["lease"]
    rows.append(f"| leases: rate, saturated | {serving}same ranks, back to back | {le['per_s']:,.0f} leases/s "
                f"({le['indices_per_s'] / 1e6:.1f} M indices/s), p50 {le['p50']:.1f} ms | empty gRPC call, same load | "
                f"{em['per_s']:,.0f} calls/s, p50 {em['p50']:.1f} ms | {le['per_s'] / em['per_s']:.0%} of the floor | "
                f">= {TARGET_LEASES_OF_FLOOR:.0%}: {_verdict(le['per_s'] >= TARGET_LEASES_OF_FLOOR * em['per_s'])} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one round, short runs")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the start and of the stride")
    parser.add_argument("--out", type=Path, default=Path("out/stride"), help="where stride.md goes")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"the parts measured, comma-separated, of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--baseline", metavar="REF",
                        help="also: the leases on REF's coordinator, each phase beside this tree's (benchmarks/baseline.py)")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if not parts or any(p not in PARTS for p in parts):
        parser.error(f"--parts must name some of {', '.join(PARTS)} (got {args.parts!r})")
    quick = args.quick
    begin, load = time.perf_counter(), bench._load()
    versions = bench._import_all()

    def step(what: str) -> None:
        print(f"[{time.perf_counter() - begin:6.1f} s] {what}", file=sys.stderr, flush=True)

    rounds = 1 if quick else args.rounds
    n = 10**5 if quick else 10**6
    start = stride = leases = None
    if "start" in parts:
        step("start")
        start = measure_start([10**4, 10**5] if quick else [5 * 10**5, 5 * 10**7, 5 * 10**8], rounds, 1 if quick else 2)
    if "stride" in parts:
        step("stride")
        stride = measure_stride(n, 1 if quick else 4, rounds)
    labels = {baseline.CURRENT.name: "this tree"}
    if "leases" in parts:
        step("leases")
        with contextlib.ExitStack() as stack:
            servings = [baseline.CURRENT]
            if args.baseline:
                old = stack.enter_context(baseline.baseline(args.baseline))
                servings.insert(0, old)
                labels[old.name] = f"{old.ref} (before)"
            # paced as bench.py paces: a lease of 65,536 indices every 256 steps of 100 ms (25.6 s) per rank
            leases = measure_leases(0.5 if quick else 5.0, 0.5 if quick else bench.PACED_STEP_S * bench.STEPS_PER_LEASE,
                                    8 if quick else 64, tuple(servings))
    rows = report(start, stride, n, leases, labels)
    took = time.perf_counter() - begin
    text = "\n".join([
        "# The start and the stride, and leases", "",
        f"`python benchmarks/stride_bench.py{' --quick' if quick else ''}"
        f"{'' if parts == list(PARTS) else ' --parts ' + ','.join(parts)}"
        f"{' --baseline ' + args.baseline if args.baseline else ''}`: {took:.0f} s; machine: {bench._machine(versions)}; "
        f"load average {load} before, {bench._load()} after (other processes share these cores).", "",
        *rows, ""])
    print(text)
    with contextlib.suppress(OSError):
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "stride.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
