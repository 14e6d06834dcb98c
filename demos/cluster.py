"""Several torchrun agents on this machine standing in for the nodes of an elastic job.

Each agent is one node (``--nproc-per-node``) of a ``--nnodes=MIN:MAX`` job sharing a c10d
rendezvous. The rendezvous store is hosted here, not by one of the agents, the way a cluster's
rendezvous service outlives any node: so any node can be lost. Each agent runs in a session of
its own, so losing a node is one ``killpg`` of the agent and its workers.

Workers must set up their process group for each rendezvous round; the agents get
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` so that every round has a store of its own (see
:func:`croupier.demos.demo_train.init_process_group`).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import Mapping
from datetime import timedelta
from typing import IO, Any

TRAINER = "croupier.demos.demo_train"


class Cluster:
    """A rendezvous store and the agents (nodes) that use it.

    Args:
        work: Where the agents' logs go (``WORK/nodes/NAME.log``).
        env: The agents' environment (the trainer's settings included).
        nnodes: torchrun's ``--nnodes``, e.g. ``"2:3"``.
        nproc_per_node: Workers per node.
        max_restarts: torchrun's ``--max-restarts`` (failures, not membership changes, count).
        run_id: The rendezvous id shared by the nodes.
    """

    def __init__(self, work: pathlib.Path, env: Mapping[str, str], nnodes: str, nproc_per_node: int = 1,
                 max_restarts: int = 5, run_id: str = "croupier") -> None:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]  # exported at run time

        self.work = work
        self.env = {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        self.nnodes = nnodes
        self.nproc_per_node = nproc_per_node
        self.max_restarts = max_restarts
        self.run_id = run_id
        self._store = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False,
                               timeout=timedelta(seconds=300))
        self.endpoint = f"127.0.0.1:{self._store.port}"
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: dict[str, IO[bytes]] = {}
        (work / "nodes").mkdir(parents=True, exist_ok=True)

    def add(self, name: str) -> None:
        """Starts node `name`: a torchrun agent that joins the rendezvous (a scale-up if a round runs)."""
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nnodes}",
               f"--nproc-per-node={self.nproc_per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={self.endpoint}",
               f"--rdzv-id={self.run_id}", "--rdzv-conf=is_host=0,last_call_timeout=5,join_timeout=120",
               f"--max-restarts={self.max_restarts}", "--monitor-interval=0.2", "-m", TRAINER]
        log = open(self.work / "nodes" / f"{name}.log", "ab")
        self._logs[name] = log
        self.nodes[name] = subprocess.Popen(cmd, env={**self.env, "CROUPIER_DEMO_NODE": name}, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def lose(self, name: str) -> None:
        """Node `name` is gone: SIGKILL to its agent and its workers at once."""
        proc = self.nodes.pop(name)
        workers = descendants(proc.pid)  # torchrun starts its workers in sessions of their own
        for pid in [proc.pid, *workers]:
            sigkill(pid)
        proc.wait()
        self._logs.pop(name).close()

    def preempt(self) -> None:
        """Every node is gone at once."""
        for name in list(self.nodes):
            self.lose(name)

    def running(self) -> bool:
        """Whether any agent still runs."""
        return any(p.poll() is None for p in self.nodes.values())

    def failed(self) -> list[str]:
        """Nodes whose agent exited with an error (for example, out of restarts)."""
        return [f"{n} (exit {p.returncode})" for n, p in self.nodes.items() if p.poll() not in (None, 0)]

    def close(self) -> None:
        """Stops every node that still runs."""
        self.preempt()


def sigkill(pid: int) -> None:
    """SIGKILL to `pid`, unless it is gone already."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def runs_trainer(pid: int) -> bool:
    """`pid` still runs the demo trainer (so that a recycled pid is never killed)."""
    try:
        return TRAINER.encode() in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def descendants(root: int) -> list[int]:
    """Every descendant of `root`, from /proc (torchrun's workers sit in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def statuses(status_dir: pathlib.Path) -> list[dict[str, Any]]:
    """The workers' latest progress records (``rRANK.json``, written by the demo trainer each step)."""
    out = []
    for f in status_dir.glob("r*.json"):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            pass  # being replaced right now
    return out
