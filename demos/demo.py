"""`croupier demo`: an elastic job on several torchrun nodes, resized in place and preempted, then audited.

The story, on the CPU with gloo, each node a torchrun agent on this machine (``--nnodes=2:3``,
one c10d rendezvous), croupier's embedded coordinator hosted by rank 0 of each world (or a
standalone ``croupier serve`` with ``coordinator="standalone"``):

  1. Nodes a and b train (2 workers). A worker is SIGKILLed in epoch 0: every node restarts
     its workers in place, and they resume from the last checkpoint.
  2. Node c joins in epoch 1: the nodes re-rendezvous and carry on with 3 workers, in place.
  3. Node c is lost in epoch 2 (its agent and worker SIGKILLed): a and b carry on with 2.
  4. In epoch 3 every node is preempted; nodes a, b and c come back (3 workers) and resume
     from the last checkpoint.
  5. ``croupier audit`` replays the checkpoint chain from the audit log and prints, per epoch,
     how many samples were expected, trained, duplicated and missing.

Every new world is one new generation of the job: the demo checks that the coordinator saw
exactly the planned ones (a live rank that croupier fenced would cost an extra restart).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import signal
import time
from typing import Any

from croupier.core.checks import check_choice
from croupier.demos.cluster import Cluster, statuses
from croupier.tools.audit import audit, load, render, verdict
from croupier.tools.serve import ServeProcess

JOB = "demo"


@dataclasses.dataclass(frozen=True)
class Event:
    """Something that happens to the job once its current world has reached (epoch, step in epoch)."""

    at: tuple[int, int]
    world: int  # the world size training when it happens
    kind: str  # kill_worker, add_node, lose_node, preempt
    node: str = ""
    then: tuple[str, ...] = ()  # for preempt: the nodes that come back


#: The story of the module docstring. Each event waits for the world the one before it made.
STORY = (
    Event((0, 30), 2, "kill_worker", "b"),
    Event((1, 20), 2, "add_node", "c"),
    Event((2, 20), 3, "lose_node", "c"),
    Event((3, 10), 2, "preempt", then=("a", "b", "c")),
)
#: The generations the story makes: the first world, one per event, and the world after the preemption.
PLANNED_GENERATIONS = 1 + len(STORY)


def _bar(frac: float, width: int = 24) -> str:
    full = int(frac * width)
    return "#" * full + "." * (width - full)


def _latest(status: pathlib.Path, since: float) -> dict[str, Any] | None:
    """The most recent progress record of a live world written after `since`."""
    st = [s for s in statuses(status) if s.get("t", 0) > since and not s.get("done")]
    return max(st, key=lambda s: s["t"]) if st else None


def _kill_worker(status: pathlib.Path, node: str, since: float) -> dict[str, Any]:
    victims = [s for s in statuses(status) if s.get("node") == node and s.get("t", 0) > since and not s.get("done")]
    victim = max(victims, key=lambda s: s["t"])
    try:
        os.kill(victim["pid"], signal.SIGKILL)
    except ProcessLookupError:
        pass
    return victim


def run_story(work: pathlib.Path, cluster: Cluster, story: tuple[Event, ...], timeout: float = 600.0) -> None:
    """Plays `story` on a running cluster and waits until the job finishes.

    Raises:
        RuntimeError: a node's agent failed, or the job did not finish within `timeout` seconds.
    """
    status = work / "status"
    since = 0.0
    pending = list(story)
    last_line = ""
    deadline = time.monotonic() + timeout
    while cluster.running() or pending:
        if not cluster.running():
            raise RuntimeError(f"the job ended before the story did (next: {pending[0]}); see {work / 'nodes'}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the job did not finish within {timeout:.0f} s; see {work / 'nodes'}")
        bad = cluster.failed()
        if bad:
            raise RuntimeError(f"node agents failed: {', '.join(bad)}; see {work / 'nodes'}")
        s0 = _latest(status, since)
        if s0 is not None:
            line = (f"  [{s0['world']} workers] epoch {s0['epoch']} {_bar(min(1.0, s0['k'] / max(1, s0['of'])))} "
                    f"{s0['k']:>3}/{s0['of']:<3} step {s0['step']:>4} loss {s0['loss']:.4f}")
            if line != last_line:
                print("\r" + line.ljust(90), end="", flush=True)
                last_line = line
            ev = pending[0] if pending else None
            if ev is not None and s0["world"] == ev.world and (s0["epoch"], s0["k"]) >= ev.at:
                where = f"at epoch {s0['epoch']} step {s0['k']}"
                if ev.kind == "kill_worker":
                    v = _kill_worker(status, ev.node, since)
                    print(f"\n  ! SIGKILL worker rank {v['rank']} on node {ev.node} {where}: every node restarts "
                          "its workers in place, from the last checkpoint", flush=True)
                elif ev.kind == "add_node":
                    cluster.add(ev.node)
                    print(f"\n  ! node {ev.node} joins {where}: the nodes re-rendezvous and go on with "
                          f"{ev.world + 1} workers, in place", flush=True)
                elif ev.kind == "lose_node":
                    cluster.lose(ev.node)
                    print(f"\n  ! node {ev.node} lost {where} (agent and worker SIGKILLed): the others go on "
                          f"with {ev.world - 1} workers, in place", flush=True)
                elif ev.kind == "preempt":
                    cluster.preempt()
                    print(f"\n  ! preempted {where}: every node SIGKILLed", flush=True)
                    print(f"nodes {', '.join(ev.then)} come back ({len(ev.then)} workers), resuming from the last "
                          "checkpoint", flush=True)
                    for name in ev.then:
                        cluster.add(name)
                pending.pop(0)
                since = time.time()
        time.sleep(0.2)  # the progress line's refresh interval (the workers' records drive everything)
    print(flush=True)
    bad = cluster.failed()
    if bad:
        raise RuntimeError(f"node agents failed: {', '.join(bad)}; see {work / 'nodes'}")


def main(workdir: str = "out/demo", n: int = 6000, epochs: int = 5, batch_size: int = 32,
         coordinator: str = "embedded", story: tuple[Event, ...] = STORY, step_ms: int = 40) -> int:
    """Runs the demo; returns 0 when the audit finds G1 holds and the job made only the planned generations."""
    check_choice("coordinator", coordinator, ("embedded", "standalone"))
    work = pathlib.Path(workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cfg = {"workdir": str(work), "n": n, "epochs": epochs, "batch_size": batch_size, "ckpt_every": 15,
           "step_ms": step_ms}
    env = {**os.environ, "CROUPIER_JOB": JOB, "CROUPIER_AUDIT_DIR": str(work / "audit"),
           "CROUPIER_STATE_DIR": str(work / "coordinator"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "DEMO": json.dumps(cfg)}
    env.pop("CROUPIER_ADDRESS", None)
    env.pop("CROUPIER_INCARNATION", None)
    env.pop("CROUPIER_TOKEN", None)
    print(f"croupier demo: {n} samples, {epochs} epochs, batch {batch_size} per worker, checkpoint every "
          f"{cfg['ckpt_every']} steps, {coordinator} coordinator; logs in {work}")
    t0 = time.perf_counter()
    with open(work / "coordinator.log", "w") as log:
        server = None
        if coordinator == "standalone":  # `croupier serve` in a process of its own, on a SQLite store in the workdir
            server = ServeProcess(f"sqlite:///{work / 'coordinator.db'}", log, "the demo's coordinator",
                                  new_session=True).start()
            env["CROUPIER_ADDRESS"] = server.address
        cluster = Cluster(work, env, nnodes="2:3", run_id=f"demo-{os.getpid()}")
        try:
            print("nodes a and b start (torchrun agents, --nnodes=2:3, one c10d rendezvous)", flush=True)
            cluster.add("a")
            cluster.add("b")
            run_story(work, cluster, story)
        finally:
            cluster.close()
            if server is not None:
                server.terminate(30)
    print(f"\ntraining done in {time.perf_counter() - t0:.0f} s. Audit of what the training loops received "
          f"(croupier audit {work / 'audit'}):\n")
    reports = audit(work / "audit")
    print(render(reports))
    ok, summary = verdict(reports)
    generations = sum(len(incs) for incs in load(work / "audit").values())
    planned = 1 + len(story)
    errors = _croupier_errors(work / "nodes")
    print(f"\n{summary}; {generations} generations (planned: {planned}); croupier errors in live ranks: {len(errors)}")
    for line in errors[:5]:
        print(f"  {line}")
    if not ok:
        return 1
    if generations != planned or errors:
        print(f"\nUNPLANNED RESTARTS: {generations} generations where {planned} were planned, {len(errors)} croupier errors")
        return 1
    repeats = sum(r.duplicates for r in reports)
    once = ("exactly once" if repeats == 0 else
            f"at least once ({repeats} repeats in all, from the pad tail: fewer than W an epoch)")
    print(f"\nG1 holds: every one of the {n} samples trained {once} per epoch, across a worker crash, a node "
          "joining and a node lost in place (2 -> 3 -> 2 workers), and a preemption that came back with 3 workers.")
    return 0


def _croupier_errors(nodes: pathlib.Path) -> list[str]:
    """Lines where a worker raised one of croupier's errors (a fenced live rank, a refused join, ...).

    The workers the story kills make their peers fail in gloo ("Connection closed by peer"): that
    is the planned failure, not croupier's.
    """
    out = []
    for log in sorted(nodes.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("[rank") and "Error" in line and ("croupier" in line or "coordinator" in line):
                out.append(f"{log.stem}: {line[:200]}")
    return out
