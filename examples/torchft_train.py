"""A torchft replica group's trainer (one torchrun per group), its data dealt by croupier or by torchft's sampler.

Each replica group is one ``torchrun --nproc-per-node 2`` with ``REPLICA_GROUP_ID`` and
``TORCHFT_LIGHTHOUSE`` set; the groups meet in torchft's Lighthouse, whose quorum decides, step by
step, which groups train it. Inside a group the two ranks keep identical replicas (their gradients
are averaged over the group's own process group, as HSDP does); across groups ``manager.allreduce``
averages them over the quorum, and torchft's ``Optimizer`` steps only when ``manager.should_commit()``.

NOTE: the gradients go through ``manager.allreduce``, not torchft's ``DistributedDataParallel``: in
torchft 0.2.0 its communication hook fails an assertion (``assert fut._fut``) when a peer group dies
mid-allreduce on Gloo, which kills the surviving groups instead of aborting the step::

    # torchft's Lighthouse (its wheel installs it), croupier's coordinator, then a group; more the same way:
    torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000 &
    croupier serve --port 50051 &
    REPLICA_GROUP_ID=0 TORCHFT_LIGHTHOUSE=http://localhost:29510 torchrun --standalone \\
        --nproc-per-node 2 examples/torchft_train.py --workdir out/ft --sampler croupier \\
        --address 127.0.0.1:50051

``--sampler croupier`` deals each step with :class:`croupier.integrations.torchft.StepLoader`: the
step's global batch (``--batch``) is split over the groups of its quorum, an aborted step is dealt
again, a healing group deals from the step the quorum healed it to (no loader state moves). ``--sampler
torchft`` uses torchft's own ``torchft.data.DistributedSampler`` (``num_replica_groups=--max-groups``
fixed up front, each rank ``--rank-batch`` samples a step, so the global batch follows the group
count) with torchdata's ``StatefulDataLoader``, whose state each rank saves every step and loads when
its group starts again, as torchft's ``train_ddp.py`` recommends; model, optimizer and manager come
from the checkpoint (a whole-job restart) or from a peer (a heal).

Every rank appends one JSON line per attempted step to ``WORKDIR/steps/``: the run, group, rank,
step, quorum id, participants, the dataset indices it trained (read back from the batch itself:
item ``i``'s first feature is ``i``) and whether the step committed. Group rank 0 writes a
checkpoint (model, optimizer, ``manager.state_dict()``, the loader's state) to ``WORKDIR/ckpt/``
every ``--ckpt-every`` committed steps, atomically; ``--resume`` starts from the latest one.

Faults for the tests: ``--hold-at S`` stops the group after step S was dealt (a file in
``WORKDIR/control`` says so) until it is killed; ``--abort-at S`` reports an error to the manager
after step S's backward pass, so that this group does not commit it; ``--gates`` and ``--wait-for``
stop it before a step until the test lets it go (torchft steps take milliseconds here: without
them every fault would land wherever the groups happen to be).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import signal
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchft.data import DistributedSampler as FtSampler


class Indexed(Dataset[torch.Tensor]):
    """N synthetic samples; item i is ``[i, sin i, cos i, (i mod 7) / 7]``, so a batch names its own indices."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), math.sin(i), math.cos(i), (i % 7) / 7.0])


