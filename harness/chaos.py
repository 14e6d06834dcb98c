"""`croupier chaos`: random SIGKILLs, rollbacks and resizes of a real torchrun job and its coordinator (or replicas), audited.

One standalone coordinator (``croupier serve`` on a SQLite store) and a sequence of torchrun
launches of the demo trainer (``croupier.demos.demo_train``) pointed at it. Each launch runs
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
epoch must be finished and pass the audit. The checks are :mod:`croupier.harness.history`'s, the faults'
schedule :mod:`croupier.harness._schedule`'s, the reading of a launch's progress :mod:`croupier.harness._watch`'s.

Replicated mode (``store`` a ``postgresql://`` URL, ``replicas`` k): k ``croupier serve`` replicas
on that database instead of the one coordinator, every rank given all k endpoints. The
``coordinator`` fault gives way to two others:

* ``replica``: SIGKILL of one replica, restarted on its own port; the first is always the first
  endpoint (the one every rank calls first), later ones often the replica with the most active
  client connections (the one the ranks are using), else one at random;
* ``database``: a restart of the PostgreSQL server (through a :class:`DatabaseControl`), with a
  fast and an immediate shutdown in turn; the replicas answer UNAVAILABLE meanwhile, and recover.

``datacenter`` adds faults the job trains through: with one coordinator, :mod:`croupier.harness._faults`'s;
with ``replicas`` k > 1 and no ``store``, the run starts PostgreSQL, the k replicas and the job on hosts of
their own and adds :mod:`croupier.harness._dc_replicas`'s (replica pauses, partitions, slow links).

Every rank records the join it got acknowledged (WORKDIR/joins.jsonl, see
``croupier.demos.demo_train``); at the end, :func:`croupier.harness.history.check_history` reads the journal from the
database and checks that no generation was accepted twice or out of order and that no
acknowledged join was lost. Every rank's client also records its joins, grants and checkpoints with
their times (``CROUPIER_CALL_LOG``, WORKDIR/calls); at the end the history is checked linearizable
(:mod:`croupier.harness.linearize`; grants given the replicas' staleness bound in the replicated mode).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time
from typing import IO, Any

from croupier.core.checks import check_choice, check_int
from croupier.demos.cluster import TRAINER, descendants, runs_trainer, sigkill, statuses
from croupier.demos.demo_train import mixture_of
from croupier.harness import _dc_replicas, _faults, history, linearize
from croupier.harness._online import DatabaseControl, OnlineFaults, where
from croupier.harness._schedule import ONLINE, Due, FaultSchedule, JobShape
from croupier.harness._watch import POLL, LaunchView, furthest
from croupier.harness.history import JOB, ChaosError
from croupier.tools.audit import EpochReport, render
from croupier.tools.serve import ServeGroup, ServeProcess

__all__ = ["JOB", "STALENESS_S", "DatabaseControl", "Run", "main"]

BATCH = 12  # per worker; with N a multiple of 12 every world size 1..4 consumes whole steps: no pad, no repeats
CKPT_EVERY = 2  # steps
LEASE_AHEAD = 24  # indices per lease: every rank calls the coordinator every other step
ROLLBACK_DEPTH = 8  # an older checkpoint is one of the last 8 before the latest
#: Simulated compute per training step. The ranks train on while the coordinator restarts, so a
#: job of tiny steps would end before the faults due could land.
STEP_MS = 40
MAX_STEP_MS = 10_000
#: What ``--batching`` offers, and the token budget of ``tokens`` (samples are 1..200 tokens, median 20).
BATCHINGS = ("fixed", "tokens", "dynamic")
MAX_TOKENS = 400
RESTART_S = 1.5  # seconds a coordinator restart is expected to take, until one is measured
STALENESS_S = 0.1  # the replicas' --max-staleness-ms (croupier serve's default), in seconds
KEEP_JOURNAL = 10**9  # the single coordinator's --snapshot-every: a run's journal is never pruned


def _history(work: pathlib.Path) -> list[pathlib.Path]:
    """The checkpoints kept, oldest first."""
    return sorted((work / "ckpts").glob("step-*.pt"))


def _step_of(ckpt: pathlib.Path | None) -> int:
    return int(ckpt.stem.split("-")[1]) if ckpt is not None else 0


class Run(OnlineFaults):
    """The orchestration of one chaos run: its launches of the job, each watched and ended by a fault or
    by the job's end, and the checkpoint the next one resumes from. When each fault comes is decided by its
    :class:`croupier.harness._schedule.FaultSchedule`; the faults the job trains through are injected by
    :class:`croupier.harness._online.OnlineFaults`."""

    def __init__(self, work: pathlib.Path, faults: int, epochs: int, n: int, rng: random.Random,
                 servers: ServeGroup, log: IO[str], database: DatabaseControl | None = None,
                 batching: str = "fixed", replicated: bool = False, mixture: bool = False,
                 datacenter: _faults.Faults | None = None, step_ms: int = STEP_MS) -> None:
        self.work, self.batching, self.mixture = work, batching, mixture
        self.faults = faults
        self.restart_s = RESTART_S  # the longest coordinator (replica, database) restart seen so far
        self.database = database
        self.datacenter = datacenter
        self.step_ms = step_ms
        self.time_left = float("inf")  # seconds of the job left, as last estimated by the schedule
        self.schedule = FaultSchedule(faults, JobShape(epochs, n, BATCH, CKPT_EVERY), rng, replicated,
                                      database is not None, datacenter is not None)
        self.epochs = epochs
        self.n = n
        self.rng = rng
        self.servers = servers
        self.log = log
        self.tally = history.Tally()
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
               "ckpt_every": CKPT_EVERY, "keep_checkpoints": True, "lease_ahead": LEASE_AHEAD, "step_ms": self.step_ms,
               "resume_from": str(resume) if resume is not None else None, "batching": self.batching,
               "max_tokens": MAX_TOKENS, "mixture": mixture_of(self.n, self.epochs) if self.mixture else None}
        env = {**os.environ, "DEMO": json.dumps(cfg), "CROUPIER_ADDRESS": self.servers.address,
               "CROUPIER_JOB": JOB, "CROUPIER_AUDIT_DIR": str(self.work / "audit"),
               "CROUPIER_CALL_LOG": str(self.work / "calls"), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        env.pop("CROUPIER_INCARNATION", None)
        env.pop("CROUPIER_TOKEN", None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "--max-restarts=0", "--monitor-interval=0.2", "-m", TRAINER]
        if self.datacenter is not None:  # on the job's host (ip netns exec execs torchrun: its pid is torchrun's)
            cmd = [*self.datacenter.prefix("job"), *cmd]
            env["GLOO_SOCKET_IFNAME"] = "lo"  # the workers talk to each other on the host's loopback
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
            if runs_trainer(pid):
                sigkill(pid)

    def watch(self, world: int, number: int) -> str:
        """Watches the launch and injects the faults the schedule makes due.

        Returns:
            What ended the launch: "finished", "rank", "preempt", or "rollback" (a preemption that
            must resume from an older checkpoint).
        """
        proc = self.proc
        assert proc is not None
        view = LaunchView(self.work / "status", number, world, self.log.name)
        self.schedule.new_launch()
        while proc.poll() is None:
            self.servers.check()
            live = view.read(self.pids)
            if live:
                s0, now = furthest(live), time.monotonic()
                view.show(s0, now, f"faults {self.tally.faults}/{self.faults}")
                due = self.schedule.due(s0, now, self.tally.faults, self.restart_s)
                self.time_left = self.schedule.time_left
                if due is not None and due.kind in ONLINE:
                    self._online_fault(due.kind, statuses(view.folder))
                    continue
                if due is not None:
                    return self._end_launch(due, world, live, s0)
            view.check_stall()
            time.sleep(POLL)  # the progress line's refresh interval
        self.kill_launch()
        if proc.returncode != 0:
            raise ChaosError(f"torchrun with {world} workers failed by itself (exit {proc.returncode}) in launch "
                             f"{number}; see {self.log.name}")
        return "finished"

    def _end_launch(self, due: Due, world: int, live: list[dict[str, Any]], s0: dict[str, Any]) -> str:
        """A fault that ends the launch: a rank's kill, or a preemption of them all. Returns what ended it."""
        if due.kind == "rank":
            return self._kill_rank(world, live, s0)
        self.kill_launch()
        self.tally.preemptions += 1
        self._say(f"preempted: SIGKILL of torchrun and all {world} workers at {where(statuses(self.work / 'status'))}")
        return "rollback" if due.rollback else "preempt"

    def _kill_rank(self, world: int, live: list[dict[str, Any]], s0: dict[str, Any]) -> str:
        """SIGKILL of one worker, drawn by rank; torchrun stops the launch. Returns what ended it."""
        proc = self.proc
        assert proc is not None
        # Drawn by rank (not from the status files read) so that a seed replays the same choices.
        r = self.rng.randrange(world)
        victim = next((s for s in live if s["rank"] == r), s0)
        if runs_trainer(victim["pid"]):
            sigkill(victim["pid"])
        self.tally.rank_kills += 1
        at = where([s for s in statuses(self.work / "status") if s["rank"] == victim["rank"]])
        self._say(f"SIGKILL of rank {victim['rank']} of {world} (pid {victim['pid']}) at {at}")
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise ChaosError(f"torchrun did not stop within 60 s after rank {victim['rank']} "
                             f"was killed; see {self.log.name}") from None
        self.kill_launch()  # whatever torchrun left running
        return "finished" if proc.returncode == 0 else "rank"

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
            history.check_resumed(self.work, number, since, resume)
            history.check_audit(self.work, f"after launch {number}")
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
        return history.check_audit(self.work, "at the end")


