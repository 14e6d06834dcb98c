"""Every croupier benchmark beside its peer (torch, torchdata, the raw floors) in one run: one table, Markdown and PNG."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import os
import platform
import resource
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

WORLD = 8  # num_replicas of every sampler measured; rank 0 is the rank timed
BATCH = 256  # the DataLoader's batch_size
# DistributedSampler's default lease_ahead: indices per Lease call, as the client sends them
# (checked against the sampler where it is imported; croupier is imported lazily, per child).
LEASE_INDICES = 65536
STEPS_PER_LEASE = LEASE_INDICES // BATCH
MIB = 1 << 20
#: torch's DistributedSampler holds randperm (int64) and its tolist(): a list slot and a Python int per index.
TORCH_BYTES_PER_INDEX = 8 + 8 + 32
TORCH_FITS_BYTES = 12 << 30
#: The paced load: a training step of this many seconds, so a rank asks (a grant, a lease) every STEPS_PER_LEASE steps.
PACED_STEP_S = 0.1
CAPACITY_N = 10**8
TARGET_START_X = 100.0
TARGET_RESUME_X = 100.0
TARGET_P99_MS = 10.0
TARGET_STEADY_X = 1.0  # DataLoader(sampler=) beside torch's DistributedSampler
TARGET_BATCH_X = 1.5  # DataLoader(batch_sampler=), dataset with __getitems__, beside BatchSampler(DistributedSampler)
TARGET_GRANTS_OF_FLOOR = 0.5  # saturated grants/s over empty calls/s on the same load
TARGET_LEASES_OF_FLOOR = 0.5  # saturated leases/s over empty calls/s on the same load
TARGET_LEASE_X = 2.0  # paced lease p50 over the paced empty call's
TARGET_RPCS_PER_STEP = 0.01
FLAT_WITHIN = 1.5  # "flat": the slowest N takes at most this many times the fastest

BENCH = Path(__file__).resolve()
RESULT = "RESULT "


# =========================================================================== children
# Every measurement that needs its own peak RSS runs in a fresh `bench.py --child MODE` process,
# which prints one line `RESULT {json}`.


def _peak_rss() -> int:
    """Peak resident set size of this process, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB elsewhere


def _import_all() -> dict[str, str]:
    """Imports what every measuring child imports, so that their baselines agree; returns the versions."""
    import grpc
    import torch
    import torch.utils.data
    import torchdata
    import torchdata.stateful_dataloader.sampler

    import croupier.client
    import croupier.server._service  # noqa: F401

    return {"torch": torch.__version__, "torchdata": torchdata.__version__, "numpy": np.__version__,
            "grpcio": grpc.__version__, "python": platform.python_version()}


def _index_dataset(n: int) -> Any:
    """The trivial dataset: item i is i."""
    from torch.utils.data import Dataset

    class Indexed(Dataset[int]):
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> int:
            return i

    return Indexed()


def _batched_dataset(n: int) -> Any:
    """The trivial dataset with a batched fetch: ``__getitems__(batch)`` is ``batch`` (as HF datasets and most
    tensor datasets fetch a batch in one call; torch's fetcher calls it instead of one ``__getitem__`` per index)."""
    from torch.utils.data import Dataset

    class BatchIndexed(Dataset[int]):
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> int:
            return i

        def __getitems__(self, batch: list[int]) -> list[int]:
            return list(batch)

    return BatchIndexed()


def _pass_through(batch: Any) -> Any:
    """A collate_fn that returns the fetched batch as it is."""
    return batch


def _join_others(address: str, job: str, spec: Any, incarnation: str, resume: Any = None) -> None:
    """Joins ranks 1 .. WORLD-1 of a generation without waiting, as the job's other ranks do."""
    from croupier.client._rpc import CoordinatorClient
    from croupier.core.api import JoinRequest

    with CoordinatorClient(address) as c:
        for r in range(1, WORLD):
            c.join(JoinRequest(job, spec, incarnation, WORLD, r, resume), wait_s=0)


@contextlib.contextmanager
def _in_process_coordinator() -> Iterator[str]:
    """The embedded coordinator: started the way the samplers start theirs (a process of its own, no
    credential), its store a SQLite file; yields its address."""
    from croupier.client import _embedded, _resolve

    with tempfile.TemporaryDirectory() as tmp:
        store = f"sqlite:///{tmp}/coordinator.db"
        address, _ = _resolve._start_embedded(store, "127.0.0.1")
        if not _resolve.embedded_here(address):
            raise RuntimeError(f"the embedded coordinator at {address} is not registered as this process's")
        try:
            yield address
        finally:
            _embedded.stop(store)


