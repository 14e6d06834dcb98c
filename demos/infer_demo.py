"""`croupier infer-demo`: exactly-once batch inference on preemptible workers, audited against the journal.

A ``croupier serve`` coordinator on a SQLite store in the work directory, and generations of
worker processes (``croupier.demos.infer_worker``), each with ``RANK``, ``WORLD_SIZE``,
``CROUPIER_ADDRESS``, ``CROUPIER_JOB`` and an incarnation of its own. The workers deal the dataset
dynamically (``lockstep=False``): each takes the next batches, writes one output line per sample
to ``outputs/{incarnation}-r{rank}.jsonl``, makes it durable and commits. A relaunched generation
resumes from the union of the commits (``resume_latest``).

While the job runs, faults chosen by a seeded RNG land on observable progress (output lines
written), never on a timer:

* ``kill``: kill -9 of one worker; the others are stopped and the generation is relaunched with
  a world of 1 to 4 chosen at random;
* ``add`` / ``remove``: every worker is stopped and the job relaunched with one more / one fewer
  (a world stays within 1 .. 4);
* ``coordinator``: kill -9 of the coordinator, restarted on the same port and store; the
  workers ride through it (their leases wait, their commits are asked again).

The audit: an output line is *valid* iff its batch's ``seq`` is below the highest count its
(generation, rank) committed, as the coordinator journaled it (``BatchesCommitted``; tokens map
to generations by ``GenerationOpened``). The valid lines must cover [0, N) exactly once, each
with the right output; the others (work redone after a kill) are counted as discarded.

NOTE: a snapshot prunes the journal records before it, and the SQLite store is locked by its
coordinator for as long as it runs. So the driver reads the store whenever the coordinator is
down -- after every kill -9, and at every relaunch, where it stops the coordinator (SIGTERM, no
worker running) and starts it again -- and reads the snapshot too: a snapshot holds the current
generation's commits. Every generation ends with such a read, so no commit is hidden; what the
reads gathered is kept in ``journal.json``, next to ``summary.json``.
"""

from __future__ import annotations

import collections
import dataclasses
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

from croupier.core.checks import check_int
from croupier.demos.infer_audit import JOB, Audit, DemoError, Journal, audit
from croupier.tools.serve import ServeProcess

WORKER = "croupier.demos.infer_worker"
KINDS = ("kill", "add", "remove", "coordinator")
MAX_WORLD = 4
POLL_S = 0.02  # the watch loop's longest wait on a worker before it looks at the outputs again
STALL_S = 90.0  # seconds without an output line or an exit: the run has hung
STOP_S = 15.0  # seconds a stopped worker gets before kill -9


# ---------------------------------------------------------------------------------------- processes


class Coordinator(ServeProcess):
    """``croupier serve`` on the demo's store, in a child process of its own session; restarted on the same
    port, and started again when it exits by itself (:meth:`check`)."""

    def __init__(self, store: str, log: IO[str]) -> None:
        super().__init__(store, log, error=DemoError, new_session=True)
        self.deaths: list[int] = []  # exit codes of exits nobody asked for

    def check(self) -> bool:
        """False (and noted) if the coordinator exited by itself; it is started again.

        Called while it should run: never between a :meth:`kill` or :meth:`stop` and the next start.
        """
        code = self.exited()
        if code is None:
            return True
        self.deaths.append(code)
        self.start()
        return False

    def stop(self) -> None:
        """SIGTERM, and wait for it (kill -9 after STOP_S)."""
        self.terminate(STOP_S)