def main(workdir: str = "out/chaos", faults: int = 100, epochs: int = 6, n: int = 3600,
         seed: int | None = None, store: str | None = None, replicas: int = 1,
         database: DatabaseControl | None = None, batching: str = "fixed", mixture: bool = False,
         datacenter: bool = False, step_ms: int = STEP_MS) -> int:
    """Runs the chaos run; returns 0 when every audit passes, 1 on a violation or an unexpected failure.

    Args:
        workdir: Where the coordinator's store, the checkpoints, the logs and the audit log go
            (emptied first).
        faults: Kills to inject (rank, coordinator and whole-job kills; in the replicated mode,
            replica kills and database restarts instead of coordinator kills); resizes come on top.
        epochs: Epochs of the training job.
        n: Samples in the synthetic dataset; a multiple of 12 makes every epoch exactly-once
            with no pad repeats at any world size 1..4.
        seed: Seed of the run's random choices (default: a random one, printed).
        store: A ``postgresql://`` URL of an empty database: the replicated mode, `replicas`
            ``croupier serve`` processes on it. None: one coordinator on a sqlite store in the workdir.
        replicas: Replicas in the replicated mode.
        database: Restarts the database in the replicated mode (``database`` faults); None: no
            such faults (a run cannot restart a server it does not own).
        batching: ``fixed`` (the index sampler, batches of 12), ``tokens`` (token-budget batches
            of up to MAX_TOKENS over long-tailed synthetic lengths) or ``dynamic`` (batches of 12
            dealt to whichever rank asks, DDP's Join at each epoch's end).
        mixture: Deal the samples as a mixture of three sources whose weights change halfway
            through the run, one of them capped (``tools/demo_train.mixture_of``), audited by
            source epoch.
        datacenter: Also pause the coordinator and workers, jump the coordinator's wall clock, fill
            its store's file system, and cut or slow the network between the job and the coordinator,
            each on a host of its own (``croupier.harness._faults``; as root with libfaketime and network
            namespaces). With `replicas` > 1 (and no `store`): a PostgreSQL server of the run's own, the
            replicas and the job each on a host of its own, replicas paused, cut from the database or the
            job, their links slowed (``croupier.harness._dc_replicas``), beside the replicated faults.
        step_ms: Simulated compute per training step: a longer step leaves the job more steps to
            host faults it trains through (a pause or a full disk lasts seconds).

    Raises:
        ValueError: a setting out of range or contradicting another, or a store that is not an empty PostgreSQL
            database (refused before the workdir is touched).
        TypeError: a count that is not an int.
        StoreError: the store could not be opened.
    """
    replicated = _check_settings(faults, epochs, n, store, replicas, database, batching, mixture, datacenter, step_ms)
    if store is not None:
        history.check_store(store)
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    work = _empty_workdir(workdir)
    _announce(work, faults, epochs, n, seed, batching, mixture, store is not None and database is None)
    t0 = time.perf_counter()
    # A SIGTERM (a run stopped by its caller) unwinds like Ctrl-C: the coordinator, the job, the namespaces
    # and the store's file system are taken down on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with contextlib.ExitStack() as logs:
        tlog = logs.enter_context(open(work / "train.log", "a"))
        dc = None if not datacenter else logs.enter_context(
            _dc_replicas.ReplicatedDatacenter(work, random.Random(seed + 1), replicas) if replicated
            else _faults.Faults(work, random.Random(seed + 1)))
        servers, journal, database = _servers(logs, work, dc, store, database, replicas)
        run = Run(work, faults, epochs, n, random.Random(seed), servers, tlog, database, batching, replicated,
                  mixture, dc, step_ms)
        try:
            servers.start()
            print(_servers_line(servers, journal, replicated), flush=True)
            reports = run.run()
            checked, calls = _check_journal(run, journal, replicated)
        except Exception as e:  # anything unexpected fails the run, with its cause
            print(f"\nchaos: FAILED after {run.tally.faults} faults, {time.perf_counter() - t0:.0f} s "
                  f"(seed {seed}): {type(e).__name__}: {e}", flush=True)
            return 1
        finally:
            run.kill_launch()
            servers.kill()
    return _report(run, reports, checked, calls, time.perf_counter() - t0, replicated)


