"""The torchft run: a Lighthouse, replica groups of examples/torchft_train.py under torchrun, four faults, and the audit of what committed steps trained."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import IO, Any

import psutil  # type: ignore[import-untyped]

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "torchft_train.py"
#: Variables of the test's own environment that would point the trainer at another job or coordinator.
_CLEARED = ("CROUPIER_ADDRESS", "CROUPIER_INCARNATION", "CROUPIER_TOKEN", "CROUPIER_JOB", "TORCHFT_LIGHTHOUSE",
            "REPLICA_GROUP_ID", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The run: its sizes and the steps its faults happen at.

    Run 0 starts groups 0, 1, 2. Group `kill_group` is killed (``kill -9`` of its torchrun's whole
    process group) after step `kill_at` was dealt to it, and started again: it heals. Group
    `abort_group` reports an error to its manager after step `abort_at`'s backward pass, so that it
    does not commit that step while the others do. Group `kill_group` restarts at step `heal_at`,
    group 3 joins at step `join_at`.
    Every group is killed at step `preempt_at` (the whole job preempted), and run 1 starts groups 0
    and 1 from the last checkpoint, which trains to `steps`.
    """

    samples: int = 480
    batch: int = 48
    rank_batch: int = 8
    max_groups: int = 4
    steps: int = 30
    ckpt_every: int = 5
    kill_group: int = 2
    kill_at: int = 3
    heal_at: int = 6
    abort_group: int = 1
    abort_at: int = 8
    join_at: int = 11
    preempt_at: int = 17
    timeout: float = 120.0

    @property
    def epochs(self) -> int:
        """The epochs croupier's side trains (its batch divides the dataset: no step straddles two epochs)."""
        assert self.samples % self.batch == 0 and self.steps * self.batch % self.samples == 0, self
        return self.steps * self.batch // self.samples


class Group:
    """One replica group: ``torchrun --nproc-per-node 2`` of the trainer, in a session of its own."""

    def __init__(self, gid: int, run: int, args: list[str], env: dict[str, str], log: pathlib.Path) -> None:
        self.gid, self.run, self.log = gid, run, log
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--start-method=fork",
               str(EXAMPLE), *args]
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                         start_new_session=True)

    def kill(self) -> None:
        """kill -9 of torchrun and every process under it, and wait for them.

        NOTE: torchrun starts each rank in a session of its own, so a signal to torchrun's process
        group misses the ranks: they are found as torchrun's descendants, before torchrun dies.
        """
        try:
            agent = psutil.Process(self.proc.pid)
            agent.suspend()  # it starts no rank after this
            procs = [agent, *agent.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=30)
        self.proc.wait()

    def failed(self) -> str | None:
        """Its log's tail, if it exited non-zero by itself."""
        code = self.proc.poll()
        return None if code in (None, 0, -signal.SIGKILL) else f"group {self.gid} (run {self.run}) exited {code}:\n" \
            + self.log.read_text()[-4000:]


def waiting_at_lighthouse(address: str) -> int:
    """How many replica groups have asked the Lighthouse for the next quorum (its status page says)."""
    with urllib.request.urlopen(f"{address}/status", timeout=10) as page:
        text = page.read().decode()
    m = re.search(r"only have (\d+) participants", text)
    return int(m.group(1)) if m else 0


