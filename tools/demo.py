"""`croupier demo`: an elastic torchrun training job that is preempted and resized, then audited.

The story, on the CPU with gloo and croupier's embedded coordinator (rank 0 hosts it):
  1. 3 workers train; one of them is killed with SIGKILL in epoch 0. torchrun restarts the
     group, which resumes from the last checkpoint (a new generation).
  2. The whole job is preempted (every process SIGKILLed) in epoch 1 and comes back with
     2 workers, resuming from its last checkpoint.
  3. Preempted again in epoch 2, it comes back with 4 workers and finishes.
  4. ``croupier audit`` replays the checkpoint chain from the audit log and prints, per epoch,
     how many samples were expected, trained, duplicated and missing.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from croupier.tools.audit import audit, render

JOB = "demo"


@dataclass(frozen=True)
class Phase:
    workers: int
    kill_worker_at: tuple[int, int] | None  # (epoch, step): SIGKILL one worker, torchrun restarts the group
    preempt_at: tuple[int, int] | None  # (epoch, step): SIGKILL everything; the next phase resumes


def _statuses(work: pathlib.Path) -> list[dict]:
    out = []
    for f in (work / "status").glob("r*.json"):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            pass  # being replaced right now
    return out


def _bar(frac: float, width: int = 24) -> str:
    full = int(frac * width)
    return "#" * full + "." * (width - full)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_phase(work: pathlib.Path, phase: Phase, cfg: dict, env: dict[str, str], log) -> str:  # type: ignore[no-untyped-def]
    """Runs one torchrun launch until it finishes or is preempted; returns what ended it."""
    shutil.rmtree(work / "status", ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={phase.workers}",
           "--max-restarts=3", "--monitor-interval=0.2", "-m", "croupier.tools.demo_train"]
    proc = subprocess.Popen(cmd, env={**env, "DEMO": json.dumps(cfg)}, stdout=log, stderr=log, start_new_session=True)
    killed_worker = False
    last_line = ""
    try:
        while proc.poll() is None:
            st = _statuses(work)
            live = [s for s in st if s.get("world") == phase.workers and not s.get("done")]
            if live:
                s0 = max(live, key=lambda s: (s["epoch"], s["step"]))
                in_epoch = s0["k"]
                line = (f"  [{phase.workers} workers, restart {s0['restart']}] epoch {s0['epoch']} "
                        f"{_bar(min(1.0, in_epoch / max(1, s0['of'])))} {in_epoch:>3}/{s0['of']:<3} "
                        f"step {s0['step']:>4} loss {s0['loss']:.4f}")
                if line != last_line:
                    print("\r" + line.ljust(90), end="", flush=True)
                    last_line = line
                pos = (s0["epoch"], in_epoch)
                if phase.kill_worker_at and not killed_worker and pos >= phase.kill_worker_at:
                    victim = max(live, key=lambda s: s["rank"])
                    _kill(victim["pid"])
                    killed_worker = True
                    print(f"\n  ! SIGKILL worker rank {victim['rank']} (pid {victim['pid']}) at epoch {pos[0]} "
                          f"step {pos[1]}: torchrun restarts the group from the last checkpoint", flush=True)
                if phase.preempt_at and pos >= phase.preempt_at:
                    for s in st:
                        _kill(s["pid"])
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    print(f"\n  ! preempted: every process SIGKILLed at epoch {pos[0]} step {pos[1]}", flush=True)
                    return "preempted"
            time.sleep(0.2)  # the progress line's refresh interval
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun with {phase.workers} workers failed (exit {proc.returncode}); see {work / 'train.log'}")
    return "finished"


def main(workdir: str = "out/demo", n: int = 6000, epochs: int = 4, batch_size: int = 32) -> int:
    """Runs the demo; returns 0 when the audit finds G1 holds."""
    work = pathlib.Path(workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cfg = {"workdir": str(work), "n": n, "epochs": epochs, "batch_size": batch_size, "ckpt_every": 15}
    env = {**os.environ, "CROUPIER_JOB": JOB, "CROUPIER_AUDIT_DIR": str(work / "audit"),
           "CROUPIER_STATE_DIR": str(work / "coordinator"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("CROUPIER_ADDRESS", None)
    phases = [
        Phase(3, kill_worker_at=(0, 40), preempt_at=(1, 25)),
        Phase(2, kill_worker_at=None, preempt_at=(2, 50)),
        Phase(4, kill_worker_at=None, preempt_at=None),
    ]
    print(f"croupier demo: {n} samples, {epochs} epochs, batch {batch_size} per worker, checkpoint every "
          f"{cfg['ckpt_every']} steps; logs in {work}")
    t0 = time.perf_counter()
    with open(work / "train.log", "w") as log:
        for i, ph in enumerate(phases, 1):
            resumed = " (resuming from the last checkpoint)" if i > 1 else ""
            print(f"\nphase {i}: torchrun with {ph.workers} workers{resumed}", flush=True)
            run_phase(work, ph, cfg, env, log)
    print(f"\ntraining done in {time.perf_counter() - t0:.0f} s. Audit of what the training loops received "
          f"(croupier audit {work / 'audit'}):\n")
    reports = audit(work / "audit")
    print(render(reports))
    bad = [r for r in reports if not r.ok]
    if bad:
        print(f"\nG1 VIOLATED in {len(bad)} epochs")
        return 1
    print(f"\nG1 holds: every one of the {n} samples trained exactly once per epoch, across a worker crash, "
          "two preemptions and two resizes (3 -> 2 -> 4 workers).")
    return 0
