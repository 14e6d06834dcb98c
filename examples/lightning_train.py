"""croupier under PyTorch Lightning: a tiny model on a synthetic dataset, preempted mid-epoch and resumed.

Run with torchrun (gloo, CPU; rank 0 hosts croupier's embedded coordinator)::

    export CROUPIER_JOB=lightning-demo CROUPIER_AUDIT_DIR=/tmp/lt/audit
    torchrun --standalone --nproc-per-node 2 examples/lightning_train.py --ckpt-dir /tmp/lt/ckpt \\
        --epochs 3 --checkpoint-every 5 --stop-after-steps 7          # checkpoint at step 5, "preempted" at 7
    torchrun --standalone --nproc-per-node 1 examples/lightning_train.py --ckpt-dir /tmp/lt/ckpt \\
        --epochs 3 --resume /tmp/lt/ckpt/step=5.ckpt                   # any world size
    croupier audit /tmp/lt/audit                                       # every epoch exactly once

Default Trainer settings (``use_distributed_sampler=True``): croupier's sampler is an instance of
torch's ``DistributedSampler``, so Lightning keeps it. ``--loader stateful`` uses torchdata's
``StatefulDataLoader`` instead of the plain ``DataLoader``; ``--no-callback`` leaves out
:class:`~croupier.integrations.lightning.CroupierCheckpoint`: the run warns that its checkpoints
cannot resume croupier, and a resume so is refused before its first batch.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from croupier.client import DistributedBatchSampler, DistributedSampler, worker_options
from croupier.integrations.lightning import CroupierCheckpoint


class TinyModel(pl.LightningModule):
    def __init__(self, n: int, batch_size: int, loader: str, workers: int, batch_sampler: bool) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        self.n, self.batch_size, self.loader, self.workers = n, batch_size, loader, workers
        self.batch_sampler = batch_sampler
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, 8, generator=g)
        self.dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))

    def train_dataloader(self) -> Any:
        if self.batch_sampler:  # needs Trainer(use_distributed_sampler=False): see croupier.integrations.lightning
            batches = DistributedBatchSampler(self.dataset, self.batch_size, seed=1)
            return DataLoader(self.dataset, batch_sampler=batches, **worker_options(self.workers))
        sampler = DistributedSampler(self.dataset, seed=1)  # world, rank, job and coordinator resolved
        if self.loader == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(self.dataset, batch_size=self.batch_size, sampler=sampler,
                                      **worker_options(self.workers))
        return DataLoader(self.dataset, batch_size=self.batch_size, sampler=sampler, **worker_options(self.workers))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Preempt(Callback):
    """Ends every rank abruptly (``os._exit``, as a preemption would) once `steps` optimizer steps are done."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step >= self.steps:
            print(f"rank {trainer.global_rank}: preempted at step {trainer.global_step} "
                  f"(epoch {trainer.current_epoch}, batch {batch_idx})", flush=True)
            sys.stdout.flush()
            os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--n", type=int, default=96, help="samples in the synthetic dataset")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--workers", type=int, default=0, help="DataLoader num_workers")
    ap.add_argument("--loader", choices=("plain", "stateful"), default="plain")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="ModelCheckpoint(every_n_train_steps=...)")
    ap.add_argument("--epoch-end-checkpoints", action="store_true", help="ModelCheckpoint at every epoch's end instead")
    ap.add_argument("--stop-after-steps", type=int, default=0, help="simulate a preemption after this many steps")
    ap.add_argument("--resume", default=None, help="a checkpoint to resume from (trainer.fit(ckpt_path=...))")
    ap.add_argument("--no-callback", action="store_true", help="leave out CroupierCheckpoint")
    ap.add_argument("--batch-sampler", action="store_true", help="DistributedBatchSampler as batch_sampler= (plain loader)")
    ap.add_argument("--no-distributed-sampler", action="store_true", help="Trainer(use_distributed_sampler=False)")
    args = ap.parse_args()

    callbacks: list[Callback] = []
    if not args.no_callback:
        callbacks.append(CroupierCheckpoint())
    if args.checkpoint_every:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, filename="{step}", every_n_train_steps=args.checkpoint_every,
                                         save_top_k=-1, save_on_train_epoch_end=False))
    elif args.epoch_end_checkpoints:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, filename="{step}", every_n_epochs=1, save_top_k=-1,
                                         save_on_train_epoch_end=True))
    if args.stop_after_steps:
        callbacks.append(Preempt(args.stop_after_steps))
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                         strategy="ddp" if _world() > 1 else "auto",
                         max_epochs=args.epochs, callbacks=callbacks, logger=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         enable_checkpointing=bool(args.checkpoint_every or args.epoch_end_checkpoints),
                         num_sanity_val_steps=0, use_distributed_sampler=not args.no_distributed_sampler)
    model = TinyModel(args.n, args.batch_size, args.loader, args.workers, args.batch_sampler)
    trainer.fit(model, ckpt_path=args.resume)
    if trainer.global_rank == 0:
        print(f"done: {trainer.current_epoch} epochs, {trainer.global_step} steps, world {trainer.world_size}", flush=True)


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


if __name__ == "__main__":
    main()