def _check_settings(faults: int, epochs: int, n: int, store: str | None, replicas: int,
                    database: DatabaseControl | None, batching: str, mixture: bool, datacenter: bool,
                    step_ms: int) -> bool:
    """Refuses a setting out of range, or settings that do not go together (before anything is touched).

    Returns:
        Whether the run is replicated (replicas on a shared store).

    Raises:
        ValueError: a setting out of range or contradicting another, or data-center faults this machine
            cannot inject (the message says which and why).
        TypeError: a count that is not an int.
    """
    check_choice("batching", batching, ("fixed",) if mixture else BATCHINGS,
                 why="a mixture is dealt in fixed batches" if mixture else "")
    check_int("step_ms", step_ms, 1, MAX_STEP_MS + 1)
    check_int("faults", faults, 0)
    check_int("epochs", epochs, 1)
    check_int("n", n, 4 * BATCH, why="so that 4 workers each get a batch")
    check_int("replicas", replicas, 1)
    replicated = store is not None or datacenter and replicas > 1
    if not replicated:
        check_int("replicas", replicas, 1, 2,
                  why="more than 1 needs a shared store: store=postgresql://..., or datacenter=True, which starts one")
    if datacenter and (why := "no store= (with --replicas the run starts a PostgreSQL server on a host of its own)"
                       if store is not None else _dc_replicas.available() if replicated else _faults.available()):
        raise ValueError(f"datacenter faults need {why}")
    if database is not None and store is None:
        raise ValueError("a database control needs the replicated mode (store=postgresql://...)")
    return replicated


