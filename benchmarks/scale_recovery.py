"""Many jobs: a coordinator of 1,000 jobs and 1e6 journaled events killed with kill -9, then recovered.

A filler process writes the store as such a coordinator leaves it (every job's ranks joined, then
progress reports and checkpoints, snapshots every ``--snapshot-every`` records), is killed with kill -9,
and ``croupier serve`` starts on the store: the seconds to its 'listening' line, its RSS, and a
ListJobs of every job. Run through ``python benchmarks/scale_bench.py --jobs 1000``; this file run with
a JSON argument is the filler.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
RESULT = "RESULT "


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def proc_rss(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


#: The issue's target: recovery of a coordinator of 1,000 jobs and 1e6 journaled events (seconds).
TARGET_RECOVERY_S = 5.0
#: World sizes of the jobs: 1 to 512 ranks, each power of two as likely.
JOB_WORLDS = [1 << k for k in range(10)]


def fill(args: dict[str, Any]) -> None:
    """Writes a store as a coordinator of `jobs` jobs leaves it after `events` events, then waits to be killed.

    Every job joins all its ranks (registered, a generation opened, each rank joined, started); the
    rest are progress reports and checkpoints, as training ranks send them. The events are appended
    in batches as a coordinator's group commits append them, and the state is snapshotted every
    `snapshot_every` records, as the coordinator snapshots it.
    """
    from croupier.core.cursor import Cursor
    from croupier.core.spec import Spec
    from croupier.server._events import (
        CheckpointRecorded,
        GenerationOpened,
        GenerationStarted,
        JobRegistered,
        ProgressReported,
        RankJoined,
    )
    from croupier.server._journal import pack_event, pack_snapshot
    from croupier.server._state import State
    from croupier.server._stores import open_store

    rng = np.random.default_rng(0)
    store = open_store(args["url"])
    state = State()
    pending: list[bytes] = []
    since = 0
    written = 0
    snap: dict[str, float] = {"ms": 0.0, "bytes": 0, "seq": 0}

    def emit(ev: Any) -> None:
        nonlocal since, written
        state.apply(ev)
        pending.append(pack_event(ev))
        written += 1
        if len(pending) >= 256:
            flush()

    def flush() -> None:
        nonlocal since
        if not pending:
            return
        seq = store.append(pending)
        since += len(pending)
        pending.clear()
        if since >= args["snapshot_every"]:
            t0 = time.perf_counter()
            payload = pack_snapshot(state)
            store.write_snapshot(seq, payload)
            snap["ms"], snap["bytes"], snap["seq"] = (time.perf_counter() - t0) * 1e3, len(payload), seq
            since = 0

    worlds = [int(w) for w in rng.choice(JOB_WORLDS, size=args["jobs"])]
    for j, w in enumerate(worlds):
        name = f"job-{j:04d}"
        spec = Spec(n=1_000_000, seed=j, batch_size=32)
        emit(JobRegistered(name, spec))
        emit(GenerationOpened(name, 1, w, f"{name}-1"))
        for r in range(w):
            emit(RankJoined(name, 1, r, None, None))
        emit(GenerationStarted(name, 1, Cursor(0, ((0, 1_000_000),))))
    t = 0
    while written < args["events"]:
        j = t % len(worlds)
        name, w = f"job-{j:04d}", worlds[j]
        step = t // len(worlds) + 1
        for r in range(w):
            emit(ProgressReported(name, 1, r, 0, step, 1_700_000_000_000 + t))
            if written >= args["events"]:
                break
        if step % 50 == 0:
            emit(CheckpointRecorded(name, 1, 0, step, Cursor(0, ((min(step * 32 * w, 999_999), 1_000_000),)),
                                    f"{name}-1/0/{step}", 1_700_000_000_000 + t))
        t += 1
    flush()
    print(RESULT + json.dumps({"events": written, "jobs": len(worlds), "ranks": sum(worlds), "snapshot_ms": snap["ms"],
                               "snapshot_mib": snap["bytes"] / 2**20, "replayed": written - snap["seq"]}), flush=True)
    sys.stdin.readline()  # killed here (kill -9), never closed


def recovery(jobs: int, events: int, snapshot_every: int) -> dict[str, Any]:
    """A store of `jobs` jobs and `events` events, its writer killed with kill -9, then `croupier serve` on it:
    the seconds to its 'listening' line, its RSS per job, the store's size and a ListJobs of every job."""
    import signal

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/c.db"
        filler = subprocess.Popen([sys.executable, str(HERE / "scale_recovery.py"), json.dumps(dict(
            url=url, jobs=jobs, events=events, snapshot_every=snapshot_every))], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        assert filler.stdout is not None
        line = filler.stdout.readline()
        if not line.startswith(RESULT):
            raise RuntimeError(f"the store could not be filled: {line!r}")
        made = json.loads(line[len(RESULT):])
        filler.send_signal(signal.SIGKILL)
        filler.wait(timeout=60)
        size = sum(f.stat().st_size for f in pathlib.Path(tmp).glob("c.db*"))
        t0 = time.monotonic()
        serve = subprocess.Popen([sys.executable, "-m", "croupier.tools.cli", "serve", "--port", "0", "--store", url,
                                  "--snapshot-every", str(snapshot_every)], stdout=subprocess.PIPE, text=True)
        try:
            assert serve.stdout is not None
            first = serve.stdout.readline().strip()
            took = time.monotonic() - t0
            if not first.startswith("listening on "):
                raise RuntimeError(f"croupier serve did not recover: {first!r}")
            rss = proc_rss(serve.pid)
            from croupier.client import CoordinatorClient

            with CoordinatorClient(first.split()[-1]) as c:
                t1 = time.monotonic()
                listed = c.jobs()
                list_ms = (time.monotonic() - t1) * 1e3
        finally:
            serve.terminate()
            serve.wait(timeout=60)
    return {**made, "snapshot_every": snapshot_every, "recovery_s": took, "rss_mib": rss / 2**20,
            "rss_kib_per_job": rss / 1024 / jobs, "store_mib": size / 2**20, "listed": len(listed),
            "list_jobs_ms": list_ms}


def render(r: dict[str, Any]) -> str:
    ok = r["recovery_s"] < TARGET_RECOVERY_S
    return "\n".join([
        "| jobs (ranks) | events | --snapshot-every | one snapshot | records replayed | store "
        "| recovery to 'listening' (kill -9 before) | RSS after (per job) | ListJobs of all | target |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {r['jobs']:,} ({r['ranks']:,}) | {r['events']:,} | {r['snapshot_every']:,} "
        f"| {r['snapshot_mib']:.1f} MiB in {r['snapshot_ms']:.0f} ms | {r['replayed']:,} | {r['store_mib']:.0f} MiB "
        f"| {r['recovery_s']:.2f} s | {r['rss_mib']:.0f} MiB ({r['rss_kib_per_job']:.0f} KiB) "
        f"| {r['listed']:,} in {r['list_jobs_ms']:.0f} ms | < {TARGET_RECOVERY_S:g} s: {verdict(ok)} |",
    ])


if __name__ == "__main__":
    fill(json.loads(sys.argv[1]))