def records(steps: pathlib.Path) -> list[dict[str, Any]]:
    """Every rank's step lines."""
    out: list[dict[str, Any]] = []
    for path in sorted(steps.glob("*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return out


class Driver:
    """Starts and kills the groups of one side, waits on their logs and control files."""

    def __init__(self, side: str, work: pathlib.Path, plan: Plan, lighthouse: str, address: str, job: str) -> None:
        self.side, self.work, self.plan, self.lighthouse = side, work, plan, lighthouse
        self.env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
        self.env.update({"TORCHFT_LIGHTHOUSE": lighthouse, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
                         "CROUPIER_AUDIT_DIR": str(work / "audit")})
        self.common = ["--workdir", str(work), "--sampler", side, "--samples", str(plan.samples), "--batch",
                       str(plan.batch), "--rank-batch", str(plan.rank_batch), "--max-groups", str(plan.max_groups),
                       "--steps", str(plan.steps), "--ckpt-every", str(plan.ckpt_every), "--address", address,
                       "--job", job]
        self.groups: list[Group] = []

    def start(self, gid: int, run: int, *extra: str) -> Group:
        n = sum(g.gid == gid and g.run == run for g in self.groups)
        g = Group(gid, run, [*self.common, "--job-start", str(run), *extra], {**self.env, "REPLICA_GROUP_ID": str(gid)},
                  self.work / "logs" / f"run{run}-g{gid}-{n}.log")
        self.groups.append(g)
        return g

    def wait(self, what: str, done: Callable[[], bool]) -> None:
        """Polls `done` until it holds; fails when a group exited non-zero or after the plan's timeout."""
        deadline = time.monotonic() + self.plan.timeout
        while not done():
            for g in self.groups:
                if (err := g.failed()) is not None:
                    raise AssertionError(f"{self.side}: waiting for {what}: {err}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.side}: {what} did not happen within {self.plan.timeout} s; logs in "
                                     f"{self.work / 'logs'}")
            time.sleep(0.1)  # polling the logs, with the deadline above

    def committed(self) -> int:
        """The steps committed so far (the highest committed step + 1) in the logs."""
        return max((r["step"] + 1 for r in records(self.work / "steps") if r["committed"]), default=0)

    def held(self, run: int, gid: int, step: int) -> bool:
        return all((self.work / "control" / f"held-run{run}-g{gid}-r{r}-s{step}").exists() for r in (0, 1))

    def go(self, run: int, gids: tuple[int, ...], name: str) -> None:
        """Waits until every rank of groups `gids` is ready for its first step, then lets them go."""
        control = self.work / "control"
        self.wait(f"groups {gids} of run {run} ready", lambda: all(
            (control / f"ready-{name}-g{g}-r{r}").exists() for g in gids for r in (0, 1)))
        (control / name).write_text("")

    def join(self, run: int, gid: int, name: str, step: int) -> None:
        """Lets group `gid` (started with ``--wait-for NAME``) ask for its first quorum while the others wait
        at the gate before `step`, and opens the gate once the Lighthouse has its request: the others' next
        quorum is then the one it joins (alone, it is short of a majority of the groups heartbeating)."""
        self.go(run, (gid,), name)
        self.wait(f"group {gid}'s quorum request", lambda: waiting_at_lighthouse(self.lighthouse) >= 1)
        (self.work / "control" / f"gate-run{run}-s{step}").write_text("")

    def arrived(self, run: int, step: int, gids: tuple[int, ...]) -> None:
        """Waits until every rank of groups `gids` waits at the gate before `step`."""
        control = self.work / "control"
        self.wait(f"groups {gids} at the gate of step {step}", lambda: all(
            (control / f"at-gate-run{run}-g{g}-r{r}-s{step}").exists() for g in gids for r in (0, 1)))

    def gate(self, run: int, step: int, gids: tuple[int, ...]) -> None:
        """Waits until groups `gids` wait at the gate before `step`, then opens it."""
        self.arrived(run, step, gids)
        (self.work / "control" / f"gate-run{run}-s{step}").write_text("")

    def kill_strays(self) -> None:
        """kill -9 of any rank a killed torchrun left behind (each rank names itself in WORKDIR/control/pid-*)."""
        for path in (self.work / "control").glob("pid-*"):
            try:
                p = psutil.Process(int(path.name.split("-")[1]))
                if str(EXAMPLE) in p.cmdline() and str(self.work) in p.cmdline():
                    p.kill()
            except psutil.NoSuchProcess:
                pass

    def kill_all(self) -> None:
        for g in self.groups:
            g.kill()


def drive(side: str, work: pathlib.Path, plan: Plan, lighthouse: str, address: str = "", job: str = "ft",
          extra: tuple[str, ...] = ()) -> None:
    """One side's run of `plan`, every fault injected in turn; every group is killed when it returns or fails.

    torchft's steps take milliseconds here, so the groups wait at gates (before a step's quorum) for
    the faults to be set up: at `kill_at` (then group `kill_group` is released into the step and killed),
    at `heal_at` (group `kill_group`'s new torchrun joins and heals), at `join_at` (group 3 joins).

    NOTE: the processes of the groups that join later (the killed group's new torchrun, group 3) are
    started with the first ones and wait, imported, before creating their torchft Manager: unknown to
    the Lighthouse until they are let go, they join as a group started then would. Their imports
    overlap the run's instead of adding to it (a group's start takes 10 to 20 s on 2 busy cores).
    """
    d = Driver(side, work, plan, lighthouse, address, job)
    d.common += extra
    try:
        hold = ["--hold-at", str(plan.preempt_at)]
        for gid in (0, 1, 2):
            killed = gid == plan.kill_group
            faults = ["--hold-at", str(plan.kill_at)] if killed else hold
            gates = [0, plan.kill_at] if killed else [0, plan.kill_at, plan.heal_at, plan.join_at]
            if gid == plan.abort_group:
                faults = [*faults, "--abort-at", str(plan.abort_at)]
            d.start(gid, 0, *faults, "--gates", ",".join(map(str, gates)))
        # the groups that join later start now, imported and waiting: torchft knows them once they are let go
        d.start(plan.kill_group, 0, *hold, "--gates", str(plan.join_at), "--wait-for", "heal-run0")
        d.start(3, 0, *hold, "--wait-for", "join-run0")
        d.gate(0, 0, (0, 1, 2))  # the first quorum has them all
        # 1. a group killed mid-step (its step dealt, its forward pass not run), then started again: it heals
        d.gate(0, plan.kill_at, (0, 1, 2))
        d.wait(f"group {plan.kill_group} held at step {plan.kill_at}", lambda: d.held(0, plan.kill_group, plan.kill_at))
        d.groups[plan.kill_group].kill()
        d.arrived(0, plan.heal_at, tuple(g for g in (0, 1, 2) if g != plan.kill_group))
        d.join(0, plan.kill_group, "heal-run0", plan.heal_at)
        # 2. the abort is planted by --abort-at; 3. a fourth group joins at a step
        d.arrived(0, plan.join_at, (0, 1, 2))
        d.join(0, 3, "join-run0", plan.join_at)
        # 4. the whole job preempted at a step, every group killed, run 1 starts 2 groups from the last checkpoint
        d.wait(f"every group held at step {plan.preempt_at}",
               lambda: all(d.held(0, g, plan.preempt_at) for g in (0, 1, 2, 3)))
        d.kill_all()
        resumed = plan.preempt_at // plan.ckpt_every * plan.ckpt_every
        last = [d.start(gid, 1, "--resume", "--gates", str(resumed)) for gid in (0, 1)]
        d.gate(1, resumed, (0, 1))
        d.wait("run 1's groups finished", lambda: all(g.proc.poll() == 0 for g in last))
    finally:
        d.kill_all()
        d.kill_strays()


@dataclasses.dataclass
class Audit:
    """What the kept committed steps of one side trained.

    `epochs` rows are (epoch, trained, duplicates, missing, complete): croupier's epoch ``e`` is its
    stream's positions ``[e * N, (e + 1) * N)`` (its steps in order); torchft's sampler's is the epoch
    its samplers were in, complete when the last run's samplers went past it.
    """

    side: str
    steps: int = 0
    batches: list[int] = dataclasses.field(default_factory=list)  # each kept step's global batch, by step
    epochs: list[tuple[int, int, int, int, bool]] = dataclasses.field(default_factory=list)
    trained: int = 0
    never: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def complete(self) -> list[tuple[int, int, int, int, bool]]:
        return [e for e in self.epochs if e[4]]

    @property
    def duplicates(self) -> int:
        """Samples trained more than once within an epoch, over the complete epochs."""
        return sum(e[2] for e in self.complete)

    @property
    def missing(self) -> int:
        """Samples an epoch never trained, over the complete epochs."""
        return sum(e[3] for e in self.complete)


def kept_steps(recs: list[dict[str, Any]], problems: list[str]) -> dict[int, list[dict[str, Any]]]:
    """Step -> the records of the attempt that committed it, on the kept timeline.

    Runs are taken in order; a run that starts at step c (a whole-job restart from checkpoint c)
    abandons the earlier runs' steps >= c. An attempt is (run, step, quorum id); it committed when
    some group committed it, and then it trained the indices of every rank of its quorum (the
    allreduce ran: a group that did not commit had its gradient in the others' update).
    """
    attempts: dict[tuple[int, int, int], list[dict[str, Any]]] = collections.defaultdict(list)
    for r in recs:
        attempts[(r["run"], r["step"], r["quorum"])].append(r)
    kept: dict[int, list[dict[str, Any]]] = {}
    for run in sorted({r["run"] for r in recs}):
        start = min(r["step"] for r in recs if r["run"] == run)
        kept = {s: a for s, a in kept.items() if s < start}
        for (rn, step, _), att in sorted(attempts.items()):
            if rn != run or not any(r["committed"] for r in att):
                continue
            if step in kept:
                problems.append(f"run {run}: step {step} committed by two attempts")
            kept[step] = att
    return kept


def audit(side: str, work: pathlib.Path, plan: Plan) -> Audit:
    """Counts what `side`'s kept committed steps trained, per epoch and over the whole run; a step's
    participants must be the groups that logged it, each with both ranks."""
    a = Audit(side)
    recs = records(work / "steps")
    kept = kept_steps(recs, a.problems)
    a.steps = len(kept)
    if sorted(kept) != list(range(plan.steps)):
        a.problems.append(f"kept steps are not 0..{plan.steps - 1}: missing {sorted(set(range(plan.steps)) - set(kept))}")
    per_epoch: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    whole: collections.Counter[int] = collections.Counter()
    position = 0
    for step in sorted(kept):
        att = kept[step]
        idx = [i for r in att for i in r["indices"]]
        a.batches.append(len(idx))
        groups = collections.Counter(r["group"] for r in att)
        if any(r["participants"] != len(groups) for r in att) or set(groups.values()) != {2}:
            a.problems.append(f"step {step}: participants {sorted({r['participants'] for r in att})}, ranks logged "
                              f"per group {dict(groups)}")
        whole.update(idx)
        if side == "croupier":
            if position // plan.samples != (position + len(idx) - 1) // plan.samples:
                a.problems.append(f"step {step} straddles two epochs (positions {position}..{position + len(idx)})")
            per_epoch[position // plan.samples].update(idx)
            position += len(idx)
        else:
            for r in att:
                per_epoch[r["epoch"]].update(r["indices"])
    if side == "croupier":
        done = position // plan.samples
    else:
        last = max(r["run"] for r in recs)
        done = max(r["epoch"] for r in recs if r["run"] == last)
    for e in sorted(per_epoch):
        c = per_epoch[e]
        a.epochs.append((e, sum(c.values()), sum(v - 1 for v in c.values()), plan.samples - len(c), e < done))
    a.trained = sum(whole.values())
    a.never = sum(whole[i] == 0 for i in range(plan.samples))
    return a


def table(audits: list[Audit], plan: Plan) -> str:
    """The comparison: one row per side, then each side's epochs."""
    lines = [f"N={plan.samples}, {plan.steps} committed steps; faults: group {plan.kill_group} killed mid-step "
             f"{plan.kill_at} and healed at {plan.heal_at}, step {plan.abort_at} aborted on group {plan.abort_group}, "
             f"group 3 joined at step {plan.join_at}, the whole job preempted at step {plan.preempt_at} and resumed "
             f"on 2 groups from the step-{plan.preempt_at // plan.ckpt_every * plan.ckpt_every} checkpoint",
             "| sampler | kept steps | samples trained | global batch per step | complete epochs "
             "| duplicates in them | missing in them | never trained in the run |",
             "|---|---|---|---|---|---|---|---|"]
    for a in audits:
        lo, hi = (min(a.batches), max(a.batches)) if a.batches else (0, 0)
        lines.append(f"| {a.side} | {a.steps} | {a.trained} | {lo}..{hi} | {len(a.complete)} | {a.duplicates} "
                     f"| {a.missing} | {a.never} |")
    for a in audits:
        rows = ", ".join(f"{e}: {t} trained, {d} dup, {m} missing{'' if c else ' (partial)'}" for e, t, d, m, c in a.epochs)
        lines.append(f"{a.side} by epoch: {rows}")
        if a.problems:
            lines.append(f"{a.side} problems: {'; '.join(a.problems)}")
    return "\n".join(lines)


@contextlib.contextmanager
def lighthouse() -> Iterator[str]:
    """torchft's Lighthouse in this process (min_replicas=1, a short tick, join and heartbeat timeouts); its address."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=50,
                              heartbeat_timeout_ms=1500)
    try:
        yield server.address()
    finally:
        server.shutdown()


def run_side(side: str, work: pathlib.Path, plan: Plan, address: str = "", job: str = "ft",
             extra: tuple[str, ...] = ()) -> Audit:
    """`side`'s run of `plan` under a Lighthouse of its own, audited."""
    with lighthouse() as lh:
        drive(side, work, plan, lh, address, job, extra)
    return audit(side, work, plan)


def serve_log() -> IO[str]:
    """A temporary file for a coordinator's output."""
    return tempfile.NamedTemporaryFile("w+", prefix="croupier-serve-", suffix=".log")