@dataclasses.dataclass
class Worker:
    rank: int
    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    stopped: bool = False  # the driver killed or stopped it

    def signal(self, sig: int) -> None:
        """Sends `sig` to the worker's process group (it and any helper process it started)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


class Generation:
    """One launch: `world` worker processes sharing one incarnation."""

    def __init__(self, incarnation: str, world: int, env: dict[str, str], argv: list[str], logs: pathlib.Path) -> None:
        self.incarnation = incarnation
        self.world = world
        self.workers: list[Worker] = []
        for rank in range(world):
            log = open(logs / f"{incarnation}-r{rank}.log", "wb")  # closed in stop()
            wenv = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                    "CROUPIER_INCARNATION": incarnation}
            proc = subprocess.Popen([sys.executable, "-m", WORKER, *argv], env=wenv, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            self.workers.append(Worker(rank, proc, log))

    def live(self) -> list[Worker]:
        return [w for w in self.workers if w.proc.poll() is None]

    def failed(self) -> list[Worker]:
        """Workers that exited non-zero without being stopped by the driver."""
        return [w for w in self.workers if not w.stopped and w.proc.poll() not in (None, 0)]

    def wait(self, seconds: float) -> None:
        """Waits up to `seconds` for a live worker to exit."""
        live = self.live()
        if live:
            try:
                live[0].proc.wait(timeout=seconds)
            except subprocess.TimeoutExpired:
                pass

    def kill(self, worker: Worker) -> None:
        """kill -9 of `worker`, and wait for it."""
        worker.stopped = True
        worker.signal(signal.SIGKILL)
        worker.proc.wait()

    def stop(self) -> None:
        """Stops every worker still running (SIGTERM, then kill -9 after STOP_S) and waits for them."""
        for w in self.live():
            w.stopped = True
            w.signal(signal.SIGTERM)
        give_up = time.monotonic() + STOP_S
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.0, give_up - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.signal(signal.SIGKILL)
                w.proc.wait()
            w.log.close()


class Lines:
    """Counts the lines of every output file, reading only what was appended since the last count."""

    def __init__(self, outputs: pathlib.Path) -> None:
        self.outputs = outputs
        self._at: dict[pathlib.Path, int] = {}
        self._lines: dict[pathlib.Path, int] = {}
        self.count = 0

    def poll(self) -> int:
        """Lines of every output file, now."""
        for path in self.outputs.glob("*.jsonl"):
            at = self._at.get(path, 0)
            with open(path, "rb") as f:
                f.seek(at)
                chunk = f.read()
            self._at[path] = at + len(chunk)
            new = chunk.count(b"\n")
            self._lines[path] = self._lines.get(path, 0) + new
            self.count += new
        return self.count

    def of(self, path: pathlib.Path) -> int:
        """Lines of one output file at the last :meth:`poll`."""
        return self._lines.get(path, 0)


# ------------------------------------------------------------------------------------------- the run


@dataclasses.dataclass
class Settings:
    workdir: str = "out/infer-demo"
    n: int = 20_000
    batch: int = 16
    faults: int = 8
    seed: int | None = None
    batch_ms: float = 5.0
    world: int = 2


def plan_faults(rng: random.Random, count: int) -> list[str]:
    """`count` fault kinds: every kind as evenly as the count allows, in a random order."""
    kinds = list(KINDS) * (count // len(KINDS)) + rng.sample(KINDS, count % len(KINDS))
    rng.shuffle(kinds)
    return kinds


class Demo:
    """The driver: launches generations, injects the faults, reads the journal, audits."""

    def __init__(self, s: Settings, seed: int) -> None:
        self.s = s
        self.seed = seed
        self.rng = random.Random(seed)
        self.work = pathlib.Path(s.workdir)
        self.outputs = self.work / "outputs"
        self.logs = self.work / "logs"
        self.store = f"sqlite:///{(self.work / 'coordinator.db').resolve()}"
        self.journal = Journal()
        self.kinds = plan_faults(self.rng, s.faults)
        self.done: collections.Counter[str] = collections.Counter()
        self.worlds: list[int] = []
        self.failures: list[str] = []  # worker exits nobody asked for
        #: workers running when the coordinator was killed: (incarnation, worker, batches it had committed then,
        #: the output lines its file must reach before the next fault: two batches later, so it committed after it)
        self.riders: list[tuple[str, Worker, int, int]] = []
        self.rode: list[bool] = []  # per rider: it committed again after the restart, or ran out by itself
        self.began = time.monotonic()

    def _env(self, address: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CROUPIER_", "TORCHELASTIC_"))}
        env.update(CROUPIER_ADDRESS=address, CROUPIER_JOB=JOB, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        return env

    def _say(self, what: str) -> None:
        print(f"[{time.monotonic() - self.began:6.1f} s] {what}", flush=True)

    def _launch(self, world: int) -> Generation:
        incarnation = f"launch-{len(self.worlds) + 1:02d}"
        self.worlds.append(world)
        argv = ["--n", str(self.s.n), "--batch", str(self.s.batch), "--outputs", str(self.outputs),
                "--batch-ms", str(self.s.batch_ms)]
        self._say(f"launch {incarnation}: world {world}")
        return Generation(incarnation, world, self._env(self.coordinator.address), argv, self.logs)

    def _between(self, gen: Generation) -> None:
        """Ends `gen` (every worker gone) and reads the journal with the coordinator stopped."""
        gen.stop()
        self._note_failures(gen)
        self.coordinator.stop()
        self.journal.read(self.store)
        self._judge_riders(gen)
        self.coordinator.start()

    def _output(self, incarnation: str, rank: int) -> pathlib.Path:
        return self.outputs / f"{incarnation}-r{rank}.jsonl"

    def _riders_went_on(self, gen: Generation) -> bool:
        """Every worker of `gen` that ran through a coordinator kill has committed since (a line of the
        batch after next is written only once the next one's commit returned), or has exited."""
        self.lines.poll()
        return all(w.proc.poll() is not None or self.lines.of(self._output(incarnation, w.rank)) >= target
                   for incarnation, w, _, target in self.riders if incarnation == gen.incarnation)

    def _committed(self, incarnation: str, rank: int) -> int:
        g = self.journal.generations.get(incarnation)
        return 0 if g is None else self.journal.committed(g, rank)

    def _judge_riders(self, gen: Generation) -> None:
        """Whether each worker of `gen` that ran through a coordinator kill went on afterwards:
        the journal has a later commit of it, or it ran out of batches and exited 0 by itself."""
        for incarnation, w, before, _ in [r for r in self.riders if r[0] == gen.incarnation]:
            self.rode.append(self._committed(incarnation, w.rank) > before or (w.proc.returncode == 0 and not w.stopped))
        self.riders = [r for r in self.riders if r[0] != gen.incarnation]

    def _note_failures(self, gen: Generation) -> None:
        for w in gen.failed():
            if not any(f.startswith(f"{gen.incarnation} r{w.rank} ") for f in self.failures):
                self.failures.append(f"{gen.incarnation} r{w.rank} exited {w.proc.returncode} by itself (see "
                                     f"{self.logs / f'{gen.incarnation}-r{w.rank}.log'})")

    def _gap(self, lines: int, left: int) -> int:
        """Output lines until the next fault: the rest of the job shared among the faults left."""
        rest = max(self.s.n - lines, 0)
        return max(self.s.batch, int(rest / (left + 1) * self.rng.uniform(0.6, 1.0)))

    def _fault(self, kind: str, gen: Generation, lines: int) -> Generation:
        """Injects one fault; returns the generation running after it."""
        world = gen.world
        if kind == "add" and world >= MAX_WORLD:
            kind = "remove"
        elif kind == "remove" and world <= 1:
            kind = "add"
        live = gen.live()
        if kind == "kill" and not live:
            kind = "add" if world < MAX_WORLD else "remove"
        self.done[kind] += 1
        where = f"at {lines} output lines"
        if kind == "coordinator":
            self._say(f"fault {sum(self.done.values())}: kill -9 of the coordinator {where} ({len(live)} workers "
                      "running); restarted on the same port")
            self.coordinator.kill()
            self.journal.read(self.store)
            self.riders += [(gen.incarnation, w, self._committed(gen.incarnation, w.rank),
                             self.lines.of(self._output(gen.incarnation, w.rank)) + self.s.batch + 1) for w in gen.live()]
            self.coordinator.start()
            return gen
        if kind == "kill":
            victim = self.rng.choice(live)
            self._say(f"fault {sum(self.done.values())}: kill -9 of {gen.incarnation} r{victim.rank} {where}; the others "
                      "are stopped")
            gen.kill(victim)
            world = self.rng.randint(1, MAX_WORLD)
        else:
            world += 1 if kind == "add" else -1
            self._say(f"fault {sum(self.done.values())}: {kind} a worker {where}: every worker is stopped, "
                      f"relaunch with {world}")
        self._between(gen)
        return self._launch(world)

    def run(self) -> tuple[Audit, dict[str, Any]]:
        """Runs the job to its end under the faults; returns the audit and the run's figures."""
        if self.work.is_dir() and any(self.work.iterdir()) and not (self.work / "outputs").is_dir():
            raise ValueError(f"{self.work} is not empty and holds no earlier demo run: choose another --workdir")
        shutil.rmtree(self.work, ignore_errors=True)
        self.outputs.mkdir(parents=True)
        self.logs.mkdir()
        self.began = time.monotonic()
        self.lines = Lines(self.outputs)
        with open(self.work / "coordinator.log", "a") as clog:
            self.coordinator = Coordinator(self.store, clog)
            self.coordinator.start()
            self._say(f"coordinator: croupier serve at {self.coordinator.address} ({self.store}); job {JOB!r}, "
                      f"N={self.s.n}, batch {self.s.batch}, {self.s.faults} faults, seed {self.seed}")
            gen = self._launch(self.s.world)
            try:
                gen = self._watch(gen)
            finally:
                gen.stop()
                self._note_failures(gen)
                self.coordinator.stop()
        self.journal.read(self.store)
        self._judge_riders(gen)
        self.journal.save(self.work / "journal.json")
        result = audit(self.outputs, self.journal, self.s.n)
        figures = {
            "seed": self.seed, "n": self.s.n, "batch": self.s.batch, "faults": dict(self.done),
            "faults_total": sum(self.done.values()), "launches": len(self.worlds), "worlds": self.worlds,
            "generations": len(self.journal.generations), "journal_reads": self.journal.reads,
            "snapshots_read": self.journal.snapshots, "worker_failures": self.failures,
            "coordinator_deaths": self.coordinator.deaths, "riders": len(self.rode), "rode_through": sum(self.rode),
            "commit_retries_logged": _retried(self.logs), "commits_only_in_snapshots": self.journal.from_snapshots(),
            "redealt_batches": self.journal.redealt(), "seconds": round(time.monotonic() - self.began, 1),
            "audit": dataclasses.asdict(result),
        }
        (self.work / "summary.json").write_text(json.dumps(figures, indent=1))
        return result, figures

    def _watch(self, gen: Generation) -> Generation:
        """Watches the job until a generation ends by itself, injecting the faults due on the way."""
        lines = self.lines
        left = len(self.kinds)
        due = self._gap(0, left)
        moved, last = time.monotonic(), 0
        while True:
            if not self.coordinator.check():
                self._say("the coordinator exited by itself; started again")
            if gen.failed():
                self._note_failures(gen)
                self._say(f"{self.failures[-1]}; relaunching")
                self._between(gen)
                gen = self._launch(gen.world)
                continue
            if not gen.live():
                return gen  # every worker ran out: the job is done
            count = lines.poll()
            if count != last:
                moved, last = time.monotonic(), count
            elif time.monotonic() - moved > STALL_S:
                raise DemoError(f"no output line for {STALL_S:.0f} s at {count} lines ({gen.incarnation}, world "
                                f"{gen.world}); see {self.logs}")
            if left and count >= due and self._riders_went_on(gen):
                gen = self._fault(self.kinds[len(self.kinds) - left], gen, count)
                left -= 1
                due = count + self._gap(count, left)
                moved = time.monotonic()
                continue
            gen.wait(POLL_S)


def _retried(logs: pathlib.Path) -> int:
    """Workers whose log says they asked again for a commit the coordinator did not answer."""
    return sum(b"commit not answered" in p.read_bytes() for p in logs.glob("*.log"))


def render(result: Audit, figures: dict[str, Any]) -> str:
    """The audit's report, ending with the one-line summary."""
    faults = figures["faults"]
    by_kind = ", ".join(f"{faults.get(k, 0)} {k}" for k in KINDS)
    lines = [
        "",
        f"audit of {result.files} output files ({result.lines} lines) against the coordinator's journal "
        f"({figures['journal_reads']} reads, {figures['snapshots_read']} with a snapshot):",
        f"  samples audited        {result.n}",
        f"  committed outputs      {result.valid}",
        f"  distinct samples       {result.samples}",
        f"  duplicates             {result.duplicates}",
        f"  missing                {result.missing}",
        f"  wrong outputs          {result.wrong}",
        f"  discarded (uncommitted, redone after kills)  {result.discarded} lines ({result.torn} torn)",
        f"  faults                 {figures['faults_total']} ({by_kind})",
        f"  generations            {figures['generations']} (worlds {figures['worlds']})",
        f"  coordinator kills      {figures['faults'].get('coordinator', 0)}: {figures['rode_through']} of the "
        f"{figures['riders']} workers running through one committed again after it "
        f"({figures['commit_retries_logged']} retried a commit meanwhile)",
        f"  journal                commits of {figures['commits_only_in_snapshots']} (generation, rank) pairs known "
        f"only from snapshots; {figures['redealt_batches']} batches dealt but never committed, dealt again",
        "",
        f"infer-demo: {result.n} samples audited: {result.valid} committed outputs, {result.duplicates} duplicates, "
        f"{result.missing} missing, {result.discarded} lines discarded as uncommitted; {figures['faults_total']} faults "
        f"({by_kind}); {figures['generations']} generations; {len(figures['worker_failures'])} worker failures",
    ]
    return "\n".join(lines)


def run(workdir: str = "out/infer-demo", n: int = 20_000, batch: int = 16, faults: int = 8, seed: int | None = None,
        batch_ms: float = 5.0, world: int = 2) -> int:
    """Runs the demo; returns its exit status: 0 when exactly once holds, no process failed by itself
    and every worker running through a coordinator kill committed again after it."""
    check_int("world", world, 1, MAX_WORLD + 1)
    check_int("n", n, 1)
    check_int("batch", batch, 1)
    check_int("faults", faults, 0)
    seed = seed if seed is not None else random.SystemRandom().randrange(1 << 31)
    demo = Demo(Settings(workdir, n, batch, faults, seed, batch_ms, world), seed)
    try:
        result, figures = demo.run()
    except DemoError as e:
        print(f"infer-demo: FAILED: {e}", file=sys.stderr)
        return 1
    print(render(result, figures))
    problems = list(result.violations) + [f"worker failure: {f}" for f in figures["worker_failures"]]
    problems += [f"coordinator exited by itself (exit {c})" for c in figures["coordinator_deaths"]]
    if figures["rode_through"] < figures["riders"]:
        problems.append(f"ride-through: {figures['riders'] - figures['rode_through']} of the {figures['riders']} workers "
                        "running through a coordinator kill never committed again")
    if problems:
        print("infer-demo: FAILED:\n  " + "\n  ".join(problems))
        return 1
    print("infer-demo: exactly once holds")
    return 0
