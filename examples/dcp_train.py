"""A torchtitan-style loop that checkpoints with ``torch.distributed.checkpoint`` (DCP), preempted and resumed resized.

Model, optimizer and data loader go into one DCP checkpoint, ``{"model", "optim", "dataloader",
"train"}``; the dataloader entry is :class:`croupier.integrations.dcp.SamplerState` over the
:class:`croupier.client.Loader` the loop iterates (see that module for why the sampler is not handed
to DCP as it is). ``Loader`` counts the batches that reached the loop, so the state is exact with
DataLoader workers reading ahead, and ``step=`` names the trainer's step in it. The checkpoint is
topology-free: saved by 2 ranks mid-epoch, it resumes on any number (the tests resume on 2 and on 1).

    # train, checkpoint at global step 13 (mid-epoch) and stop there, as if preempted:
    torchrun --standalone --nproc-per-node 2 examples/dcp_train.py --ckpt-dir out/dcp --stop-after-steps 13
    # resume from it with another world size and train to the end of the epochs:
    torchrun --standalone --nproc-per-node 1 examples/dcp_train.py --ckpt-dir out/dcp --resume out/dcp/step-13

With ``CROUPIER_AUDIT_DIR=<dir>`` set for both runs, ``croupier audit <dir>`` then checks that every
epoch was trained exactly once across the two. ``--skip-dataloader-state`` (resume model and
optimizer only: the usual mistake) and ``--plain-sampler`` (hand DCP the sampler itself) exist to
show what the audit says when the data order is not resumed properly.
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from croupier.client import DistributedSampler, Loader, worker_options
from croupier.integrations.dcp import SamplerState


class ModelState(Stateful):
    """The model as torchtitan's checkpointer holds it: DCP's state-dict helpers, replicated under DDP."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimState(Stateful):
    """The optimizer's state, keyed by parameter name (DCP's helpers), so it loads on any world size."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optim)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optim, state_dict)


def synthetic(n: int) -> TensorDataset:
    """`n` samples of a noisy linear target, the same in every process."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--samples", type=int, default=80)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4, help="per rank")
    ap.add_argument("--num-workers", type=int, default=0,
                    help="DataLoader workers (they read the sampler ahead of the loop; Loader counts what it took)")
    ap.add_argument("--job", default="dcp-train", help="croupier job name (a resumed run keeps the checkpoint's)")
    ap.add_argument("--ckpt-dir", required=True, help="checkpoints go to DIR/step-N")
    ap.add_argument("--stop-after-steps", type=int, default=None,
                    help="save a DCP checkpoint after this many global steps and stop (a simulated preemption)")
    ap.add_argument("--resume", default=None, help="a DCP checkpoint directory to load before training")
    ap.add_argument("--skip-dataloader-state", action="store_true",
                    help="on --resume, load model and optimizer but not the data loader (wrong, for the audit to catch)")
    ap.add_argument("--plain-sampler", action="store_true",
                    help="save/load the sampler itself under 'dataloader' instead of SamplerState (loses its origin)")
    return ap.parse_args(argv)


def train(args: argparse.Namespace) -> None:
    """The training loop; returns after the last epoch, or after the checkpoint of --stop-after-steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)

    dataset = synthetic(args.samples)
    # a step is one loader batch of every rank (the index sampler's batch is one index)
    sampler = DistributedSampler(dataset, shuffle=True, seed=7, job=args.job, global_batch=args.batch_size * world)
    loader = Loader(DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, **worker_options(args.num_workers)))
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    progress = {"step": 0}  # a plain dict: DCP fills it in place on load
    dataloader_state: Stateful = sampler if args.plain_sampler else SamplerState(loader, step=lambda: progress["step"])
    state: dict[str, Any] = {"model": ModelState(model), "optim": OptimState(model, optim), "train": progress,
                             "dataloader": dataloader_state}

    if args.resume:
        to_load = {k: v for k, v in state.items() if not (args.skip_dataloader_state and k == "dataloader")}
        dcp.load(to_load, checkpoint_id=args.resume)  # before the first batch: the sampler has not joined yet
        if rank == 0:
            print(f"resumed {args.resume} at step {progress['step']}, epoch {sampler.epoch}, world {world}", flush=True)

    loss_fn = nn.MSELoss()
    loss = torch.tensor(float("nan"))
    try:
        for epoch in range(sampler.epoch, args.epochs):
            sampler.set_epoch(epoch)  # optional with croupier; kept as torch's loops do
            for x, y in loader:
                optim.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
                optim.step()
                progress["step"] += 1
                if args.stop_after_steps is not None and progress["step"] == args.stop_after_steps:
                    path = pathlib.Path(args.ckpt_dir) / f"step-{progress['step']}"
                    dcp.save(state, checkpoint_id=str(path))  # every rank: DCP's save is a collective
                    if rank == 0:
                        print(f"saved {path} at epoch {epoch}, {loader.items_trained // args.batch_size} steps in; "
                              "stopping (preempted)", flush=True)
                    return
            if rank == 0:
                print(f"epoch {epoch} done at step {progress['step']}, loss {loss.item():.4f}, world {world}", flush=True)
        if rank == 0:
            print(f"training done at step {progress['step']}", flush=True)
    finally:
        loader.close()
        sampler.close()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    dist.init_process_group("gloo")
    try:
        train(args)
    finally:
        # NOTE: the DDP model must be gone before the process group is destroyed. Freed after it,
        # DDP's reducer holds the last reference to the gloo group, whose destructor then runs
        # with the GIL held and joins gloo's worker threads, one of which may be releasing a
        # finished all-reduce and need the GIL: a deadlock at exit (seen about 1 run in 4 here,
        # torch 2.13 CPU). train()'s locals are freed when it returns; gc collects any cycle.
        gc.collect()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