def _empty_workdir(workdir: str) -> pathlib.Path:
    """The run's workdir, emptied (made if missing); one that holds anything but an earlier chaos run is refused."""
    work = pathlib.Path(workdir).resolve()
    if work.exists() and any(work.iterdir()) and not (work / "train.log").exists():
        raise ValueError(f"workdir {work} is not empty and holds no earlier chaos run (no train.log); "
                         "refusing to empty it")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work


def _announce(work: pathlib.Path, faults: int, epochs: int, n: int, seed: int, batching: str, mixture: bool,
              no_database_faults: bool) -> None:
    """Prints what the run will do."""
    what = {"fixed": f"batch {BATCH} per worker", "tokens": f"token-budget batches of up to {MAX_TOKENS} tokens",
            "dynamic": f"batches of {BATCH} dealt dynamically"}[batching]
    what += ", a mixture of 3 sources, its weights changed halfway" if mixture else ""
    print(f"croupier chaos: {faults} faults over {epochs} epochs of {n} samples, {what}, "
          f"a checkpoint every {CKPT_EVERY} steps, 1-4 workers, seed {seed}; logs in {work}", flush=True)
    if n % 12:
        print(f"  note: n={n} is not a multiple of 12, so the pad tail may repeat fewer than W indices (legal)")
    if no_database_faults:
        print("  note: no control of the database server: no database faults (croupier chaos cannot restart a "
              "PostgreSQL server it does not own); replica kills, rank kills and preemptions only", flush=True)


