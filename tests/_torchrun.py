"""Runs an example under ``torchrun --standalone`` for the end-to-end tests, reads the loop logs examples write, audits."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import signal
import subprocess
import sys

import psutil  # type: ignore[import-untyped]

from croupier.tools.audit import EpochReport, audit, render, verdict

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Variables of the test's own environment that would point the example at another job or coordinator.
_CLEARED = ("CROUPIER_ADDRESS", "CROUPIER_INCARNATION", "CROUPIER_TOKEN", "CROUPIER_JOB")


def torchrun(example: str, nproc: int, workdir: pathlib.Path, args: list[str], env: dict[str, str] | None = None,
             timeout: float = 150.0, fails: bool = False) -> tuple[str, str]:
    """Runs ``examples/EXAMPLE`` on `nproc` ranks in `workdir`, with its audit logs in ``workdir/audit`` and
    embedded coordinator stores in ``workdir/state`` (unless `env` says otherwise); returns (stdout, stderr).

    Raises AssertionError when it exits non-zero (zero, with `fails`) or outlives `timeout`: then every process it
    started is sent SIGABRT first, so that each prints where its threads stand (``faulthandler``, on
    through PYTHONFAULTHANDLER) into the error, and killed after (torchrun gives each worker a
    session of its own).
    """
    full = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    full.update({"CROUPIER_AUDIT_DIR": str(workdir / "audit"), "CROUPIER_STATE_DIR": str(workdir / "state"),
                 "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "examples" / example), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full, cwd=workdir,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        children = psutil.Process(proc.pid).children(recursive=True)
        for child in children:  # the workers and their loader processes, not torchrun itself
            _signal(child, signal.SIGABRT)  # their stacks, for the error below
        psutil.wait_procs(children, timeout=10)
        for child in children:
            _signal(child, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"{example} on {nproc} ranks timed out after {timeout} s:\n{out}\n{err[-30000:]}") from None
    print(out, end="")
    assert (proc.returncode != 0) == fails, f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-3000:]}\n{err[-6000:]}"
    return out, err


def _signal(process: psutil.Process, sig: int) -> None:
    try:
        process.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def loop_counts(workdir: pathlib.Path) -> dict[int, collections.Counter[int]]:
    """Per epoch, how often each index reached the training loop, over every run's loop log (``trained/*.jsonl``)."""
    seen: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for path in sorted((workdir / "trained").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            seen[rec["epoch"]].update(rec["idx"])
    return seen


def exactly_once(seen: dict[int, collections.Counter[int]], epochs: int, samples: int) -> bool:
    """Every epoch of `epochs` saw every index of `samples` exactly once."""
    return sorted(seen) == list(range(epochs)) and all(
        sorted(c) == list(range(samples)) and set(c.values()) == {1} for c in seen.values())


def audited_exactly_once(audit_dir: pathlib.Path, title: str, epochs: int, samples: int) -> list[EpochReport]:
    """``croupier audit`` of `audit_dir`, its table printed under `title` (shown with -s); asserts that the
    verdict holds and that each of `epochs` epochs finished with each of `samples` indices once. Returns the reports."""
    reports = audit(audit_dir)
    ok, summary = verdict(reports)
    print(f"{title}:\n{render(reports)}\n{summary}")
    assert ok, summary
    assert [(r.epoch, r.finished, r.trained, r.duplicates, r.missing) for r in reports] == [
        (e, True, samples, 0, 0) for e in range(epochs)], render(reports)
    return reports