@contextlib.contextmanager
def _serve_process(store: str, args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> Iterator[str]:
    """`croupier serve` in a child process (its log on this one's stderr), with more of its options in `args` and
    variables of `env` in its environment (baseline.Serving.env: an older commit's code); yields its address and
    stops it on exit."""
    from croupier.tools.serve import ServeProcess

    p = ServeProcess(store, sys.stderr, args=args, env=env).start()
    try:
        yield p.address
    finally:
        p.terminate(30)


def _child_baseline() -> dict[str, Any]:
    versions = _import_all()
    return {"rss": _peak_rss(), "versions": versions}


def _child_start(sampler: str, n: int) -> dict[str, Any]:
    """Time to the first batch of rank 0 of WORLD, from making the sampler, in epoch 0."""
    _import_all()
    from torch.utils.data import DataLoader

    dataset = _index_dataset(n)
    with contextlib.ExitStack() as stack:
        if sampler == "croupier":
            from croupier.client import DistributedSampler

            address = stack.enter_context(_in_process_coordinator())
            spec = DistributedSampler(n, WORLD, 0, address=address, job="start", incarnation="g1").spec
            _join_others(address, "start", spec, "g1")
            t0 = time.perf_counter()
            s: Any = DistributedSampler(dataset, num_replicas=WORLD, rank=0, address=address, job="start", incarnation="g1")
            stack.callback(s.close)
        else:
            from torch.utils.data.distributed import DistributedSampler as TorchSampler

            t0 = time.perf_counter()
            s = TorchSampler(dataset, num_replicas=WORLD, rank=0, shuffle=True, seed=0)
        s.set_epoch(0)
        batch = next(iter(DataLoader(dataset, batch_size=BATCH, sampler=s)))
        seconds = time.perf_counter() - t0
        if len(batch) != BATCH:
            raise RuntimeError(f"first batch has {len(batch)} indices, not {BATCH}")
        return {"seconds": seconds, "rss": _peak_rss()}


def _child_resume(sampler: str, n: int) -> dict[str, Any]:
    """Time to the first batch of rank 0 of WORLD resumed half-way through epoch 0, from making the sampler."""
    _import_all()
    from torch.utils.data import DataLoader

    dataset = _index_dataset(n)
    with contextlib.ExitStack() as stack:
        if sampler == "croupier":
            from croupier.client import DistributedSampler
            from croupier.core.checkpoint import from_state
            from croupier.core.order import order

            address = stack.enter_context(_in_process_coordinator())
            # The run that is preempted: it takes its first batch, then checkpoints half of the epoch.
            before = DistributedSampler(dataset, num_replicas=WORLD, rank=0, address=address, job="resume", incarnation="g1")
            _join_others(address, "resume", before.spec, "g1")
            next(iter(DataLoader(dataset, batch_size=BATCH, sampler=before)))
            half = len(before) // 2
            state = before.state_dict(consumed=half)
            before.close()
            # The restart: a new incarnation whose other ranks load the same checkpoint.
            _join_others(address, "resume", before.spec, "g2", from_state("resume", before.spec, state))
            t0 = time.perf_counter()
            s: Any = DistributedSampler(dataset, num_replicas=WORLD, rank=0, address=address, job="resume", incarnation="g2")
            s.load_state_dict(state)
            batch = next(iter(DataLoader(dataset, batch_size=BATCH, sampler=s)))
            seconds = time.perf_counter() - t0
            stack.callback(s.close)
            want = order(before.spec, 0, half * WORLD + np.arange(BATCH, dtype=np.int64) * WORLD)  # (BATCH,)
            if batch.tolist() != want.tolist():
                raise RuntimeError("croupier's resumed first batch is not the batch at the middle of the epoch")
        else:
            from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

            t0 = time.perf_counter()
            s = StatefulDistributedSampler(dataset, num_replicas=WORLD, rank=0, shuffle=True, seed=0)
            s.load_state_dict({"yielded": len(s) // 2})
            batch = next(iter(DataLoader(dataset, batch_size=BATCH, sampler=s)))
            seconds = time.perf_counter() - t0
        if len(batch) != BATCH:
            raise RuntimeError(f"first batch has {len(batch)} indices, not {BATCH}")
        return {"seconds": seconds, "rss": _peak_rss()}


#: The DataLoader loops of the steady-state child, in the order they run (interleaved per repeat).
STEADY_CASES = ("torch", "croupier", "croupier_inproc", "torch_batch", "croupier_batch", "torch_batch_items",
                "croupier_batch_items", "lazy_reference", "free_batch_items", "torch_batch_pass", "croupier_batch_pass",
                "lazy_batch_pass", "free_batch_pass")


def _child_steady(n: int, epochs: int, repeats: int, cases: Sequence[str] = STEADY_CASES,
                  floor: bool = True) -> dict[str, Any]:
    """Indices/s of DataLoader loops, interleaved: after each epoch's first batch (`NAME`) and over whole epochs
    from `set_epoch` on (`NAME_epoch`); the coordinator calls and protobuf bytes per step of case "croupier"."""
    _import_all()

    from torch.utils.data import BatchSampler, DataLoader, Sampler
    from torch.utils.data.distributed import DistributedSampler as TorchSampler

    from croupier.client import DistributedBatchSampler, DistributedSampler
    from croupier.v1 import coordinator_pb2_grpc as pb_grpc

    default = DistributedSampler(10, num_replicas=1, rank=0, address="unused:1")._lease_ahead  # never joins
    assert default == LEASE_INDICES, f"LEASE_INDICES={LEASE_INDICES} but DistributedSampler leases {default}"
    unknown = set(cases) - set(STEADY_CASES)
    if unknown:
        raise ValueError(f"unknown steady cases {sorted(unknown)} (known: {STEADY_CASES})")

    plain, batched = _index_dataset(n), _batched_dataset(n)
    # Every call of a coordinator stub while metering is on: its count, and its request's and
    # response's protobuf sizes (the payloads; gRPC and HTTP/2 add their framing and headers).
    meter = {"on": 0, "calls": 0, "bytes": 0}
    meter_lock = threading.Lock()

    def metered(call: Callable[..., Any]) -> Callable[..., Any]:
        def call_and_count(request: Any, *a: Any, **kw: Any) -> Any:
            response = call(request, *a, **kw)
            if meter["on"]:
                with meter_lock:
                    meter["calls"] += 1
                    meter["bytes"] += request.ByteSize() + response.ByteSize()
            return response
        return call_and_count

    class MeteredStub(pb_grpc.CoordinatorStub):
        def __init__(self, channel: Any) -> None:
            super().__init__(channel)
            for name, call in list(vars(self).items()):
                setattr(self, name, metered(call))

    pb_grpc.CoordinatorStub = MeteredStub  # the clients made from here on (CoordinatorClient looks it up per stub)
    jobs = iter(range(1 << 30))

    Loop = tuple[Any, Callable[[int], None], Callable[[], None]]  # (loader, set_epoch, close)

    def croupier_loop(address: str, batches: bool, dataset: Any, collate: Any = None) -> Loop:
        job = f"steady-{next(jobs)}"
        s: Any
        if batches:
            s = DistributedBatchSampler(dataset, BATCH, num_replicas=WORLD, rank=0, address=address, job=job, incarnation="g1")
            loader = DataLoader(dataset, batch_sampler=s, collate_fn=collate)
        else:
            s = DistributedSampler(dataset, num_replicas=WORLD, rank=0, address=address, job=job, incarnation="g1")
            loader = DataLoader(dataset, batch_size=BATCH, sampler=s)
        _join_others(address, job, s.spec, "g1")
        return loader, s.set_epoch, s.close

    def torch_loop(batches: bool, dataset: Any, collate: Any = None) -> Loop:
        s: TorchSampler[int] = TorchSampler(dataset, num_replicas=WORLD, rank=0, shuffle=True, seed=0)
        if batches:
            loader = DataLoader(dataset, batch_sampler=BatchSampler(s, BATCH, drop_last=False), collate_fn=collate)
        else:
            loader = DataLoader(dataset, batch_size=BATCH, sampler=s)
        return loader, s.set_epoch, lambda: None

    def rate(make: Callable[[], Loop], meter_it: bool) -> tuple[float, list[float], float, float]:
        """(indices/s after each epoch's first batch, each epoch's indices/s from set_epoch on, calls and
        bytes per step)."""
        loader, set_epoch, close = make()
        done, busy, steps = 0, 0.0, 0
        whole: list[float] = []
        meter.update(on=int(meter_it), calls=0, bytes=0)
        for epoch in range(epochs):
            t_epoch = time.perf_counter()
            set_epoch(epoch)
            it = iter(loader)
            first = len(next(it))  # the epoch's start: a row of its own, and in the whole epoch's
            steps += 1
            t0 = time.perf_counter()
            in_epoch = 0
            for batch in it:
                in_epoch += len(batch)
                steps += 1
            t1 = time.perf_counter()
            done, busy = done + in_epoch, busy + t1 - t0
            whole.append((first + in_epoch) / (t1 - t_epoch))
        meter["on"] = 0
        close()
        return done / busy, whole, meter["calls"] / steps, meter["bytes"] / steps

    def numpy_floor() -> float:
        perm = np.random.default_rng(0).permutation(n)[0::WORLD]  # (n / WORLD,) rank 0's part, precomputed
        done = 0
        t0 = time.perf_counter()
        for _ in range(epochs):
            for i in range(0, perm.size, BATCH):
                done += perm[i : i + BATCH].size
        return done / (time.perf_counter() - t0)

    def reference_loop(batches: bool, collate: Any = None, lazy: bool = False) -> Loop:
        """The two reference points, with rank 0's indices made before the loop (not timed):
        ``batches=False``, the cheapest sampler that makes its Python ints as it goes (int64
        indices turned into ints a lease at a time, as croupier's sampler must, because making
        them all at the epoch's start is what makes torch's epoch start O(N)); ``batches=True``,
        a batch sampler that costs nothing (lists made before the loop), whose rate is the most
        any batch sampler can reach through this DataLoader."""
        mine = np.random.default_rng(0).permutation(n)[0::WORLD]  # (n / WORLD,)

        class Lazy(Sampler[int]):
            def __len__(self) -> int:
                return int(mine.size)

            def __iter__(self) -> Iterator[int]:
                return itertools.chain.from_iterable(
                    mine[i : i + LEASE_INDICES].tolist() for i in range(0, mine.size, LEASE_INDICES))

        class LazyBatches(Sampler[list[int]]):
            def __len__(self) -> int:
                return -(-int(mine.size) // BATCH)

            def __iter__(self) -> Iterator[list[int]]:
                for i in range(0, mine.size, LEASE_INDICES):
                    part = mine[i : i + LEASE_INDICES].tolist()
                    for j in range(0, len(part), BATCH):
                        yield part[j : j + BATCH]

        if batches and lazy:
            return DataLoader(batched, batch_sampler=LazyBatches(), collate_fn=collate), lambda e: None, lambda: None
        if batches:
            flat = mine.tolist()
            made = [flat[i : i + BATCH] for i in range(0, len(flat), BATCH)]
            return DataLoader(batched, batch_sampler=made, collate_fn=collate), lambda e: None, lambda: None
        return DataLoader(plain, batch_size=BATCH, sampler=Lazy()), lambda e: None, lambda: None

    rates: dict[str, list[float]] = {}
    per_step: dict[str, list[float]] = {"rpcs_per_step": [], "bytes_per_step": []}
    with tempfile.TemporaryDirectory() as tmp, _serve_process(f"sqlite:///{tmp}/steady.db") as remote, \
            _in_process_coordinator() as local:
        make: dict[str, Callable[[], Loop]] = {
            "torch": lambda: torch_loop(False, plain),
            "croupier": lambda: croupier_loop(remote, False, plain),
            "croupier_inproc": lambda: croupier_loop(local, False, plain),
            "torch_batch": lambda: torch_loop(True, plain),
            "croupier_batch": lambda: croupier_loop(remote, True, plain),
            "torch_batch_items": lambda: torch_loop(True, batched),
            "croupier_batch_items": lambda: croupier_loop(remote, True, batched),
            "lazy_reference": lambda: reference_loop(False),
            "free_batch_items": lambda: reference_loop(True),
            # A collate_fn that passes the fetched batch through: the loop where the sampler's cost matters most.
            "torch_batch_pass": lambda: torch_loop(True, batched, _pass_through),
            "croupier_batch_pass": lambda: croupier_loop(remote, True, batched, _pass_through),
            "lazy_batch_pass": lambda: reference_loop(True, _pass_through, lazy=True),
            "free_batch_pass": lambda: reference_loop(True, _pass_through),
        }
        for _ in range(repeats):
            for name in cases:
                r, whole, rpcs, nbytes = rate(make[name], name == "croupier")
                rates.setdefault(name, []).append(r)
                rates.setdefault(f"{name}_epoch", []).extend(whole)
                if name == "croupier":
                    per_step["rpcs_per_step"].append(rpcs)
                    per_step["bytes_per_step"].append(nbytes)
            if floor:
                rates.setdefault("numpy", []).append(numpy_floor())
    out: dict[str, Any] = {name: statistics.median(v) for name, v in rates.items()}
    out.update({name: statistics.median(v) for name, v in per_step.items() if v})
    return out


# --------------------------------------------------------------------------- load driver (capacity)


async def _drive_forever() -> None:
    """Reads one command a line from stdin, runs it, prints its RESULT line; ends at EOF."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from croupier.client import CHANNEL_OPTIONS
    from croupier.core.wire import unpack_indices
    from croupier.v1 import coordinator_pb2 as pb
    from croupier.v1 import coordinator_pb2_grpc as pb_grpc

    loop = asyncio.get_running_loop()
    channel: grpc.aio.Channel | None = None
    print("ready", flush=True)
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        cmd = json.loads(line)
        if channel is None:
            channel = grpc.aio.insecure_channel(cmd["address"], options=CHANNEL_OPTIONS)
            await channel.channel_ready()
        stub = pb_grpc.CoordinatorStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        empty = health_pb2.HealthCheckRequest()
        lat: list[float] = []
        got = {"indices": 0}
        start = time.perf_counter()
        interval = cmd["interval"]
        # `warm`: a running job's ranks: each rank's first call is not timed, and the run lasts one
        # interval more, so that the calls timed are each rank's next, an interval after its first.
        end = start + cmd["seconds"] + (interval if cmd.get("warm") else 0.0)

        async def rank_loop(r: int) -> None:
            j, epoch = 0, 0
            untimed = 1 if cmd.get("warm") else 0
            due = start + interval * r / cmd["world"]  # paced ranks spread their calls evenly
            while True:
                if interval:
                    # NOTE: this wait models the rank's training steps between two calls (the load),
                    # it synchronises nothing.
                    await asyncio.sleep(max(0.0, min(due, end) - time.perf_counter()))
                    due += interval
                if time.perf_counter() >= end:
                    return
                t0 = time.perf_counter()
                if cmd["kind"] == "empty":
                    await health.Check(empty)
                elif cmd["kind"] == "grant":
                    # As the samplers ask: with the rank's progress, which moves forward (the next epoch
                    # after the last grant of one), so that every grant makes the coordinator journal a
                    # progress event, as a training rank's grants do.
                    g = await stub.Grant(pb.GrantRequest(job=cmd["job"], generation=cmd["generation"], rank=r,
                                                         epoch=epoch, first_batch=j, count=LEASE_INDICES,
                                                         progress=pb.Progress(epoch=epoch, batches=j)))
                    got["indices"] += (g.batches - 1) * 1 + g.last_size if g.batches else 0  # batch_size 1
                    j, epoch = (0, epoch + 1) if g.end_of_epoch else (j + g.batches, epoch)
                else:
                    # as croupier's client asks: fixed batches named by their count and sizes, not size by size
                    resp = await stub.Lease(pb.LeaseRequest(job=cmd["job"], generation=cmd["generation"], rank=r, epoch=0,
                                                            first_batch=j, count=LEASE_INDICES, fixed_sizes=True))
                    got["indices"] += unpack_indices(resp.indices, resp.itemsize).size if not untimed else 0
                    j = 0 if resp.end_of_epoch else j + (resp.batches or len(resp.sizes))
                if untimed:
                    untimed -= 1
                    continue
                lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(rank_loop(r) for r in cmd["ranks"]))
        print(RESULT + json.dumps({"calls": len(lat), "indices": got["indices"],
                                   "lat_ms": [round(x * 1e3, 4) for x in lat]}), flush=True)
    if channel is not None:
        await channel.close()


CHILDREN: dict[str, Callable[..., dict[str, Any]]] = {
    "baseline": _child_baseline,
    "start": _child_start,
    "resume": _child_resume,
    "steady": _child_steady,
}


def _run_child(mode: str, **kw: Any) -> dict[str, Any]:
    """Runs `bench.py --child MODE` with keyword arguments; returns its RESULT."""
    proc = subprocess.run([sys.executable, str(BENCH), "--child", mode, json.dumps(kw)],
                          capture_output=True, text=True, timeout=900, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child {mode} {kw} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(lines[-1][len(RESULT):])  # type: ignore[no-any-return]


# =========================================================================== the parent


@dataclasses.dataclass
class Point:
    """Medians of the repeats of one measurement in fresh processes."""

    seconds: float
    rss: int


def _pct(ms: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(ms), q)) if len(ms) else math.nan


class Drivers:
    """Client processes that put load on a coordinator, all starting each phase together."""

    def __init__(self, count: int) -> None:
        self.procs = [subprocess.Popen([sys.executable, str(BENCH), "--child", "drive", "{}"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True) for _ in range(count)]
        for p in self.procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a load driver did not start")

    def run(self, address: str, kind: str, world: int, seconds: float, job: str = "", generation: int = 0,
            interval: float = 0.0, ranks: Sequence[int] | None = None, warm: bool = False) -> dict[str, Any]:
        """Runs ranks `ranks` (default all of `world`), dealt round-robin to the drivers; merged results.
        With `warm`, each rank's first call is not timed and the run lasts one `interval` more: paced, the
        calls timed are each rank's next, one interval after its first (as in a running job)."""
        todo = list(range(world)) if ranks is None else list(ranks)
        for i, p in enumerate(self.procs):
            assert p.stdin is not None
            cmd = dict(address=address, kind=kind, world=world, seconds=seconds, job=job, generation=generation,
                       interval=interval, ranks=todo[i :: len(self.procs)], warm=warm)
            p.stdin.write(json.dumps(cmd) + "\n")
            p.stdin.flush()
        calls, indices, lat = 0, 0, []
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line.startswith(RESULT):
                raise RuntimeError(f"a load driver failed: {line!r}")
            r = json.loads(line[len(RESULT):])
            calls, indices = calls + r["calls"], indices + r["indices"]
            lat.extend(r["lat_ms"])
        return {"per_s": calls / seconds, "indices_per_s": indices / seconds, "p50": _pct(lat, 50), "p99": _pct(lat, 99),
                "calls": calls}

    def close(self) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.close()
        for p in self.procs:
            p.wait(timeout=60)


async def _join_job(address: str, job: str, spec: Any, world: int) -> int:
    """Joins all `world` ranks of a job at once (no long poll); returns its started generation."""
    import grpc

    from croupier.client import CHANNEL_OPTIONS
    from croupier.core.wire import spec_to_proto
    from croupier.v1 import coordinator_pb2 as pb
    from croupier.v1 import coordinator_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        await asyncio.gather(*(stub.Join(pb.JoinRequest(request_id=f"{job}-{r}", job=job, spec=spec_to_proto(spec),
                                                        incarnation="g1", world=world, rank=r, wait_ms=0))
                               for r in range(world)))
        info = await stub.GetJob(pb.GetJobRequest(job=job))
        if not info.started:
            raise RuntimeError(f"job {job} did not start after all {world} ranks joined")
        return int(info.generation)


class BareSqlite:
    """The floor of a durable commit: one row per transaction, with the store's pragmas (WAL, synchronous=FULL)."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.execute("PRAGMA locking_mode=EXCLUSIVE")
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.execute("CREATE TABLE journal (seq INTEGER PRIMARY KEY, payload BLOB NOT NULL)")
        self.payload = os.urandom(256)
        self.seq = 0

    def commit(self) -> float:
        """Commits one row; returns how long it took, in ms."""
        self.seq += 1
        t0 = time.perf_counter()
        self.conn.execute("BEGIN IMMEDIATE")
        self.conn.execute("INSERT INTO journal (seq, payload) VALUES (?, ?)", (self.seq, self.payload))
        self.conn.execute("COMMIT")
        return (time.perf_counter() - t0) * 1e3

    def close(self) -> None:
        self.conn.close()


async def _commits(address: str, count: int, concurrent: int, floor: BareSqlite | None = None
                   ) -> tuple[list[float], float, list[float]]:
    """Joins of `count` new one-rank jobs, `concurrent` at a time: their latencies (ms) and joins/s.

    With `floor` (and one at a time), a bare SQLite commit follows every join, so that both see the
    same disk at the same moment; their latencies (ms) are the third value.
    """
    import grpc

    from croupier.client import CHANNEL_OPTIONS
    from croupier.core.spec import Spec
    from croupier.core.wire import spec_to_proto
    from croupier.v1 import coordinator_pb2 as pb
    from croupier.v1 import coordinator_pb2_grpc as pb_grpc

    spec = spec_to_proto(Spec(n=CAPACITY_N, seed=0, permutation="feistel", batch_size=1))
    lat: list[float] = []
    bare: list[float] = []
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        sem = asyncio.Semaphore(concurrent)

        async def one(i: int) -> None:
            async with sem:
                t0 = time.perf_counter()
                await stub.Join(pb.JoinRequest(request_id=f"c{concurrent}-{i}", job=f"commit-{concurrent}-{i}",
                                               spec=spec, incarnation="t", world=1, rank=0))
                lat.append((time.perf_counter() - t0) * 1e3)
                if floor is not None:
                    bare.append(floor.commit())

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(count)))
        wall = time.perf_counter() - t0
    return lat, (count * 1e3 / sum(lat) if floor is not None else count / wall), bare


def _coordinator(seconds: float, paced_seconds: float, rank_counts: Sequence[int], commits: int,
                 procs: int) -> dict[str, Any]:
    """Capacity, latency and durable commits of a `croupier serve` on a SQLite store."""
    from croupier.core.spec import Spec

    # The shape of DistributedSampler's leases: batch_size 1 in the spec, LEASE_INDICES per call.
    spec = Spec(n=CAPACITY_N, seed=0, permutation="feistel", batch_size=1)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, _serve_process(f"sqlite:///{tmp}/coordinator.db") as address:
        drivers = Drivers(procs)
        try:
            out["floor1"] = drivers.run(address, "empty", 1, seconds, ranks=[0])
            gen = asyncio.run(_join_job(address, "cap-1", spec, 1))
            out["lease1"] = drivers.run(address, "lease", 1, seconds, "cap-1", gen, ranks=[0])
            for w in rank_counts:
                gen = asyncio.run(_join_job(address, f"cap-{w}", spec, w))
                out[f"empty{w}"] = drivers.run(address, "empty", w, seconds)
                out[f"lease{w}"] = drivers.run(address, "lease", w, seconds, f"cap-{w}", gen)
                # Grants report progress, which only counts (and is journaled) when it moves forward:
                # each run of grants gets a job of its own, whose ranks start at epoch 0.
                ggen = asyncio.run(_join_job(address, f"grant-{w}", spec, w))
                out[f"grant{w}"] = drivers.run(address, "grant", w, seconds, f"grant-{w}", ggen)
                ggen = asyncio.run(_join_job(address, f"paced-grant-{w}", spec, w))
                for kind, job, g in (("grant", f"paced-grant-{w}", ggen), ("lease", f"cap-{w}", gen),
                                     ("empty", "", 0)):
                    out[f"paced_{kind}{w}"] = drivers.run(address, kind, w, paced_seconds, job, g,
                                                          interval=PACED_STEP_S * STEPS_PER_LEASE, warm=kind == "lease")
        finally:
            drivers.close()
        floor = BareSqlite(Path(tmp) / "floor.db")
        try:
            lat, rate, bare = asyncio.run(_commits(address, commits, 1, floor))
        finally:
            floor.close()
        out["commit1"] = {"p50": _pct(lat, 50), "p99": _pct(lat, 99), "per_s": rate}
        out["sqlite"] = {"p50": _pct(bare, 50), "p99": _pct(bare, 99), "per_s": len(bare) * 1e3 / sum(bare)}
        lat, rate, _ = asyncio.run(_commits(address, commits, 32))
        out["commit32"] = {"p50": _pct(lat, 50), "p99": _pct(lat, 99), "per_s": rate}
    return out


# --------------------------------------------------------------------------- report


def _n(n: int) -> str:
    e = round(math.log10(n))
    return f"1e{e}" if 10**e == n else f"{n:,}"


def _ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:,.0f} ms" if ms >= 100 else f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"


def _mib(b: float) -> str:
    return f"{b / MIB:,.0f} MiB"


def _rate(x: float) -> str:
    return f"{x / 1e6:,.0f} M/s" if x >= 1e8 else f"{x / 1e6:.2f} M/s" if x >= 1e5 else f"{x:,.0f}/s"


def _x(r: float, better: str, worse: str) -> str:
    """`r` = how many times better croupier is; below 1 it reads the other way round."""
    if r >= 1:
        return f"**{r:,.0f}x {better}**" if r >= 10 else f"**{r:.2f}x {better}**"
    return f"{1 / r:.2f}x {worse}"


def _verdict(ok: bool) -> str:
    return "met" if ok else "**MISSED**"


@dataclasses.dataclass
class Row:
    benchmark: str
    case: str
    croupier: str
    peer: str
    peer_value: str
    ratio: str
    target: str = ""


HEADER = ("benchmark", "case", "croupier", "peer", "peer value", "croupier vs peer", "target")


def _rows(res: dict[str, Any]) -> tuple[list[Row], list[str]]:
    rows: list[Row] = []
    notes: list[str] = []
    base = res["baseline"]
    start: dict[int, tuple[Point, Point | None]] = res["start"]
    torch_name = "torch DistributedSampler"
    for n, (c, t) in start.items():
        target = ""
        if n == 10**8:
            target = f">= {TARGET_START_X:g}x: " + (_verdict(t.seconds / c.seconds >= TARGET_START_X) if t else "n/a")
        if t is None:
            rows.append(Row("epoch start: time to first batch", f"N={_n(n)}", _ms(c.seconds), torch_name,
                            f"n/a (does not fit: ~{TORCH_BYTES_PER_INDEX * n / 2**30:,.0f} GiB)", "-", target))
        else:
            rows.append(Row("epoch start: time to first batch", f"N={_n(n)}", _ms(c.seconds), torch_name,
                            _ms(t.seconds), _x(t.seconds / c.seconds, "faster", "slower"), target))
    for n, (c, t) in start.items():
        cg = max(c.rss - base, 0)
        value = f"{_mib(c.rss)} (+{_mib(cg)})"
        if t is None:
            rows.append(Row("epoch start: peak RSS per rank (growth over imports)", f"N={_n(n)}", value, torch_name,
                            "n/a (does not fit)", "-"))
        else:
            tg = max(t.rss - base, 0)
            rows.append(Row("epoch start: peak RSS per rank (growth over imports)", f"N={_n(n)}", value, torch_name,
                            f"{_mib(t.rss)} (+{_mib(tg)})", _x(tg / max(cg, MIB), "less growth", "more growth")))
    times = [c.seconds for c, _ in start.values()]
    spread = max(times) / min(times)
    ns = list(start)
    rows.append(Row("epoch start: flat in N (time to first batch)", " / ".join(f"N={_n(n)}" for n in ns),
                    " / ".join(_ms(x) for x in times), torch_name,
                    " / ".join(_ms(t.seconds) if t else "n/a" for _, t in start.values()),
                    f"croupier's slowest / fastest = {spread:.2f}",
                    f"<= {FLAT_WITHIN:g}: {_verdict(spread <= FLAT_WITHIN)}"))

    n, (c, t) = res["resume_n"], res["resume"]
    half = f"N={_n(n)}, resumed at half the epoch"
    rows.append(Row("resume mid-epoch: time to first batch", half, _ms(c.seconds),
                    "torchdata StatefulDistributedSampler (replay)", _ms(t.seconds),
                    _x(t.seconds / c.seconds, "faster", "slower"),
                    f">= {TARGET_RESUME_X:g}x: {_verdict(t.seconds / c.seconds >= TARGET_RESUME_X)}" if n == 10**8 else ""))
    rows.append(Row("resume mid-epoch: peak RSS per rank (growth over imports)", half,
                    f"{_mib(c.rss)} (+{_mib(max(c.rss - base, 0))})", "torchdata StatefulDistributedSampler (replay)",
                    f"{_mib(t.rss)} (+{_mib(max(t.rss - base, 0))})",
                    _x(max(t.rss - base, 0) / max(c.rss - base, MIB), "less growth", "more growth")))

    st = res["steady"]
    case = f"N={_n(res['steady_n'])}, batch {BATCH}, num_workers=0"
    grants = "grants, indices computed in the lease helper process"
    steady_x = st["croupier"] / st["torch"]
    rows.append(Row("steady state: indices/s, DataLoader(sampler=)",
                    f"{case}; coordinator process (croupier serve), {grants}", _rate(st["croupier"]), torch_name,
                    _rate(st["torch"]), _x(steady_x, "faster", "slower"),
                    f">= {TARGET_STEADY_X:g}x: {_verdict(steady_x >= TARGET_STEADY_X)}"))
    inproc_x = st["croupier_inproc"] / st["torch"]
    rows.append(Row("steady state: indices/s, DataLoader(sampler=)",
                    f"{case}; the embedded coordinator (a child process of the loop's), {grants}", _rate(st["croupier_inproc"]),
                    torch_name, _rate(st["torch"]), _x(inproc_x, "faster", "slower"),
                    f">= {TARGET_STEADY_X:g}x: {_verdict(inproc_x >= TARGET_STEADY_X)}"))
    batch_name = "torch BatchSampler(DistributedSampler)"
    rows.append(Row("steady state: indices/s, DataLoader(batch_sampler=)",
                    f"{case}; DistributedBatchSampler, dataset with __getitem__ only (one call per index)",
                    _rate(st["croupier_batch"]), batch_name, _rate(st["torch_batch"]),
                    _x(st["croupier_batch"] / st["torch_batch"], "faster", "slower")))
    batch_x = st["croupier_batch_items"] / st["torch_batch_items"]
    rows.append(Row("steady state: indices/s, DataLoader(batch_sampler=), dataset with __getitems__",
                    f"{case}; DistributedBatchSampler, one __getitems__ call per batch",
                    _rate(st["croupier_batch_items"]), batch_name, _rate(st["torch_batch_items"]),
                    _x(batch_x, "faster", "slower"), f">= {TARGET_BATCH_X:g}x: {_verdict(batch_x >= TARGET_BATCH_X)}"))
    lazy_x = st["lazy_reference"] / st["torch"]
    rows.append(Row("steady state reference: indices/s, DataLoader(sampler=)",
                    f"{case}; the cheapest sampler that makes its ints as it goes: rank 0's int64 indices made "
                    f"before the loop, turned into Python ints {LEASE_INDICES:,} at a time", _rate(st["lazy_reference"]),
                    torch_name, _rate(st["torch"]), _x(lazy_x, "faster", "slower")))
    free_x = st["free_batch_items"] / st["torch_batch_items"]
    rows.append(Row("steady state ceiling: indices/s, DataLoader(batch_sampler=), dataset with __getitems__",
                    f"{case}; a batch sampler that costs nothing (its lists made before the loop): the most any "
                    "batch sampler reaches through this DataLoader", _rate(st["free_batch_items"]), batch_name,
                    _rate(st["torch_batch_items"]), _x(free_x, "faster", "slower")))
    pass_name = ("steady state: indices/s, DataLoader(batch_sampler=), dataset with __getitems__, collate_fn passing "
                 "the batch through")
    pass_x = st["croupier_batch_pass"] / st["torch_batch_pass"]
    lazy_pass_x = st["lazy_batch_pass"] / st["torch_batch_pass"]
    free_pass_x = st["free_batch_pass"] / st["torch_batch_pass"]
    rows.append(Row(pass_name, f"{case}; DistributedBatchSampler (the loop where a batch sampler's own cost weighs most)",
                    _rate(st["croupier_batch_pass"]), batch_name, _rate(st["torch_batch_pass"]),
                    _x(pass_x, "faster", "slower")))
    rows.append(Row(pass_name, f"{case}; reference: the cheapest batch sampler that makes its ints as it goes "
                    f"({LEASE_INDICES:,} at a time, batches sliced from them)", _rate(st["lazy_batch_pass"]), batch_name,
                    _rate(st["torch_batch_pass"]), _x(lazy_pass_x, "faster", "slower")))
    rows.append(Row(pass_name, f"{case}; ceiling: a batch sampler that costs nothing (its lists made before the loop, "
                    "O(N) at the epoch's start)", _rate(st["free_batch_pass"]), batch_name,
                    _rate(st["torch_batch_pass"]), _x(free_pass_x, "faster", "slower")))
    for n, ep in res["epoch"].items():
        rows.append(Row("whole epoch: indices/s, first batch included, DataLoader(sampler=)",
                        f"N={_n(n)}, batch {BATCH}; set_epoch + iter + every batch, median epoch; coordinator process",
                        _rate(ep["croupier_epoch"]), f"{torch_name} (randperm at each epoch's start)",
                        _rate(ep["torch_epoch"]), _x(ep["croupier_epoch"] / ep["torch_epoch"], "faster", "slower")))
    best = max(st[k] for k in ("croupier", "croupier_inproc", "croupier_batch", "croupier_batch_items"))
    rows.append(Row("floor: bare numpy loop over a precomputed permutation", f"N={_n(res['steady_n'])}, slices of {BATCH}",
                    _rate(best) + " (best above)", "numpy, no sampler, no DataLoader", _rate(st["numpy"]),
                    f"{best / st['numpy']:.2%} of the floor"))
    sampler_case = f"DistributedSampler, lease_ahead {LEASE_INDICES}, batch {BATCH}, coordinator process"
    rpcs_ok = st["rpcs_per_step"] <= TARGET_RPCS_PER_STEP
    rows.append(Row("RPCs per training step per rank", sampler_case, f"{st['rpcs_per_step']:.4f} (measured)",
                    torch_name, "0 (no coordinator)", "-", f"<= {TARGET_RPCS_PER_STEP:g}: {_verdict(rpcs_ok)}"))
    rows.append(Row("bytes per step per rank (protobuf payloads; gRPC/HTTP2 framing adds ~9 bytes per frame "
                    "and headers)", sampler_case, f"{st['bytes_per_step']:.2f} B (measured, requests + responses)",
                    torch_name, "0 (no coordinator)", "-"))

    co = res["coordinator"]
    floor1 = co["floor1"]
    lease1 = co["lease1"]
    rows.append(Row("coordinator: call latency p50 / p99", "1 rank, 1 call in flight",
                    f"{lease1['p50']:.2f} / {lease1['p99']:.2f} ms (lease)", "empty gRPC call (loopback)",
                    f"{floor1['p50']:.2f} / {floor1['p99']:.2f} ms",
                    f"{lease1['p50'] / floor1['p50']:.1f}x / {lease1['p99'] / floor1['p99']:.1f}x the floor"))
    for w in res["rank_counts"]:
        lease, empty, paced, paced_empty = co[f"lease{w}"], co[f"empty{w}"], co[f"paced_lease{w}"], co[f"paced_empty{w}"]
        grant = co[f"grant{w}"]
        rows.append(Row("coordinator capacity: grants/s (saturated; what samplers ask)", f"{w} ranks, back to back",
                        f"{grant['per_s']:,.0f} grants/s ({_rate(grant['indices_per_s'])} indices)",
                        "empty gRPC call, same load", f"{empty['per_s']:,.0f} calls/s",
                        f"{grant['per_s'] / empty['per_s']:.0%} of the floor",
                        f">= {TARGET_GRANTS_OF_FLOOR:.0%} of the floor: "
                        f"{_verdict(grant['per_s'] >= TARGET_GRANTS_OF_FLOOR * empty['per_s'])}" if w >= 512 else ""))
        rows.append(Row("coordinator capacity: leases/s (saturated; indices for other clients)", f"{w} ranks, back to back",
                        f"{lease['per_s']:,.0f} leases/s ({_rate(lease['indices_per_s'])} indices)",
                        "empty gRPC call, same load", f"{empty['per_s']:,.0f} calls/s",
                        f"{lease['per_s'] / empty['per_s']:.0%} of the floor",
                        f">= {TARGET_LEASES_OF_FLOOR:.0%} of the floor: "
                        f"{_verdict(lease['per_s'] >= TARGET_LEASES_OF_FLOOR * empty['per_s'])}"))
        rows.append(Row("coordinator: lease latency p50 / p99 (saturated)", f"{w} ranks, back to back",
                        f"{lease['p50']:.1f} / {lease['p99']:.1f} ms", "empty gRPC call, same load",
                        f"{empty['p50']:.1f} / {empty['p99']:.1f} ms",
                        f"{lease['p50'] / empty['p50']:.1f}x / {lease['p99'] / empty['p99']:.1f}x the floor"))
        offered = w / (PACED_STEP_S * STEPS_PER_LEASE)
        paced_grant = co[f"paced_grant{w}"]
        target = f"p99 < {TARGET_P99_MS:g} ms: {_verdict(paced_grant['p99'] < TARGET_P99_MS)}" if w >= 512 else ""
        for what, got, offer in (("grant latency p50 / p99 (paced; with a progress report, journaled)", paced_grant,
                                  "grants"),
                                 ("lease latency p50 / p99 (paced; each rank's next lease)", paced, "leases")):
            rows.append(Row(f"coordinator: {what}",
                            f"{w} ranks, {PACED_STEP_S * 1e3:g} ms steps ({offered:,.1f} {offer}/s offered; "
                            f"{got['calls']:,} call{'s' if got['calls'] != 1 else ''} measured)",
                            f"{got['p50']:.2f} / {got['p99']:.2f} ms", "empty gRPC call, same load",
                            f"{paced_empty['p50']:.2f} / {paced_empty['p99']:.2f} ms",
                            f"{got['p50'] / paced_empty['p50']:.1f}x / {got['p99'] / paced_empty['p99']:.1f}x the floor",
                            target if got is paced_grant else f"p50 <= {TARGET_LEASE_X:g}x the floor: "
                            f"{_verdict(got['p50'] <= TARGET_LEASE_X * paced_empty['p50'])}"))
    sq = co["sqlite"]
    for conc in (1, 32):
        cm = co[f"commit{conc}"]
        rows.append(Row("durable commit (join, SQLite store) p50 / p99", f"{conc} at a time",
                        f"{cm['p50']:.2f} / {cm['p99']:.2f} ms ({cm['per_s']:,.0f}/s)",
                        "bare SQLite commit, 1 row, fsync", f"{sq['p50']:.2f} / {sq['p99']:.2f} ms ({sq['per_s']:,.0f}/s)",
                        f"{cm['p50'] / sq['p50']:.1f}x / {cm['p99'] / sq['p99']:.1f}x the floor; "
                        f"{cm['per_s'] / sq['per_s']:.2f}x its rate"))

    # Closing notes: where the targets stand.
    if 10**8 in start and start[10**8][1] is not None:
        c8, t8 = start[10**8]
        assert t8 is not None
        x8 = t8.seconds / c8.seconds
        notes.append(f"Epoch start at N=1e8: croupier {_ms(c8.seconds)} vs torch {_ms(t8.seconds)} = {x8:,.0f}x "
                     f"(target >= {TARGET_START_X:g}x: {_verdict(x8 >= TARGET_START_X)}).")
    notes.append(f"Epoch start flat in N: slowest / fastest = {spread:.2f} over N={_n(ns[0])}..{_n(ns[-1])} "
                 f"(target <= {FLAT_WITHIN:g}: {_verdict(spread <= FLAT_WITHIN)}).")
    rn, (c, t) = res["resume_n"], res["resume"]
    notes.append(f"Resume at N={_n(rn)}: {t.seconds / c.seconds:,.0f}x faster than replay "
                 + (f"(target >= {TARGET_RESUME_X:g}x: {_verdict(t.seconds / c.seconds >= TARGET_RESUME_X)})."
                    if rn == 10**8 else "(the target is judged at N=1e8, in the full run)."))
    notes.append(f"Steady state through DataLoader(sampler=): croupier {_rate(st['croupier'])} (coordinator process), "
                 f"{_rate(st['croupier_inproc'])} (embedded) vs torch {_rate(st['torch'])} (target >= "
                 f"{TARGET_STEADY_X:g}x: {_verdict(steady_x >= TARGET_STEADY_X)}, "
                 f"{_verdict(inproc_x >= TARGET_STEADY_X)}); through batch_sampler= with __getitems__ "
                 f"{_rate(st['croupier_batch_items'])} vs {_rate(st['torch_batch_items'])} (target >= "
                 f"{TARGET_BATCH_X:g}x: {_verdict(batch_x >= TARGET_BATCH_X)}), with __getitem__ only "
                 f"{_rate(st['croupier_batch'])} vs {_rate(st['torch_batch'])} (both bound by the per-index fetch). "
                 f"References in the same run: a sampler that only turns precomputed int64 indices into ints as it goes "
                 f"{lazy_x:.2f}x torch; a batch sampler that costs nothing {free_x:.2f}x torch's through batch_sampler= "
                 f"(the ceiling for any batch sampler here{'' if free_x >= TARGET_BATCH_X else ', below the target'}). "
                 f"With a collate_fn that passes the batch through: croupier {pass_x:.2f}x, the cheapest sampler that makes "
                 f"its ints as it goes {lazy_pass_x:.2f}x, batches made before the epoch {free_pass_x:.2f}x.")
    notes.append(f"Coordinator traffic of a DistributedSampler: {st['rpcs_per_step']:.4f} RPCs per step per rank "
                 f"(target <= {TARGET_RPCS_PER_STEP:g}: {_verdict(rpcs_ok)}), {st['bytes_per_step']:.2f} bytes of "
                 "protobuf payload per step per rank.")
    top = max(res["rank_counts"])
    pg, ge, em = co[f"paced_grant{top}"], co[f"grant{top}"], co[f"empty{top}"]
    at_top = top >= 512
    judged = "(the targets are judged at 512 ranks, in the full run)."
    notes.append(f"{top} ranks: grant p99 {pg['p99']:.2f} ms paced at {PACED_STEP_S * 1e3:g} ms steps (empty calls "
                 f"under the same load: {co[f'paced_empty{top}']['p99']:.2f} ms)"
                 + (f" (target < {TARGET_P99_MS:g} ms: {_verdict(pg['p99'] < TARGET_P99_MS)}); " if at_top else "; ")
                 + f"saturated: {ge['per_s']:,.0f} grants/s = {ge['per_s'] / em['per_s']:.0%} of {em['per_s']:,.0f} "
                 "empty calls/s "
                 + (f"(target >= {TARGET_GRANTS_OF_FLOOR:.0%}: "
                    f"{_verdict(ge['per_s'] >= TARGET_GRANTS_OF_FLOOR * em['per_s'])})." if at_top else judged))
    return rows, notes


def _table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows:
        lines.append("| " + " | ".join(dataclasses.astuple(r)) + " |")
    return "\n".join(lines)


def _machine(versions: dict[str, str]) -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        kib = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        mem = f", {kib / 2**20:.0f} GiB"
    v = ", ".join(f"{k} {x}" for k, x in versions.items())
    return f"{cpu}, {os.cpu_count()} cores{mem}, {platform.system()} {platform.release()}; {v}"


def _load() -> str:
    """The machine's 1-minute load average (other processes share the cores the figures come from)."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "unknown"


def _log_bars(a: Any, labels: Sequence[str], values: Sequence[float], colors: Sequence[str], fmt: str) -> None:
    """Bars on a log axis that starts well below the smallest, each labelled with its value."""
    bars = a.bar(labels, values, color=colors)
    a.bar_label(bars, labels=[fmt.format(v) for v in values], fontsize=8)
    a.set_yscale("log")
    a.set_ylim(min(values) / 4, max(values) * 3)
    a.tick_params(axis="x", labelsize=7)


def _plot(res: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    c_col, p_col, f_col = "#1f77b4", "#d62728", "#7f7f7f"
    fig, ax = plt.subplots(2, 3, figsize=(17, 9.5))
    fig.suptitle(title, fontsize=11)
    start: dict[int, tuple[Point, Point | None]] = res["start"]
    ns = list(start)

    a = ax[0][0]
    a.loglog(ns, [c.seconds * 1e3 for c, _ in start.values()], "o-", color=c_col, label="croupier DistributedSampler")
    torch_points = {n: t for n, (_, t) in start.items() if t is not None}
    tn = list(torch_points)
    a.loglog(tn, [t.seconds * 1e3 for t in torch_points.values()], "s-", color=p_col, label="torch DistributedSampler")
    for n in ns:
        if start[n][1] is None:
            a.annotate("torch: n/a\n(does not fit)", (n, start[n][0].seconds * 1e3), textcoords="offset points",
                       xytext=(-70, 30), fontsize=8, color=p_col)
    a.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    a.yaxis.set_minor_formatter(ticker.NullFormatter())
    a.set(title=f"epoch start: time to first batch (rank 0 of {WORLD})", xlabel="N", ylabel="ms")
    a.legend(fontsize=8)
    a.grid(True, which="both", alpha=0.3)

    a = ax[0][1]
    a.semilogx(ns, [c.rss / MIB for c, _ in start.values()], "o-", color=c_col, label="croupier")
    a.semilogx(tn, [t.rss / MIB for t in torch_points.values()], "s-", color=p_col, label="torch")
    a.axhline(res["baseline"] / MIB, ls="--", color=f_col, label="imports only")
    a.set_yscale("log")
    rss = [c.rss / MIB for c, _ in start.values()] + [t.rss / MIB for t in torch_points.values()]
    a.set_yticks([v for v in (100, 200, 500, 1000, 2000, 5000, 10000, 20000) if min(rss) / 2 <= v <= max(rss) * 2])
    a.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    a.yaxis.set_minor_formatter(ticker.NullFormatter())
    a.set(title="epoch start: peak RSS per rank", xlabel="N", ylabel="MiB")
    a.legend(fontsize=8)
    a.grid(True, which="both", alpha=0.3)

    st = res["steady"]
    _log_bars(ax[0][2], ["torch\nsampler=", "croupier\nsampler=", "croupier\nembedded\ncoordinator",
                         "torch\nbatch_\nsampler=", "croupier\nbatch_\nsampler=", "torch\nbatch_s.=\ngetitems",
                         "croupier\nbatch_s.=\ngetitems", "reference:\nints made\nas it goes",
                         "ceiling:\nbatches\nmade before", "torch\npass-\nthrough", "croupier\npass-\nthrough",
                         "reference\npass-\nthrough", "ceiling\npass-\nthrough", "numpy\nfloor"],
              [st[k] / 1e6 for k in (*STEADY_CASES, "numpy")],
              [p_col, c_col, c_col, p_col, c_col, p_col, c_col, f_col, f_col, p_col, c_col, f_col, f_col, f_col], "{:.2f}")
    ax[0][2].set(title=f"steady state, DataLoader, N={_n(res['steady_n'])}", ylabel="M indices/s")

    c, t = res["resume"]
    _log_bars(ax[1][0], ["croupier\nload_state_dict", "torchdata\nreplay"], [c.seconds * 1e3, t.seconds * 1e3],
              [c_col, p_col], "{:,.1f} ms")
    ax[1][0].set(title=f"resume at half of an epoch of N={_n(res['resume_n'])}: time to first batch", ylabel="ms")

    a = ax[1][1]
    co = res["coordinator"]
    groups = [("empty, 1 in flight", co["floor1"], f_col), ("lease, 1 in flight", co["lease1"], c_col)]
    for w in res["rank_counts"]:
        groups += [(f"empty, {w} saturated", co[f"empty{w}"], f_col), (f"grant, {w} saturated", co[f"grant{w}"], c_col),
                   (f"lease, {w} saturated", co[f"lease{w}"], c_col), (f"empty, {w} paced", co[f"paced_empty{w}"], f_col),
                   (f"grant, {w} paced", co[f"paced_grant{w}"], c_col), (f"lease, {w} paced", co[f"paced_lease{w}"], c_col)]
    x = np.arange(len(groups))
    a.bar(x - 0.2, [g[1]["p50"] for g in groups], 0.4, color=[g[2] for g in groups], alpha=0.55, label="p50")
    a.bar(x + 0.2, [g[1]["p99"] for g in groups], 0.4, color=[g[2] for g in groups], label="p99")
    a.axhline(TARGET_P99_MS, ls="--", color=p_col, label=f"target p99 {TARGET_P99_MS:g} ms")
    a.set_xticks(x, [g[0] for g in groups], fontsize=7, rotation=35, ha="right")
    a.set_yscale("log")
    a.set(title="coordinator latency (light: p50, dark: p99; grey: empty call)", ylabel="ms")
    a.legend(fontsize=8)

    a = ax[1][2]
    names = ["join\n1 at a time", "join\n32 at once", "bare SQLite\ncommit"]
    vals3 = [co["commit1"], co["commit32"], co["sqlite"]]
    x = np.arange(3)
    a.bar(x - 0.2, [v["p50"] for v in vals3], 0.4, color=[c_col, c_col, f_col], alpha=0.55, label="p50")
    a.bar(x + 0.2, [v["p99"] for v in vals3], 0.4, color=[c_col, c_col, f_col], label="p99")
    a.set_xticks(x, names, fontsize=8)
    a.set(title="durable commit on the SQLite store", ylabel="ms")
    a.legend(fontsize=8)

    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes and short runs (what the test suite runs)")
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="where bench.md and bench.png go")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        mode, kw = args.child
        if mode == "drive":
            asyncio.run(_drive_forever())
            return 0
        print(RESULT + json.dumps(CHILDREN[mode](**json.loads(kw))), flush=True)
        return 0

    t_begin = time.perf_counter()
    load_before = _load()
    quick = args.quick
    sizes = [10**5, 10**6] if quick else [10**6, 10**7, 10**8, 10**9]
    repeats = 1 if quick else 3
    # croupier's points take milliseconds, so a few ms of jitter (an fsync, a thread switch) weigh on them:
    # they get more repeats, which cost seconds, where one repeat of torch at 1e8 costs ~20 s.
    croupier_repeats = 1 if quick else 7
    res: dict[str, Any] = {"rank_counts": [8, 64] if quick else [64, 512]}

    def step(what: str) -> None:
        print(f"[{time.perf_counter() - t_begin:6.1f} s] {what}", file=sys.stderr, flush=True)

    avail = TORCH_FITS_BYTES
    with contextlib.suppress(OSError, ValueError, IndexError):
        avail = min(avail, int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) * 1024 * 4 // 5)
    res["resume_n"] = 10**6 if quick else 10**8
    points: list[tuple[str, dict[str, Any]]] = [("baseline", {})]
    for n in sizes:
        points.append(("start", {"sampler": "croupier", "n": n}))
        if TORCH_BYTES_PER_INDEX * n <= avail:
            points.append(("start", {"sampler": "torch", "n": n}))
    points += [("resume", {"sampler": s, "n": res["resume_n"]}) for s in ("croupier", "torchdata")]

    def times(kw: dict[str, Any]) -> int:
        return croupier_repeats if kw.get("sampler") == "croupier" else repeats

    def run(mode: str, kw: dict[str, Any], i: int) -> dict[str, Any]:
        what = " ".join(f"{k}={_n(v) if k == 'n' else v}" for k, v in kw.items())
        step(f"{mode} {what}" + (f" ({i + 1}/{times(kw)})" if mode != "steady" else ""))
        return _run_child(mode, **kw)

    res["steady_n"] = 10**6
    steady_kw = {"n": res["steady_n"], "epochs": 1 if quick else 8, "repeats": 1 if quick else 3}
    # Whole epochs at a second N (the steady-state child gives them at steady_n): DataLoader(sampler=) only.
    epoch_kw = {"n": 10**5 if quick else 10**7, "epochs": 1 if quick else 3, "repeats": 1,
                "cases": ["torch", "croupier"], "floor": False}
    # One fresh process per point, one at a time. --quick, whose figures only show that the program
    # works, runs two children at a time and the coordinator's benchmarks beside them.
    got: dict[str, list[dict[str, Any]]] = {}
    with ThreadPoolExecutor(max_workers=2 if quick else 1) as pool:
        futures = [(mode, kw, pool.submit(run, mode, kw, i)) for mode, kw in points for i in range(times(kw))]
        futures += [("steady", kw, pool.submit(run, "steady", kw, 0)) for kw in (steady_kw, epoch_kw)]
        if not quick:
            for *_, future in futures:
                future.result()
        step("coordinator capacity and durable commits")
        # Paced: one interval between two calls of a rank (25.6 s), so that every rank asks once.
        res["coordinator"] = _coordinator(0.3 if quick else 5.0, 0.3 if quick else PACED_STEP_S * STEPS_PER_LEASE,
                                          res["rank_counts"], 10 if quick else 300, procs=2)
        for mode, kw, future in futures:
            got.setdefault(json.dumps([mode, kw]), []).append(future.result())

    def point(mode: str, **kw: Any) -> Point | None:
        runs = got.get(json.dumps([mode, kw]))
        if runs is None:
            return None
        return Point(statistics.median(r["seconds"] for r in runs), int(statistics.median(r["rss"] for r in runs)))

    def measured(mode: str, **kw: Any) -> Point:
        p = point(mode, **kw)
        if p is None:
            raise RuntimeError(f"no measurement of {mode} {kw}")
        return p

    base = got[json.dumps(["baseline", {}])]
    res["baseline"] = int(statistics.median(b["rss"] for b in base))
    versions = base[0]["versions"]
    res["start"] = {n: (measured("start", sampler="croupier", n=n), point("start", sampler="torch", n=n)) for n in sizes}
    res["resume"] = (measured("resume", sampler="croupier", n=res["resume_n"]),
                     measured("resume", sampler="torchdata", n=res["resume_n"]))
    res["steady"] = got[json.dumps(["steady", steady_kw])][0]
    res["epoch"] = {kw["n"]: got[json.dumps(["steady", kw])][0] for kw in sorted((steady_kw, epoch_kw),
                                                                                  key=lambda kw: kw["n"])}

    rows, notes = _rows(res)
    took = time.perf_counter() - t_begin
    command = "python benchmarks/bench.py" + (" --quick" if quick else "")
    machine = _machine(versions)
    table = _table(rows)
    print(table)
    print()
    for note in notes:
        print(f"- {note}")
    load = f"load average {load_before} before, {_load()} after"
    print(f"\n{command}: {took:.0f} s on {machine} ({load})")

    args.out.mkdir(parents=True, exist_ok=True)
    md = [f"# croupier benchmarks ({'quick' if quick else 'full'} run)", "",
          f"`{command}` took {took:.0f} s on {machine}, {time.strftime('%Y-%m-%d')} ({load}).", "",
          f"Every sampler is rank 0 of num_replicas={WORLD}; ratios read as \"x times better\" for croupier "
          "(below 1: the peer is better). Peak RSS is ru_maxrss of a fresh process per point; the growth is "
          "over a process that only imports the same modules.", "", table, "", *[f"- {n}" for n in notes], "",
          "![benchmarks](bench.png)", ""]
    (args.out / "bench.md").write_text("\n".join(md))
    _plot(res, args.out / "bench.png", f"croupier vs peers ({'quick' if quick else 'full'} run) — {machine}")
    step(f"wrote {args.out / 'bench.md'} and {args.out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