def _servers(logs: contextlib.ExitStack, work: pathlib.Path, dc: _faults.Faults | None, store: str | None,
             database: DatabaseControl | None, replicas: int) -> tuple[ServeGroup, str, DatabaseControl | None]:
    """The run's coordinator or replicas (not started), the URL of the store that holds their journal, and the
    control of its database (None: the run cannot restart it)."""
    if isinstance(dc, _dc_replicas.ReplicatedDatacenter):  # PostgreSQL, the replicas and the job on hosts of their own
        url, hosted = dc.db()
        return ServeGroup(dc.replicas(logs, ChaosError)), url, hosted
    if store is not None:
        return ServeGroup([ServeProcess(store, logs.enter_context(open(work / f"replica-{i}.log", "a")),
                                        f"replica {i}", ChaosError, verbose=True) for i in range(replicas)]), store, database
    db = work / ("disk" if dc else ".") / "coordinator.db"
    # The whole journal is kept (no snapshot prunes it) so that its history is checked to the first record.
    return ServeGroup([ServeProcess(f"sqlite:///{db}", logs.enter_context(open(work / "coordinator.log", "a")),
                                    error=ChaosError, env=dc.env() if dc else None,
                                    args=("--snapshot-every", str(KEEP_JOURNAL)),
                                    host=dc.address("co") if dc else "127.0.0.1",
                                    prefix=dc.prefix("co") if dc else ())]), f"sqlite:///{db}", None


def _servers_line(servers: ServeGroup, journal: str, replicated: bool) -> str:
    """Where the run's coordinator (or its replicas) serve, and their store (its password left out)."""
    if not replicated:
        return f"coordinator: croupier serve at {servers.address} (sqlite store {journal.removeprefix('sqlite:///')})"
    from croupier.server import redact_url

    return (f"replicas: {len(servers.members)} croupier serve processes at {servers.address} (postgresql store "
            f"{redact_url(journal)})")


def _check_journal(run: Run, journal: str, replicated: bool) -> tuple[history.History, linearize.Verdict]:
    """The journal's history checked (the generations, the joins acknowledged) and the ranks' calls checked
    linearizable, once the job has ended.

    Raises:
        ChaosError: the calls are not linearizable (the history's own checks raise theirs).
    """
    if not replicated:  # the file is the coordinator's alone while it runs
        run.kill_launch()
        run.servers.kill()
    checked = history.check_history(journal, run.work)
    # A replica may answer a grant from a state up to its staleness bound old (croupier serve's default).
    calls = linearize.check(linearize.load(sorted(str(f) for f in (run.work / "calls").glob("*.jsonl"))),
                            stale_s=STALENESS_S if replicated else 0.0)
    if not calls.ok:
        raise ChaosError(f"the ranks' calls are not linearizable: {calls.why}")
    return checked, calls


def _report(run: Run, reports: list[EpochReport], checked: history.History, calls: linearize.Verdict,
            seconds: float, replicated: bool) -> int:
    """Prints the audit of every epoch and the run's verdict; returns the run's exit status (0: it passed)."""
    unfinished = sorted(set(range(run.epochs)) - {r.epoch for r in reports if r.finished})
    print(f"\naudit of what the training loops received (croupier audit {run.work / 'audit'}):\n")
    print(render(reports) + history.by_source_table(reports))
    if unfinished:
        print(f"\nchaos: FAILED: the job ended without finishing epochs {unfinished}")
        return 1
    summary = history.summary(run.tally, reports, seconds, replicated=replicated)
    if run.tally.faults < run.faults:
        print(f"\n{summary}\nchaos: FAILED: the job ended after {run.tally.faults} of the {run.faults} faults asked: "
              "give it more epochs (--epochs) or longer steps (--step-ms)", flush=True)
        return 1
    print("\n" + summary, flush=True)
    print(history.history_line(checked), flush=True)
    print(f"calls: {calls.calls} joins, grants and checkpoints of the ranks recorded with their times "
          f"({run.work / 'calls'}): linearizable", flush=True)
    return 0
