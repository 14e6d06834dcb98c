"""A HF Accelerate training loop over croupier's sampler: checkpointed mid-epoch, preempted, resumed resized.

The loader is prepared with :func:`croupier.integrations.accelerate.prepare_data_loader` (croupier's
sharding kept, the sampler's state registered for ``save_state``); model and optimizer with
``accelerator.prepare``. The checkpoint is ``accelerator.save_state``'s folder: saved by 2 ranks
mid-epoch, it resumes on 1, 2 or 3.

    # train, save_state at global step 13 (mid-epoch) and stop there, as if preempted:
    torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py --ckpt-dir out/acc --stop-after-steps 13
    # resume from it with another world size and train to the end of the epochs:
    torchrun --standalone --nproc-per-node 1 examples/accelerate_train.py --ckpt-dir out/acc --resume out/acc/step-13

With ``CROUPIER_AUDIT_DIR=<dir>`` set for both runs, ``croupier audit <dir>`` then checks that every
epoch was trained exactly once across the two. ``--trained-log DIR`` makes each rank also write the
dataset indices its loop trained on (``DIR/<run>-rank<r>.jsonl``, one line per batch), counted
after the loader, not at the sampler. ``--plain-prepare`` prepares the loader with
``accelerator.prepare`` as it is (no integration), to show what croupier does then: Accelerate would
re-shard croupier's batches (each rank training half of its share), and the sampler refuses with an
error that names ``prepare_data_loader``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset

from croupier.client import DistributedBatchSampler, DistributedSampler, worker_options
from croupier.integrations.accelerate import prepare_data_loader


class Synthetic(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """`n` samples of a noisy linear target, the same in every process; each sample carries its index."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 16, generator=g)
        self.y = self.x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4, help="per rank")
    ap.add_argument("--sampler", choices=["index", "batch"], default="index",
                    help="croupier's DistributedSampler (sampler=) or DistributedBatchSampler (batch_sampler=)")
    ap.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (> 0 reads further ahead)")
    ap.add_argument("--job", default="accelerate-train", help="croupier job name (a resumed run keeps the checkpoint's)")
    ap.add_argument("--ckpt-dir", required=True, help="checkpoints go to DIR/step-N")
    ap.add_argument("--stop-after-steps", type=int, default=None,
                    help="save_state after this many global steps and stop (a simulated preemption)")
    ap.add_argument("--resume", default=None, help="a save_state folder to load before training")
    ap.add_argument("--trained-log", default=None, help="each rank writes the indices its loop trained on under DIR")
    ap.add_argument("--plain-prepare", action="store_true",
                    help="accelerator.prepare the loader as it is (wrong: Accelerate re-shards croupier's batches)")
    args = ap.parse_args(argv)

    accelerator = Accelerator(cpu=True)  # gloo under torchrun; initialises the process group
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)

    dataset = Synthetic(args.samples)
    sampler: DistributedSampler | DistributedBatchSampler
    loader: Any
    if args.sampler == "batch":
        sampler = DistributedBatchSampler(dataset, args.batch_size, shuffle=True, seed=7, job=args.job)
        loader = DataLoader(dataset, batch_sampler=sampler, **worker_options(args.num_workers))
    else:
        sampler = DistributedSampler(dataset, shuffle=True, seed=7, job=args.job)
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, **worker_options(args.num_workers))
    if args.plain_prepare:
        loader = accelerator.prepare(loader)
        accelerator.register_for_checkpointing(sampler)  # the sampler itself: no `consumed`, and re-sharded anyway
    else:
        loader = prepare_data_loader(accelerator, loader)  # croupier's sharding kept; its state registered
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optim = accelerator.prepare(model, optim)

    step_file = "train_step.json"
    step = 0
    if args.resume:
        accelerator.load_state(args.resume)  # before the first batch: the sampler resumes there, any world size
        step = json.loads((pathlib.Path(args.resume) / step_file).read_text())["step"]
        if rank == 0:
            print(f"resumed {args.resume} at step {step}, epoch {sampler.epoch}, world {world}", flush=True)

    log_file = None
    if args.trained_log:
        pathlib.Path(args.trained_log).mkdir(parents=True, exist_ok=True)
        run = "resume" if args.resume else "first"
        log_file = open(pathlib.Path(args.trained_log) / f"{run}-w{world}-rank{rank}.jsonl", "a")

    loss_fn = nn.MSELoss()
    try:
        for epoch in range(sampler.epoch, args.epochs):
            loader.set_epoch(epoch)  # optional with croupier; kept as Accelerate's loops do
            for x, y, idx in loader:
                optim.zero_grad()
                loss = loss_fn(model(x), y)
                accelerator.backward(loss)
                optim.step()
                step += 1
                if log_file is not None:
                    log_file.write(json.dumps({"epoch": epoch, "idx": idx.tolist()}) + "\n")
                    log_file.flush()
                if args.stop_after_steps is not None and step == args.stop_after_steps:
                    path = pathlib.Path(args.ckpt_dir) / f"step-{step}"
                    accelerator.save_state(str(path))  # every rank: the registered states are taken on each
                    if accelerator.is_main_process:
                        (path / step_file).write_text(json.dumps({"step": step}))
                        print(f"saved {path} at epoch {epoch}, step {step}; stopping (preempted)", flush=True)
                    accelerator.wait_for_everyone()
                    return 0
            if rank == 0:
                print(f"epoch {epoch} done at step {step}, loss {loss.item():.4f}, world {world}", flush=True)
        if rank == 0:
            print(f"training done at step {step}", flush=True)
        return 0
    finally:
        if log_file is not None:
            log_file.close()
        sampler.close()
        accelerator.end_training()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
