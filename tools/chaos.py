"""`croupier chaos`: random SIGKILLs, rollbacks and resizes of a real torchrun job and its coordinator, audited.

One standalone coordinator (``croupier serve`` on a SQLite store) and a sequence of torchrun
launches of the demo trainer (``croupier.tools.demo_train``) pointed at it. Each launch runs
with a random world size between 1 and 4 and ``--max-restarts=0``; after the job has made some
random progress (read from the trainer's status files) one fault is injected:

* ``rank``: SIGKILL of one random worker; torchrun stops the job, which is relaunched from the
  latest checkpoint;
* ``coordinator``: SIGKILL of the coordinator, restarted on the same port; the running ranks
  retry with backoff and carry on (several of these can hit one launch);
* ``preempt``: SIGKILL of every process of the job, relaunched from the latest checkpoint or from
  an older one (the model, the optimizer and the sampler's state roll back together).

The trainer keeps every checkpoint (``keep_checkpoints``) and resumes from the one the
orchestrator names (``resume_from``); a rollback deletes the checkpoints after the one it resumes
from, so that the history is the chain the job follows. After every launch the audit log is
checked (no duplicates so far in any epoch, the finished ones complete), and so is the launch's
resume point (its samplers resumed from the checkpoint its model came from); at the end, every
epoch must be finished and pass the audit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any

from croupier.tools.audit import EpochReport, audit, load, render
from croupier.tools.cluster import descendants, statuses

JOB = "chaos"
TRAINER = "croupier.tools.demo_train"
BATCH = 12  # per worker; with N a multiple of 12 every world size 1..4 consumes whole steps: no pad, no repeats
CKPT_EVERY = 2  # steps
LEASE_AHEAD = 24  # indices per lease: every rank calls the coordinator every other step
ROLLBACK_DEPTH = 8  # an older checkpoint is one of the last 8 before the latest
POLL = 0.02  # seconds: the watch loop's refresh interval
END_MARGIN = 0.5  # seconds of training before the end of the job: the last moment to inject a fault still due
#: Simulated compute per training step. The ranks train on while the coordinator restarts, so a
#: job of tiny steps would end before the faults due could land.
STEP_MS = 40
RESTART_S = 1.5  # seconds a coordinator restart is expected to take, until one is measured
STALL = 120.0  # seconds without a step: the run has hung
KINDS = ("rank", "coordinator", "preempt")
WEIGHTS = (0.35, 0.25, 0.40)


class ChaosError(RuntimeError):
    """Something the chaos run did not inject went wrong: a crash, a hang, an audit violation."""


@dataclasses.dataclass
class Tally:
    """What the run injected."""

    rank_kills: int = 0
    coordinator_kills: int = 0
    preemptions: int = 0
    older_restarts: int = 0  # relaunches from a checkpoint older than the latest
    resizes: int = 0
    launches: int = 0
    rollback_steps: int = 0  # steps undone by restarts from older checkpoints

    @property
    def faults(self) -> int:
        return self.rank_kills + self.coordinator_kills + self.preemptions


def _alive_trainer(pid: int) -> bool:
    """`pid` still runs the demo trainer (so that a recycled pid is never killed)."""
    try:
        return TRAINER.encode() in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Coordinator:
    """``croupier serve`` on WORKDIR/coordinator.db in a child process; restarted on the same port after a kill."""

    def __init__(self, db: pathlib.Path, log: IO[str]) -> None:
        self.db = db
        self.log = log
        self.port = 0
        self.address = ""
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "croupier.tools.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--store", f"sqlite:///{self.db}"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.proc = proc
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("listening on "):
            proc.kill()
            proc.wait()
            raise ChaosError(f"croupier serve --port {self.port} did not start (exit {proc.returncode}, first line "
                             f"{line!r}); see {self.log.name}")
        self.address = line.split()[-1]
        self.port = int(self.address.rsplit(":", 1)[1])
        threading.Thread(target=self._drain, args=(proc.stdout,), daemon=True).start()

    def _drain(self, out: IO[str]) -> None:
        for line in out:
            self.log.write(line)
            self.log.flush()

    def check(self) -> None:
        """Raises ChaosError if the coordinator died without being killed."""
        if self.proc is not None and self.proc.poll() is not None:
            raise ChaosError(f"the coordinator exited by itself (exit {self.proc.returncode}); see {self.log.name}")

    def kill(self) -> None:
        """kill -9, and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _where(statuses: list[dict[str, Any]]) -> str:
    """Where the furthest rank is, from its status file."""
    if not statuses:
        return "an unknown step"
    s = max(statuses, key=lambda s: (s["epoch"], s["step"]))
    return f"epoch {s['epoch']} step {s['step']}"


