"""A weighted mixture of three sources, its weights changed mid-run, preempted and resumed on another world size.

Three synthetic sources (``web``, ``code``, ``math``, of 300, 100 and 40 samples) are one
``ConcatDataset``; the sampler deals them 60 / 30 / 10 for the run's first 600 samples and
30 / 30 / 40 from there on. Each sample's noise comes from its own seed (``tag=True``), so it is
the same on any world size and after the resume. The checkpoint (model, optimizer, the sampler's
state) is one ``torch.save`` file made by rank 0.

    # train on 4 ranks, save at global step 8 and stop there, as if preempted:
    torchrun --standalone --nproc-per-node 4 examples/mixture_train.py --ckpt out/mix.pt --stop-after-steps 8
    # resume on 3 ranks and train to the end of the epochs (the weights change on the way):
    torchrun --standalone --nproc-per-node 3 examples/mixture_train.py --ckpt out/mix.pt --resume

With ``CROUPIER_AUDIT_DIR=<dir>`` set for both runs, ``croupier audit <dir>`` checks every epoch
against the mixture and prints each source epoch's samples: expected, trained, duplicated, missing.
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import ConcatDataset, DataLoader, Dataset, TensorDataset

from croupier.client import DistributedSampler, Sample, worker_options

SOURCES = {"web": 300, "code": 100, "math": 40}
#: (from the run's sample, weights of web / code / math)
SCHEDULE = [(0, [0.6, 0.3, 0.1]), (600, [0.3, 0.3, 0.4])]


def source(name: str, n: int, salt: int) -> TensorDataset:
    """`n` samples of a noisy linear target of its own, the same in every process."""
    g = torch.Generator().manual_seed(1234 + salt)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, x @ torch.randn(16, 1, generator=g))


class Noisy(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The mixture's samples, each with noise drawn from its own seed (an augmentation that survives resumes)."""

    def __init__(self, data: ConcatDataset[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: Sample) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data[i]
        g = torch.Generator().manual_seed(i.seed)
        return x + 0.05 * torch.randn(x.shape, generator=g), y


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4, help="per rank")
    ap.add_argument("--num-workers", type=int, default=0)
    ap.add_argument("--job", default="mixture-train")
    ap.add_argument("--ckpt", required=True, help="the checkpoint file")
    ap.add_argument("--stop-after-steps", type=int, default=None, help="save after this many steps and stop")
    ap.add_argument("--resume", action="store_true", help="load --ckpt before training")
    return ap.parse_args(argv)


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = ConcatDataset([source(name, n, k) for k, (name, n) in enumerate(SOURCES.items())])
    dataset = Noisy(data)
    # The ConcatDataset names the sources' sizes; an epoch is len(dataset) = 440 samples of the mixture.
    sampler = DistributedSampler(data, weights=SCHEDULE, tag=True, seed=7, job=args.job)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, **worker_options(args.num_workers))
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = 0
    if args.resume:
        ckpt = torch.load(args.ckpt, weights_only=False)
        model.module.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        sampler.load_state_dict(ckpt["sampler"])
        step = ckpt["step"]
        if rank == 0:
            print(f"resumed {args.ckpt} at step {step}, epoch {sampler.epoch}, world {world}", flush=True)
    loss = torch.tensor(float("nan"))
    try:
        for epoch in range(sampler.epoch, args.epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                optim.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                optim.step()
                step += 1
                if step == args.stop_after_steps:
                    if rank == 0:  # every rank's sampler state is the job's: one copy is enough
                        pathlib.Path(args.ckpt).parent.mkdir(parents=True, exist_ok=True)
                        torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                                    "sampler": sampler.state_dict(), "step": step}, args.ckpt)
                        print(f"saved {args.ckpt} at step {step}, epoch {epoch}; stopping (preempted)", flush=True)
                    dist.barrier()
                    return
            if rank == 0:
                print(f"epoch {epoch} done at step {step}, loss {loss.item():.4f}, world {world}", flush=True)
    finally:
        sampler.close()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    dist.init_process_group("gloo")
    try:
        train(args)
    finally:
        gc.collect()  # the DDP model before the process group (see examples/dcp_train.py)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
