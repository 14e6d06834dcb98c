"""The cost of committed-step dealing under torchft (``StepLoader``) at 8, 16 and 64 replica groups, beside torchft's own sampler.

One process drives G replica groups of one rank each (``StepLoader`` on ``tests/_ft_sim.py``'s
``FakeManager``, a stand-in of torchft's quorum, heal and commit calls with torchft's rules); each
group's rank 0 reports its committed steps from its own thread, for real, to a ``croupier serve``
child process on a SQLite store (its CPU and RSS read with psutil). Every attempt's quorum is every
group; one in ten aborts on every group; an attempt lasts at least ``--step-ms`` (the model steps,
the rest simulated by sleeping: a step's collectives and accelerator work). Measured per group
and attempt, on the training thread:

* ``next(loader)`` with no dataset (it yields the step's indices), and the ``should_commit`` hook;
* every RPC the loaders send (their ``CoordinatorClient`` calls, counted by method and thread);
* the coordinator's CPU (user + system) and RSS around the attempts, every report flushed;
* the step time of ``examples/torchft_train.py``'s model (``Linear(3, 1)``) and of a small MLP on a
  group's local batch (forward, backward, SGD step; no collectives), and group 0 in a process of its own;
* in a second pass without a coordinator, ``StepLoader`` beside a ``DataLoader`` over torchft's
  ``torchft.data.DistributedSampler`` (``num_replica_groups`` = G) on the same dataset (item ``i`` is ``i``).

    python benchmarks/ft_bench.py            # 8, 16, 64 groups, 1,000 attempts each: about 6 minutes
    python benchmarks/ft_bench.py --quick    # 30 attempts each, N = 100,000: seconds (tests/benchmarks/test_ft_bench.py)

Prints one table with the targets beside the figures and writes it to ``OUT/ft.md``; exits 1 when a
loader sent more than one call per committed step per group or any call from the training thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/_ft_sim.py, the stand-in of torchft's Manager

TARGET_ADDED_MS, TARGET_CALLS = 1.0, 1.0  # p99 the loader adds to a step; calls per committed step per group, at most
WARM = 10  # warm-up attempts before the timed ones (channels connected, the job's first record made)
GLOBAL_BATCH = 512  # the step's samples over all groups: 8 per group at 64 groups, as the example's --rank-batch


@dataclasses.dataclass
class Phase:
    """One group count's figures."""

    groups: int
    attempts: int = 0
    committed: int = 0
    next_us: list[float] = dataclasses.field(default_factory=list)  # per group and attempt
    hook_us: list[float] = dataclasses.field(default_factory=list)
    added_us: list[float] = dataclasses.field(default_factory=list)  # next + hook, per group and attempt
    added_cpu_us: list[float] = dataclasses.field(default_factory=list)  # the same, the training thread's CPU time
    calls: Counter[tuple[str, str]] = dataclasses.field(default_factory=Counter)  # (method, thread kind)
    recorded: int = 0  # steps the coordinator's record keeps
    warm_committed: int = 0  # steps the warm-up committed (recorded too)
    cpu_s: float = 0.0
    rss_before: int = 0
    rss_after: int = 0
    model_us: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    own_next_us: list[float] = dataclasses.field(default_factory=list)  # group 0 in a process of its own
    own_hook_us: list[float] = dataclasses.field(default_factory=list)
    own_added_us: list[float] = dataclasses.field(default_factory=list)
    own_added_cpu_us: list[float] = dataclasses.field(default_factory=list)
    own_calls: dict[str, int] = dataclasses.field(default_factory=dict)  # its calls: "reporter", "training"
    own_committed: int = 0
    ours_us: list[float] = dataclasses.field(default_factory=list)  # the second pass, with the dataset
    peer_us: list[float] = dataclasses.field(default_factory=list)
    peer_epoch_us: list[float] = dataclasses.field(default_factory=list)  # the peer's steps that start an epoch

    empty_us: float = 0.0  # the coordinator's CPU per empty call (health Check)

    @property
    def reports(self) -> int:
        return sum(n for (what, _), n in self.calls.items() if what == "commit_step")

    def per_group(self) -> float:
        return sum(self.calls.values()) / max(1, self.committed * self.groups)

    def own_ok(self) -> bool:
        return self.own_calls["reporter"] <= TARGET_CALLS * self.own_committed and self.own_calls["training"] == 0

    def on_training_path(self) -> int:
        return sum(n for (_, where), n in self.calls.items() if where == "training")