def _history(work: pathlib.Path) -> list[pathlib.Path]:
    """The checkpoints kept, oldest first."""
    return sorted((work / "ckpts").glob("step-*.pt"))


def _step_of(ckpt: pathlib.Path | None) -> int:
    return int(ckpt.stem.split("-")[1]) if ckpt is not None else 0


def _check_audit(work: pathlib.Path, when: str) -> list[EpochReport]:
    """Audits what has been trained so far; raises ChaosError on a violation of G1."""
    if not any((work / "audit").glob("*/*.audit")):
        return []
    reports = audit(work / "audit")
    bad = [r for r in reports if not r.ok]
    if bad:
        print("\n" + render(reports), flush=True)
        raise ChaosError(f"the audit {when} found G1 violated in epochs {[r.epoch for r in bad]}: "
                         + "; ".join(f"epoch {r.epoch}: {r.why}" for r in bad))
    return reports


def _origin_of(ckpt: pathlib.Path | None) -> str | None:
    """The origin of the sampler state saved in a checkpoint (where the state was made); None: a fresh start."""
    if ckpt is None:
        return None
    import torch

    origin = torch.load(ckpt, weights_only=True)["sampler"].get("origin")
    return str(origin) if origin is not None else None


def _check_resumed(work: pathlib.Path, number: int, since: float, ckpt: pathlib.Path | None) -> None:
    """Checks that launch `number` (started at `since`) resumed its data from `ckpt`, as its model did.

    The audit follows the chain the samplers logged; this ties that chain to the checkpoints the
    orchestrator handed out, so that a trainer that restores the model but not the sampler fails too.
    """
    incs = [i for i in load(work / "audit").get(JOB, []) if i.ts >= since] if (work / "audit").exists() else []
    if not incs:
        return  # no rank of this launch got as far as its first batch
    expected, got = _origin_of(ckpt), incs[0].origin
    if got != expected:
        raise ChaosError(f"launch {number} resumed from {ckpt.name if ckpt else 'scratch'}, whose sampler state is "
                         f"{expected or 'a fresh start'}, but its samplers logged {got or 'a fresh start'}: the data "
                         "did not roll back with the model")