TRUE_W = torch.tensor([[0.5], [-1.0], [2.0]])


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=pathlib.Path, required=True)
    p.add_argument("--sampler", choices=("croupier", "torchft"), required=True)
    p.add_argument("--samples", type=int, default=480, help="the dataset's size N")
    p.add_argument("--batch", type=int, default=48, help="croupier: the global batch of a step")
    p.add_argument("--rank-batch", type=int, default=8, help="torchft: each rank's batch")
    p.add_argument("--max-groups", type=int, default=4, help="torchft: num_replica_groups of its sampler")
    p.add_argument("--steps", type=int, default=30, help="train until this many steps committed")
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--job-start", type=int, default=0, help="the whole job's start this is (logged)")
    p.add_argument("--resume", action="store_true", help="start from the latest checkpoint in WORKDIR/ckpt")
    p.add_argument("--address", default="", help="croupier: the coordinator")
    p.add_argument("--job", default="torchft-example")
    p.add_argument("--wait-for", default="", help="a file to wait for (WORKDIR/control/NAME) before the first step")
    p.add_argument("--gates", default="", help="steps (comma-separated) before which the group waits for the file "
                   "WORKDIR/control/gate-runR-sS")
    p.add_argument("--hold-at", type=int, default=-1)
    p.add_argument("--abort-at", type=int, default=-1)
    p.add_argument("--own-counter", action="store_true",
                   help="croupier, broken on purpose: its loader deals by a step counter of its own, moved at every "
                        "step's start whether the step commits or not (the test shows the audit catches it)")
    p.add_argument("--timeout", type=float, default=4.0, help="seconds: torchft's collectives and RPCs")
    return p.parse_args()