def _count_calls(client: Any, calls: Counter[tuple[str, str]], training: threading.Thread) -> None:
    """Counts every call `client` makes, by method and by thread (the training thread or another)."""
    inner = client._call

    def call(what: str, fn: Callable[[], Any], retry_for: float | None = None) -> Any:
        calls[what, "training" if threading.current_thread() is training else "reporter"] += 1
        return inner(what, fn, retry_for)

    client._call = call


def _models() -> dict[str, tuple[Any, Any]]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    example = nn.Linear(3, 1)
    mlp = nn.Sequential(nn.Linear(3, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    return {name: (m, torch.optim.SGD(m.parameters(), lr=0.05)) for name, m in
            (("example: Linear(3, 1)", example), ("MLP 3-256-256-1", mlp))}


def _model_step(model: Any, opt: Any, idx: Any) -> float:
    """One forward, backward and optimizer step on the example's features of `idx`; its time in µs."""
    import torch
    from torch import nn

    i = idx.double()
    x = torch.stack([torch.sin(i), torch.cos(i), torch.remainder(i, 7) / 7.0], 1).float()  # the example's item[1:]
    y = x @ torch.tensor([[0.5], [-1.0], [2.0]])
    t = time.perf_counter()
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return (time.perf_counter() - t) * 1e6


@dataclasses.dataclass
class Attempt:
    """One attempt's timings on the training thread, in µs: per loader (wall, CPU) of ``next`` and of the hook."""

    ok: bool
    next_us: list[tuple[float, float]]
    hook_us: list[tuple[float, float]]
    model_us: dict[str, float]


def attempt(sim: Any, members: tuple[int, ...], k: int, loaders: list[Any], models: dict[str, tuple[Any, Any]],
            others: list[Any], pace: float) -> Attempt:
    """Attempt `k` (one in ten aborts on every group): its quorum, every loader's batch, the step's work on
    the first loader's batch, every loader's commit, and the commits of the `others` (managers with no loader)."""
    ok, began = k % 10 != 9, time.perf_counter()
    sim.open(members, {g: ok for g in members})
    got = Attempt(ok, [], [], {})
    first = None
    for lo in loaders:
        c, t = time.thread_time(), time.perf_counter()
        batch = next(lo)
        got.next_us.append(((time.perf_counter() - t) * 1e6, (time.thread_time() - c) * 1e6))
        first = batch if first is None else first
    for name, (model, opt) in models.items():
        got.model_us[name] = _model_step(model, opt, first)
    time.sleep(max(0.0, pace - (time.perf_counter() - began)))  # the rest of a step of `pace` s (simulated work)
    for lo in loaders:
        c, t = time.thread_time(), time.perf_counter()
        lo._manager.should_commit()
        got.hook_us.append(((time.perf_counter() - t) * 1e6, (time.thread_time() - c) * 1e6))
    for m in others:
        m.should_commit()
    return got


def measure(groups: int, attempts: int, n: int, address: str, server_pid: int, pace: float) -> Phase:
    """The attempts of `groups` groups against the coordinator at `address` (process `server_pid`)."""
    import psutil

    from croupier.client import CoordinatorClient
    from croupier.integrations.torchft import StepLoader
    from tests._ft_sim import FtSim

    ph = Phase(groups)
    server = psutil.Process(server_pid)
    sim = FtSim()
    job = f"ft-bench-{groups}"
    training = threading.current_thread()
    loaders = [StepLoader(sim.add_group(g, 1)[0], n, global_batch=GLOBAL_BATCH, job=job, address=address,
                          group_rank=0, group_world=1) for g in range(groups)]
    for lo in loaders:
        _count_calls(lo._client, ph.calls, training)
    models = _models()
    ph.model_us, members = {name: [] for name in models}, tuple(range(groups))
    for k in range(WARM):
        ph.warm_committed += attempt(sim, members, k, loaders, models, [], pace).ok
    for lo in loaders:
        lo.flush()
    ph.calls.clear()
    cpu0 = server.cpu_times()
    ph.rss_before = server.memory_info().rss
    for k in range(attempts):
        a = attempt(sim, members, k, loaders, models, [], pace)
        ph.attempts, ph.committed = ph.attempts + 1, ph.committed + a.ok
        for name, us in a.model_us.items():
            ph.model_us[name].append(us)
        for (t_next, c_next), (t_hook, c_hook) in zip(a.next_us, a.hook_us):
            ph.next_us.append(t_next)
            ph.hook_us.append(t_hook)
            ph.added_us.append(t_next + t_hook)
            ph.added_cpu_us.append(c_next + c_hook)
    for lo in loaders:
        lo.flush()
    cpu1 = server.cpu_times()
    ph.rss_after = server.memory_info().rss
    ph.cpu_s = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    for lo in loaders:
        lo.close()
    with CoordinatorClient(address) as client:
        _, record = client.steps(job)
    ph.recorded = sum(len(r.steps) for r in record.runs)
    ph.empty_us = _empty_calls(address, server, max(100, min(ph.reports, 3000)))
    return ph


def _empty_calls(address: str, server: Any, calls: int) -> float:
    """The coordinator's CPU per empty call (gRPC health ``Check``, one channel), in µs: the floor of a call."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        check, empty = health_pb2_grpc.HealthStub(channel).Check, health_pb2.HealthCheckRequest()
        check(empty)
        before = server.cpu_times()
        for _ in range(calls):
            check(empty)
        after = server.cpu_times()
    return ((after.user + after.system) - (before.user + before.system)) / calls * 1e6


class GroupProcess:
    """The child process of :func:`own_group`, started once (it imports torch while the first phase runs)."""

    def __init__(self, attempts: int, n: int, address: str, step_ms: float) -> None:
        cmd = [sys.executable, __file__, "--own-group", "--attempts", str(attempts), "--n", str(n), "--address", address,
               "--step-ms", str(step_ms)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, line: str | None) -> str:
        """Sends `line` (None: nothing), returns the next line the process prints."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        got = self.proc.stdout.readline()
        if not got:
            raise RuntimeError(f"the group process exited {self.proc.wait()}")
        return got.strip()


def own_process(ph: Phase, attempts: int, n: int, address: str, child: GroupProcess, pace: float) -> None:
    """Group 0 in a child process of its own (its training thread and its one reporter thread), the other
    groups driven here as in :func:`measure`, all reporting to the coordinator: group 0's training path
    as a group's own process sees it. The two processes open the same quorums in the same order (the
    same steps, spans and quorum ids), each at its own pace."""
    from croupier.integrations.torchft import StepLoader
    from tests._ft_sim import FtSim

    job = f"ft-bench-{ph.groups}-own"
    sim = FtSim()
    raw = sim.add_group(0, 1)[0]
    loaders = [StepLoader(sim.add_group(g, 1)[0], n, global_batch=GLOBAL_BATCH, job=job, address=address, group_rank=0,
                          group_world=1) for g in range(1, ph.groups)]
    members = tuple(range(ph.groups))
    if child.ask(f"{ph.groups} {job}") != "ready":  # it starts its attempts as this one does
        raise RuntimeError("the group process did not answer 'ready'")
    for k in range(attempts + WARM):
        attempt(sim, members, k, loaders, {}, [raw], pace)
    for lo in loaders:
        lo.close()
    got = json.loads(child.ask(None))
    ph.own_next_us, ph.own_hook_us = [w for w, _ in got["next_us"]], [w for w, _ in got["hook_us"]]
    ph.own_added_us = [a[0] + b[0] for a, b in zip(got["next_us"], got["hook_us"])]
    ph.own_added_cpu_us = [a[1] + b[1] for a, b in zip(got["next_us"], got["hook_us"])]
    ph.own_calls, ph.own_committed = got["calls"], got["committed"]


def own_group(groups: int, job: str, args: argparse.Namespace) -> None:
    """The child of :class:`GroupProcess`, for one "GROUPS JOB" line: group 0's loader, its reports, and its
    timings as one JSON line."""
    from croupier.integrations.torchft import StepLoader
    from tests._ft_sim import FtSim

    sim = FtSim()
    lo = StepLoader(sim.add_group(0, 1)[0], args.n, global_batch=GLOBAL_BATCH, job=job, address=args.address,
                    group_rank=0, group_world=1)
    others = [sim.add_group(g, 1)[0] for g in range(1, groups)]
    calls: Counter[tuple[str, str]] = Counter()
    _count_calls(lo._client, calls, threading.current_thread())
    models = _models()
    members, committed = tuple(range(groups)), 0
    next_us: list[tuple[float, float]] = []  # (wall, CPU)
    hook_us: list[tuple[float, float]] = []
    print("ready", flush=True)
    for k in range(args.attempts + WARM):
        a = attempt(sim, members, k, [lo], models, others, args.step_ms / 1000)
        if k >= WARM:
            next_us.append(a.next_us[0])
            hook_us.append(a.hook_us[0])
            committed += a.ok
        elif k == WARM - 1:
            lo.flush()
            calls.clear()
    lo.close()
    print(json.dumps({"next_us": next_us, "hook_us": hook_us, "committed": committed,
                      "calls": {where: sum(c for (_, w), c in calls.items() if w == where)
                                for where in ("training", "reporter")}}), flush=True)


def peer_pass(ph: Phase, attempts: int, n: int) -> None:
    """StepLoader and torchft's sampler + DataLoader over the same dataset, per group and step, no coordinator."""
    from torch.utils.data import DataLoader
    from torchft.data import DistributedSampler as FtSampler

    from croupier.integrations.torchft import StepLoader
    from tests._ft_sim import FtSim

    g_count = ph.groups
    data: Any = range(n)  # item i is i
    sim = FtSim()
    ours = [StepLoader(sim.add_group(g, 1)[0], data, global_batch=GLOBAL_BATCH, address=None, job="ft-bench-peer",
                       group_rank=0, group_world=1) for g in range(g_count)]
    samplers = [FtSampler(data, replica_rank=g, num_replica_groups=g_count, group_rank=0, num_replicas=1, shuffle=True,
                          seed=0) for g in range(g_count)]
    peers: list[Any] = [DataLoader(data, batch_size=GLOBAL_BATCH // g_count, sampler=s) for s in samplers]
    its: list[Any] = [None] * g_count  # each made at its first step, timed
    epochs = [0] * g_count
    members = tuple(range(g_count))
    for _ in range(attempts):
        sim.open(members, {g: True for g in members})
        for lo in ours:
            t = time.perf_counter()
            next(lo)
            ph.ours_us.append((time.perf_counter() - t) * 1e6)
        for lo in ours:
            lo._manager.should_commit()
        for g in range(g_count):
            t = time.perf_counter()
            started = its[g] is None or next(its[g], None) is None
            if started:  # the first epoch's start, or the next one's: set_epoch, and its randperm(N) at iter()
                epochs[g] += its[g] is not None
                samplers[g].set_epoch(epochs[g])
                its[g] = iter(peers[g])
                next(its[g])
            us = (time.perf_counter() - t) * 1e6
            ph.peer_us.append(us)
            if started:
                ph.peer_epoch_us.append(us)


def _p(v: list[float], q: float) -> float:
    return float(np.percentile(v, q)) if v else float("nan")


def _us(v: list[float]) -> str:
    return f"{_p(v, 50):,.0f} / {_p(v, 99):,.0f} µs"


def table(phases: list[Phase], quick: bool) -> str:
    """The markdown table: one column per group count, the targets beside."""
    cols = " | ".join(f"{p.groups} groups" for p in phases)
    rows = [f"| measure | {cols} | target | met |", "|---|" + "---|" * len(phases) + "---|---|"]

    def row(name: str, cells: list[str], target: str = "-", met: str = "-") -> None:
        rows.append(f"| {name} | {' | '.join(cells)} | {target} | {met} |")

    last, per_group = phases[-1], [p.per_group() for p in phases]
    row("attempts (committed)", [f"{p.attempts:,} ({p.committed:,})" for p in phases])
    row("calls per committed step per group", [f"{v:.3f}" for v in per_group], f"<= {TARGET_CALLS:g}",
        "met" if all(v <= TARGET_CALLS for v in per_group) else "MISSED")
    row("calls per committed step per rank (1 rank per group)", [f"{v:.3f}" for v in per_group])
    row("calls on the training thread", [f"{p.on_training_path()}" for p in phases], "0",
        "met" if all(p.on_training_path() == 0 for p in phases) else "MISSED")
    row("steps in the coordinator's record / committed (warm-up included)",
        [f"{p.recorded:,} / {p.committed + p.warm_committed:,}" for p in phases])
    row("`next(loader)` p50 / p99 (indices only)", [_us(p.next_us) for p in phases])
    row("`should_commit` hook p50 / p99", [_us(p.hook_us) for p in phases])
    met = _p(last.added_us, 99) / 1000 < TARGET_ADDED_MS
    row("added per step (next + hook) p50 / p99, all groups in this process", [_us(p.added_us) for p in phases],
        f"p99 < {TARGET_ADDED_MS:g} ms at {last.groups} groups", "not judged (--quick)" if quick else
        "met" if met else "MISSED")
    row("the same, CPU time of the training thread (no wait for the GIL or a core)",
        [_us(p.added_cpu_us) for p in phases])
    own_met = _p(last.own_added_us, 99) / 1000 < TARGET_ADDED_MS
    row("group 0 in a process of its own: `next(loader)` p50 / p99", [_us(p.own_next_us) for p in phases])
    row("group 0 in a process of its own: hook p50 / p99", [_us(p.own_hook_us) for p in phases])
    row("group 0 in a process of its own: added per step p50 / p99", [_us(p.own_added_us) for p in phases],
        f"p99 < {TARGET_ADDED_MS:g} ms at {last.groups} groups", "not judged (--quick)" if quick else
        "met" if own_met else "MISSED")
    row("the same, CPU time of its training thread", [_us(p.own_added_cpu_us) for p in phases])
    row("group 0 in a process of its own: calls per committed step (training thread)",
        [f"{p.own_calls['reporter'] / max(1, p.own_committed):.3f} ({p.own_calls['training']})" for p in phases],
        f"<= {TARGET_CALLS:g} (0)", "met" if all(p.own_ok() for p in phases) else "MISSED")
    for name in last.model_us:
        row(f"model step, {name}, p50 / p99 (local batch {', '.join(str(GLOBAL_BATCH // p.groups) for p in phases)}; "
            "added p50 over its p50)", [f"{_us(p.model_us[name])} ({100 * _p(p.added_us, 50) / _p(p.model_us[name], 50):.0f}%)"
                                        for p in phases])
    row("coordinator CPU per committed step", [f"{1000 * p.cpu_s / max(1, p.committed):.2f} ms" for p in phases])
    row("coordinator CPU per report (per empty gRPC call: health `Check`, same server)",
        [f"{1e6 * p.cpu_s / max(1, p.reports):,.0f} µs ({p.empty_us:,.0f} µs)" for p in phases])
    row("coordinator RSS (growth over the attempts)",
        [f"{p.rss_after / 2**20:.0f} MiB ({(p.rss_after - p.rss_before) / 2**10:+,.0f} KiB)" for p in phases])
    row("StepLoader `next()`, same dataset + default_collate, p50 / p99", [_us(p.ours_us) for p in phases])
    row("peer: torchft `DistributedSampler` + `DataLoader` `next()`, p50 / p99 (no calls)",
        [_us(p.peer_us) for p in phases])
    row("peer: its steps that start an epoch (`iter()`: randperm(N)), mean (count)",
        [f"{np.mean(p.peer_epoch_us):,.0f} µs ({len(p.peer_epoch_us)})" for p in phases])
    row("StepLoader over the peer, p50 / p99 (above 1: the peer is cheaper)",
        [f"{_p(p.ours_us, 50) / _p(p.peer_us, 50):.2f}x / {_p(p.ours_us, 99) / _p(p.peer_us, 99):.2f}x" for p in phases])
    return "\n".join(rows)


def _machine() -> str:
    import torch

    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "unknown CPU")
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}; python "
            f"{platform.python_version()}, torch {torch.__version__}, torchft {version('torchft')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="30 attempts per group count, N = 100,000: seconds (the test suite's run)")
    parser.add_argument("--groups", default="8,16,64", help="the group counts, comma-separated (default 8,16,64)")
    parser.add_argument("--attempts", type=int, default=None, help="attempts per group count (default 1000; --quick 30)")
    parser.add_argument("--n", type=int, default=None, help="the dataset's size (default 1,000,000; --quick 100,000)")
    parser.add_argument("--step-ms", type=float, default=50.0, help="the least an attempt lasts, ms (default 50; 0: unpaced)")
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="where ft.md goes (default out/bench)")
    parser.add_argument("--own-group", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.own_group:
        for line in sys.stdin:
            own_group(int(line.split()[0]), line.split()[1], args)
        return 0
    groups = [int(g) for g in args.groups.split(",")]
    bad = [g for g in groups if g < 1 or GLOBAL_BATCH % g]
    if bad:
        parser.error(f"--groups {args.groups}: each must divide the global batch {GLOBAL_BATCH} ({bad} do not)")
    attempts = args.attempts if args.attempts is not None else 30 if args.quick else 1000
    n = args.n if args.n is not None else 100_000 if args.quick else 1_000_000
    if attempts < 1 or n < 1 or args.step_ms < 0:
        parser.error(f"--attempts {attempts}, --n {n}, --step-ms {args.step_ms:g}: at least 1, 1 and 0")
    logging.getLogger("croupier.integrations.torchft").setLevel(logging.ERROR)
    from croupier.tools.serve import ServeProcess

    machine = _machine()
    began, load0 = time.monotonic(), os.getloadavg()[0]
    phases = []
    with tempfile.TemporaryDirectory(prefix="croupier-ft-bench-") as tmp:
        server = ServeProcess(f"sqlite:///{tmp}/coordinator.db", sys.stderr).start()
        try:
            assert server.proc is not None
            child = GroupProcess(attempts, n, server.address, args.step_ms)
            try:
                for g in groups:
                    print(f"{g} groups: {attempts} attempts ...", file=sys.stderr, flush=True)
                    ph = measure(g, attempts, n, server.address, server.proc.pid, args.step_ms / 1000)
                    own_process(ph, attempts, n, server.address, child, args.step_ms / 1000)
                    peer_pass(ph, attempts, n)
                    phases.append(ph)
            finally:
                assert child.proc.stdin is not None
                child.proc.stdin.close()  # its end
                child.proc.wait(timeout=60)
        finally:
            server.terminate(30)
    took = time.monotonic() - began
    command = " ".join(["ft_bench.py", *(sys.argv[1:] if argv is None else argv)])
    text = "\n".join([
        f"Committed-step dealing (StepLoader) under a stand-in of torchft's Manager: {', '.join(map(str, groups))} "
        f"replica groups of 1 rank each in one process, global batch {GLOBAL_BATCH}, N = {n:,}, "
        f"{attempts:,} attempts per group count (1 in 10 aborted on every group), each at least {args.step_ms:g} ms (the "
        "model steps, the rest simulated by sleeping); reports sent to a `croupier serve` process on a SQLite store",
        "",
        table(phases, args.quick),
        "",
        f"(command: {command}; {took:.0f} s in all; machine: {machine}; load average {load0:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after)",
        "",
    ])
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ft.md").write_text(text)
    if any(p.per_group() > TARGET_CALLS or p.on_training_path() or not p.own_ok() for p in phases):
        print("FAILED: a loader sent more than one call per committed step per group, or one from the training thread",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