class Run:
    """The orchestration of one chaos run."""

    def __init__(self, work: pathlib.Path, faults: int, epochs: int, n: int, rng: random.Random,
                 coordinator: Coordinator, log: IO[str]) -> None:
        self.work = work
        self.faults = faults
        self.restart_s = RESTART_S  # the longest coordinator restart seen so far
        self.first_kinds = rng.sample(KINDS, len(KINDS))
        self.epochs = epochs
        self.n = n
        self.rng = rng
        self.coordinator = coordinator
        self.log = log
        self.tally = Tally()
        self.proc: subprocess.Popen[bytes] | None = None
        self.pids: set[int] = set()  # the current launch's workers, as seen in status files and /proc

    # ---------------------------------------------------------------- one launch

    def launch(self, world: int, resume: pathlib.Path | None) -> None:
        status = self.work / "status"
        # NOTE: a worker of the launch just killed may still be writing its status as it dies.
        shutil.rmtree(status, ignore_errors=True)
        status.mkdir(exist_ok=True)
        for stale in status.glob("*"):
            stale.unlink(missing_ok=True)
        cfg = {"workdir": str(self.work), "n": self.n, "epochs": self.epochs, "batch_size": BATCH,
               "ckpt_every": CKPT_EVERY, "keep_checkpoints": True, "lease_ahead": LEASE_AHEAD, "step_ms": STEP_MS,
               "resume_from": str(resume) if resume is not None else None}
        env = {**os.environ, "DEMO": json.dumps(cfg), "CROUPIER_ADDRESS": self.coordinator.address,
               "CROUPIER_JOB": JOB, "CROUPIER_AUDIT_DIR": str(self.work / "audit"), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        env.pop("CROUPIER_TOKEN", None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "--max-restarts=0", "--monitor-interval=0.2", "-m", TRAINER]
        self.log.write(f"\n===== launch {self.tally.launches}: {world} workers, resume_from={resume}\n")
        self.log.flush()
        self.pids = set()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=self.log, start_new_session=True)

    def kill_launch(self) -> None:
        """SIGKILL of torchrun's process group and of every worker (each in a session of its own)."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            self.pids.update(descendants(proc.pid))
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in self.pids:
            if _alive_trainer(pid):
                _sigkill(pid)

    def _progress(self, s: dict[str, Any]) -> int:
        """An estimate of the samples the job has trained (epochs before this one, and this one's part)."""
        left = (s["of"] - s["k"]) * s["world"] * BATCH
        return int(s["epoch"]) * self.n + max(0, self.n - int(left))

    def _gap(self, kind: str, s: dict[str, Any]) -> int:
        """Steps from now to the next fault: the remaining work spread over the remaining faults, at random."""
        remaining = max(0, self.epochs * self.n - self._progress(s))
        per_fault = remaining / (self.faults - self.tally.faults + 1)
        # NOTE: below the mean on average: the job also moves on while the orchestrator looks and while
        # the coordinator restarts.
        steps = math.ceil(per_fault * self.rng.uniform(0.2, 1.0) / (int(s["world"]) * BATCH))
        # A relaunch needs a checkpoint past the one it resumed from to make progress.
        return max(steps, 1 if kind == "coordinator" else CKPT_EVERY + 1)

    def watch(self, world: int, number: int) -> str:
        """Watches the launch and injects faults.

        Returns:
            What ended the launch: "finished", "rank", "preempt", or "rollback" (a preemption that
            must resume from an older checkpoint).
        """
        proc = self.proc
        assert proc is not None
        status = self.work / "status"
        target: tuple[str, int] | None = None  # (kind, step) of the next fault
        last_step, last_change, last_line = -1, time.monotonic(), ""
        first: tuple[float, int] | None = None  # (time, step) of the first status seen: the pace of this launch
        while proc.poll() is None:
            self.coordinator.check()
            st = statuses(status)
            self.pids.update(s["pid"] for s in st)
            live = [s for s in st if not s.get("done")]
            if live:
                s0 = max(live, key=lambda s: (s["epoch"], s["step"]))
                now = time.monotonic()
                if s0["step"] != last_step:
                    last_step, last_change = s0["step"], now
                if first is None:
                    first = (now, s0["step"])
                frac = min(1.0, s0["k"] / max(1, s0["of"]))
                line = (f"  [launch {number}, {world} workers] epoch {s0['epoch']} "
                        f"{'#' * int(frac * 20):.<20} {s0['k']:>3}/{s0['of']:<3} step {s0['step']:>4} "
                        f"loss {s0['loss']:.4f}  faults {self.tally.faults}/{self.faults}")
                if line != last_line:
                    print("\r" + line.ljust(100), end="", flush=True)
                    last_line = line
                if target is None and self.tally.faults < self.faults:
                    # The first faults are one of each kind (in a random order), so that even a short
                    # run has them all; the rest are drawn by weight.
                    kind = (self.first_kinds[self.tally.faults] if self.tally.faults < len(self.first_kinds)
                            else self.rng.choices(KINDS, WEIGHTS)[0])
                    target = (kind, s0["step"] + self._gap(kind, s0))
                # NOTE: a fault due after the end of the job comes just before the end instead, so
                # that the run injects every fault it was asked for; unless it is the last one, it is
                # a preemption that rolls back to an older checkpoint, which leaves room for the rest.
                # NOTE: the ranks train on while the coordinator restarts (and this loop waits for it),
                # so a coordinator kill needs that long before the end to leave room for the next fault.
                pace = (now - first[0]) / (s0["step"] - first[1]) if s0["step"] > first[1] else 0.1  # s/step
                allowance = self.restart_s if target is not None and target[0] == "coordinator" else 0.0
                steps_left = (s0["of"] - s0["k"]) + (self.epochs - 1 - s0["epoch"]) * math.ceil(
                    self.n / (int(s0["world"]) * BATCH))
                near_end = steps_left * pace <= END_MARGIN + allowance
                if target is not None and (s0["step"] >= target[1] or near_end):
                    kind = target[0]
                    early = s0["step"] < target[1] or (near_end and kind == "coordinator")
                    rollback = early and self.tally.faults + 1 < self.faults
                    if rollback:
                        kind = "preempt"
                    if kind == "coordinator":
                        self.coordinator.kill()
                        self.tally.coordinator_kills += 1
                        at = _where(statuses(status))
                        t = time.monotonic()
                        self.coordinator.start()
                        took = time.monotonic() - t
                        self.restart_s = max(self.restart_s, took)
                        self._say(f"SIGKILL of the coordinator at {at}; restarted on port {self.coordinator.port} "
                                  f"in {took:.1f} s, the ranks carry on")
                        target = None
                        continue
                    if kind == "rank":
                        # Drawn by rank (not from the status files read) so that a seed replays the same choices.
                        r = self.rng.randrange(world)
                        victim = next((s for s in live if s["rank"] == r), s0)
                        if _alive_trainer(victim["pid"]):
                            _sigkill(victim["pid"])
                        self.tally.rank_kills += 1
                        at = _where([s for s in statuses(status) if s["rank"] == victim["rank"]])
                        self._say(f"SIGKILL of rank {victim['rank']} of {world} (pid {victim['pid']}) at {at}")
                        try:
                            proc.wait(timeout=60)
                        except subprocess.TimeoutExpired:
                            raise ChaosError(f"torchrun did not stop within 60 s after rank {victim['rank']} "
                                             f"was killed; see {self.log.name}") from None
                        self.kill_launch()  # whatever torchrun left running
                        return "finished" if proc.returncode == 0 else "rank"
                    self.kill_launch()
                    self.tally.preemptions += 1
                    self._say(f"preempted: SIGKILL of torchrun and all {world} workers at {_where(statuses(status))}")
                    return "rollback" if rollback else "preempt"
            if time.monotonic() - last_change > STALL:
                raise ChaosError(f"no training step for {STALL:.0f} s (launch {number}, {world} workers); "
                                 f"see {self.log.name}")
            time.sleep(POLL)  # the progress line's refresh interval
        self.kill_launch()
        if proc.returncode != 0:
            raise ChaosError(f"torchrun with {world} workers failed by itself (exit {proc.returncode}) in launch "
                             f"{number}; see {self.log.name}")
        return "finished"

    def _say(self, what: str) -> None:
        print(f"\n  ! fault {self.tally.faults}/{self.faults}: {what}", flush=True)

    # ---------------------------------------------------------------- the run

    def choose_checkpoint(self, older: bool) -> tuple[pathlib.Path | None, bool]:
        """The checkpoint to resume from (None: from scratch) and whether it is an older one than the latest.

        A rollback deletes the checkpoints after the one chosen: they belong to a future that did not happen.
        """
        hist = _history(self.work)
        if not hist:
            return None, False
        if not older or len(hist) < 2:
            return hist[-1], False
        chosen = hist[max(0, len(hist) - 1 - self.rng.randint(1, ROLLBACK_DEPTH))]
        for f in hist[hist.index(chosen) + 1:]:
            f.unlink()
        self.tally.rollback_steps += _step_of(hist[-1]) - _step_of(chosen)
        return chosen, True

    def run(self) -> list[EpochReport]:
        resume: pathlib.Path | None = None
        world_before = 0
        while True:
            world = self.rng.randint(1, 4)
            if world_before and world != world_before:
                self.tally.resizes += 1
            self.tally.launches += 1
            number = self.tally.launches
            frm = f"from {resume.name}" if resume is not None else "from scratch"
            change = f", resized {world_before} -> {world}" if world_before and world != world_before else ""
            print(f"launch {number}: torchrun with {world} workers {frm}{change}", flush=True)
            since = time.time()
            self.launch(world, resume)
            try:
                outcome = self.watch(world, number)
            finally:
                self.kill_launch()
            _check_resumed(self.work, number, since, resume)
            _check_audit(self.work, f"after launch {number}")
            if outcome == "finished":
                print(flush=True)
                break
            older = outcome == "rollback" or (outcome == "preempt" and self.rng.random() < 0.5)
            resume, was_older = self.choose_checkpoint(older)
            if was_older:
                self.tally.older_restarts += 1
                print(f"  rolled back to {resume.name if resume else 'scratch'}: model, optimizer and data together",
                      flush=True)
            world_before = world
        return _check_audit(self.work, "at the end")


def _summary(t: Tally, reports: list[EpochReport], seconds: float) -> str:
    samples = sum(r.trained for r in reports)
    dups = sum(r.duplicates for r in reports)
    missing = sum(r.missing for r in reports)
    return (f"chaos: {t.faults} faults injected ({t.rank_kills} rank kills, {t.coordinator_kills} coordinator kills, "
            f"{t.preemptions} preemptions), {t.resizes} resizes, {t.older_restarts} restarts from an older checkpoint "
            f"({t.rollback_steps} steps rolled back), "
            f"{t.launches} launches; {samples} samples audited over {len(reports)} epochs: {dups} duplicates, "
            f"{missing} missing; G1 holds ({seconds:.0f} s)")


def main(workdir: str = "out/chaos", faults: int = 100, epochs: int = 6, n: int = 3600,
         seed: int | None = None) -> int:
    """Runs the chaos run; returns 0 when every audit passes, 1 on a violation or an unexpected failure.

    Args:
        workdir: Where the coordinator's store, the checkpoints, the logs and the audit log go
            (emptied first).
        faults: Kills to inject (rank, coordinator and whole-job kills); resizes come on top.
        epochs: Epochs of the training job.
        n: Samples in the synthetic dataset; a multiple of 12 makes every epoch exactly-once
            with no pad repeats at any world size 1..4.
        seed: Seed of the run's random choices (default: a random one, printed).

    Raises:
        ValueError: a setting out of range.
    """
    if faults < 0 or epochs < 1 or n < 1:
        raise ValueError(f"faults must be >= 0, epochs and n >= 1 (got {faults=}, {epochs=}, {n=})")
    if n < 4 * BATCH:
        raise ValueError(f"n must be at least {4 * BATCH} so that 4 workers each get a batch (got {n=})")
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    work = pathlib.Path(workdir).resolve()
    if work.exists() and any(work.iterdir()) and not (work / "train.log").exists():
        raise ValueError(f"workdir {work} is not empty and holds no earlier chaos run (no train.log); "
                         "refusing to empty it")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    print(f"croupier chaos: {faults} faults over {epochs} epochs of {n} samples, batch {BATCH} per worker, "
          f"a checkpoint every {CKPT_EVERY} steps, 1-4 workers, seed {seed}; logs in {work}", flush=True)
    if n % 12:
        print(f"  note: n={n} is not a multiple of 12, so the pad tail may repeat fewer than W indices (legal)")
    t0 = time.perf_counter()
    with open(work / "coordinator.log", "a") as clog, open(work / "train.log", "a") as tlog:
        coordinator = Coordinator(work / "coordinator.db", clog)
        run = Run(work, faults, epochs, n, random.Random(seed), coordinator, tlog)
        try:
            coordinator.start()
            print(f"coordinator: croupier serve at {coordinator.address} (sqlite store {coordinator.db})", flush=True)
            reports = run.run()
        except Exception as e:  # noqa: BLE001 - anything unexpected fails the run, with its cause
            print(f"\nchaos: FAILED after {run.tally.faults} faults, {time.perf_counter() - t0:.0f} s "
                  f"(seed {seed}): {type(e).__name__}: {e}", flush=True)
            return 1
        finally:
            run.kill_launch()
            coordinator.kill()
    unfinished = sorted(set(range(epochs)) - {r.epoch for r in reports if r.finished})
    print(f"\naudit of what the training loops received (croupier audit {work / 'audit'}):\n")
    print(render(reports))
    if unfinished:
        print(f"\nchaos: FAILED: the job ended without finishing epochs {unfinished}")
        return 1
    print("\n" + _summary(run.tally, reports, time.perf_counter() - t0), flush=True)
    return 0