class OwnCounter:
    """The manager as the loader sees it when the commit protocol is taken away: its ``current_step()`` is a
    counter that moves at every step's start, committed or not. It starts at the manager's step after the
    first quorum (a group that heals takes the step it healed to), or at `start` (the counter a checkpoint kept)."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self._count: int | None = None
        self.start: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def start_quorum(self, *args: Any, **kwargs: Any) -> None:
        if self._count is not None:
            self._count += 1
        self._manager.start_quorum(*args, **kwargs)
        if self._count is None:
            self._count = self._manager.current_step() if self.start is None else self.start

    def current_step(self) -> int:
        return self._manager.current_step() if self._count is None else self._count


def atomic_save(obj: Any, path: pathlib.Path) -> None:
    """torch.save to a temporary file, then a rename: a reader sees the whole checkpoint or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def latest_checkpoint(ckpt: pathlib.Path) -> pathlib.Path | None:
    """The checkpoint of the highest step any group wrote."""
    found = sorted(ckpt.glob("g*/step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    return found[-1] if found else None


class TorchftData:
    """torchft's sampler and torchdata's StatefulDataLoader, epoch after epoch, its state saved per rank."""

    def __init__(self, args: argparse.Namespace, dataset: Indexed, group: int, rank: int, world: int) -> None:
        self.sampler = FtSampler(dataset, replica_rank=group, num_replica_groups=args.max_groups, group_rank=rank,
                                 num_replicas=world, shuffle=True, seed=0)
        self.loader = StatefulDataLoader(dataset, batch_size=args.rank_batch, sampler=self.sampler)
        self.epoch = 0
        self.path = args.workdir / "ckpt" / "loader" / f"g{group}-r{rank}.pt"
        if self.path.exists():  # a group's own loader state, whatever the model's checkpoint
            state = torch.load(self.path, weights_only=False)
            self.epoch = state["epoch"]
            self.loader.load_state_dict(state["loader"])
        self.sampler.set_epoch(self.epoch)

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield from self.loader
            self.epoch += 1
            self.sampler.set_epoch(self.epoch)

    def save(self) -> None:
        atomic_save({"epoch": self.epoch, "loader": self.loader.state_dict()}, self.path)


def wait_forever(marker: pathlib.Path, timeout: int = 300) -> None:
    """Says it is held (`marker`), then waits to be killed; SIGALRM ends it after `timeout` seconds if nobody does."""
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(os.getpid()))
    signal.alarm(timeout)
    while True:
        signal.pause()


def wait_for(path: pathlib.Path, timeout: float = 300.0) -> None:
    """Polls for `path`; exits with an error after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


def main() -> None:
    args = parse()
    from torchft import Manager, Optimizer, ProcessGroupGloo

    if args.sampler == "croupier":
        from croupier.integrations.torchft import StepLoader
    group = int(os.environ["REPLICA_GROUP_ID"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    control = args.workdir / "control"
    control.mkdir(parents=True, exist_ok=True)
    (control / f"pid-{os.getpid()}").write_text(f"{group} {rank}")
    if args.wait_for:  # imported and waiting, not yet known to torchft: its Manager starts when let go
        (control / f"ready-{args.wait_for}-g{group}-r{rank}").write_text(str(os.getpid()))
        wait_for(control / args.wait_for)
    torch.manual_seed(0)
    dataset = Indexed(args.samples)
    model = nn.Linear(3, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    timeout = timedelta(seconds=args.timeout)

    def load_state(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state, state_dict=state,
                      min_replica_size=1, use_async_quorum=False, replica_id=f"group_{group}", timeout=timeout,
                      quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=30))
    dealer: Any = OwnCounter(manager) if args.own_counter else manager
    optimizer = Optimizer(dealer, inner)

    loader: Any
    if args.sampler == "croupier":
        loader = StepLoader(dealer, dataset, global_batch=args.batch, job=args.job, address=args.address, seed=0)
    else:
        loader = TorchftData(args, dataset, group, rank, world)
    resumed = latest_checkpoint(args.workdir / "ckpt") if args.resume else None
    if resumed is not None:
        ck = torch.load(resumed, weights_only=False)
        load_state(ck)
        manager.load_state_dict(ck["manager"])
        if args.sampler == "croupier":
            loader.load_state_dict(ck["loader"])
            if args.own_counter:
                dealer.start = ck["loader"]["step"]
        print(f"group {group} rank {rank}: resumed from {resumed.name}", flush=True)

    logs = args.workdir / "steps"
    logs.mkdir(parents=True, exist_ok=True)
    log = (logs / f"run{args.job_start}-g{group}-r{rank}-p{os.getpid()}.jsonl").open("a")
    aborted = False
    gates = {int(g) for g in args.gates.split(",") if g}
    it = iter(loader)
    while manager.current_step() < args.steps:
        taken_at = manager.current_step()
        if taken_at in gates:  # before the step's quorum: the other groups wait in theirs, or at the gate too
            gates.discard(taken_at)
            (control / f"at-gate-run{args.job_start}-g{group}-r{rank}-s{taken_at}").write_text("")
            wait_for(control / f"gate-run{args.job_start}-s{taken_at}")
        batch = next(it)
        optimizer.zero_grad()  # torchft's quorum for the step (the croupier loader started it already)
        step = manager.current_step()  # the step this attempt commits, if it does (a healed group's too)
        quorum, participants = manager._quorum_id, manager.num_participants()
        if step == args.hold_at:
            wait_forever(control / f"held-run{args.job_start}-g{group}-r{rank}-s{step}")
        x = batch[:, 1:]
        loss = nn.functional.mse_loss(model(x), x @ TRUE_W)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for work in [manager.allreduce(g) for g in grads]:  # averaged over the quorum's groups
            work.wait()  # a failed allreduce is reported to the manager: the step does not commit
        for g in grads:  # and over this group's ranks, so that they stay identical
            dist.all_reduce(g)
            g /= world
        if step == args.abort_at and not aborted:
            aborted = True
            manager.report_error(RuntimeError(f"step {step} made to abort on group {group}"))
        optimizer.step()
        committed = manager.current_step() > step
        indices = batch[:, 0].long().tolist()
        if args.sampler == "croupier":
            assert indices == loader.indices and (loader.step == step or args.own_counter), (indices, loader.step, step)
        log.write(json.dumps({"run": args.job_start, "group": group, "rank": rank, "step": step, "taken_at": taken_at,
                              "quorum": quorum, "participants": participants, "indices": indices,
                              "committed": committed, "loss": loss.item(),
                              "epoch": getattr(loader, "epoch", None)}) + "\n")
        log.flush()
        if args.sampler == "torchft":
            loader.save()
        now = manager.current_step()
        if committed and rank == 0 and now % args.ckpt_every == 0:
            atomic_save({"model": model.state_dict(), "optim": inner.state_dict(), "manager": manager.state_dict(),
                         "loader": loader.state_dict() if args.sampler == "croupier" else None, "step": now},
                        args.workdir / "ckpt" / f"g{group}" / f"step-{now}.pt")
    print(f"group {group} rank {rank}: done at step {manager.current_step()}", flush=True)
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
