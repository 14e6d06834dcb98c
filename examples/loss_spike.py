"""A loss spike traced to its samples: planted bad samples make the loss jump; provenance finds them, a skip takes them out.

Two synthetic sources (``books`` and ``web``, 160 and 96 samples) are one ``ConcatDataset``, dealt
half and half by croupier as a mixture (skips are changes of a mixture). A few ``web`` samples carry
corrupt labels: the samples the fresh run's step ``--spike-at`` trains, so that the loss jumps at
that step. The trainer checkpoints every ``--every`` steps with ``state_dict(step=...)``, watches
the loss (averaged over the ranks, so every rank decides alike), and at a spike records the state
of the spike step at the coordinator (the ledger counts what was trained from the ranks'
checkpoints and reports) and stops. Then, with a coordinator of its own (``croupier serve``)::

    croupier serve --port 50051 --store sqlite:///out/spike.db &
    torchrun --standalone --nproc-per-node 2 examples/loss_spike.py --workdir out/spike
    # rank 0: loss spike at step 20: ...; the checkpoint before it is step 15
    croupier provenance loss-spike --steps 18:20               # the samples of the steps before the spike
    croupier provenance loss-spike --step 20 --json > out/spike/step-20.json
    croupier skip loss-spike --from out/spike/step-20.json     # never deal them again
    torchrun --standalone --nproc-per-node 2 examples/loss_spike.py --workdir out/spike --resume
    croupier provenance loss-spike --step 20                   # the ABANDONED version beside the kept one
    croupier audit out/spike/audit                             # every other sample exactly once

``--resume`` loads the checkpoint before the spike (the run's step, model, optimizer and sampler
state), so the steps from there on are trained again without the skipped samples. The sampler
writes its audit log under ``WORKDIR/audit`` for ``croupier audit``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import statistics

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import ConcatDataset, DataLoader, Dataset, TensorDataset

from croupier.client import DistributedBatchSampler
from croupier.core.ledger import Ledger, fresh_segment

SOURCES = {"books": 160, "web": 96}
#: How many of the spike step's samples are corrupt, and by how much their labels are off.
BAD, OFF = 2, 100.0


def source(n: int, salt: int) -> TensorDataset:
    """`n` samples of a linear target, the same in every process."""
    g = torch.Generator().manual_seed(1234 + salt)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, x @ torch.randn(16, 1, generator=g))


class Corrupt(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """The mixture's samples, with the labels of `bad` (dataset indices) off by :data:`OFF`; each with its index."""

    def __init__(self, data: ConcatDataset[tuple[torch.Tensor, torch.Tensor]], bad: set[int]) -> None:
        self.data, self.bad = data, bad

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x, y = self.data[i]
        return x, (y + OFF if i in self.bad else y), i


def planted(sampler: DistributedBatchSampler, world: int, step: int, epochs: int) -> list[int]:
    """The samples to corrupt: :data:`BAD` of those a fresh run on `world` ranks trains at `step`, from ``web``.

    NOTE: the order is a pure function of the job's spec, so the ledger answers before the run what a
    fresh run's step will train (a segment as a coordinator would record it, its ranks reported done).
    """
    seg = fresh_segment(sampler.spec, 1, "plan", world)
    for epoch in range(epochs):
        seg.report(epoch, 10**9)
    rec = Ledger("plan", sampler.spec, [seg]).step(step)
    assert rec.kept is not None
    web = [int(i) for b in rec.kept.batches for i, s in zip(b.indices, b.sources, strict=True) if s == 1]
    rest = [int(i) for i in rec.kept.indices if int(i) not in web]
    return (web + rest)[:BAD]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--workdir", required=True, help="checkpoints, the planted samples, the spike's record, the audit log")
    ap.add_argument("--address", default=os.environ.get("CROUPIER_ADDRESS", "127.0.0.1:50051"),
                    help="the coordinator (default $CROUPIER_ADDRESS, else 127.0.0.1:50051)")
    ap.add_argument("--job", default="loss-spike")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4, help="per rank")
    ap.add_argument("--spike-at", type=int, default=20, help="the step whose samples are corrupt (fresh run)")
    ap.add_argument("--every", type=int, default=5, help="checkpoint every this many steps")
    ap.add_argument("--resume", action="store_true", help="resume from the checkpoint before the spike")
    ap.add_argument("--log-steps", action="store_true",
                    help="append each step's indices to WORKDIR/steps-rRANK.jsonl (to compare with croupier provenance)")
    return ap.parse_args(argv)


def _save(path: pathlib.Path, model: nn.Module, optim: torch.optim.Optimizer, state: dict, step: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "sampler": state, "step": step}, path)


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    work = pathlib.Path(args.workdir)
    torch.manual_seed(0)
    data = ConcatDataset([source(n, k) for k, n in enumerate(SOURCES.values())])
    sampler = DistributedBatchSampler(data, args.batch_size, weights=[0.5, 0.5], seed=11, job=args.job,
                                      address=args.address, audit_dir=str(work / "audit"))
    if not args.resume and rank == 0:  # the dataset's corruption is decided once, by the fresh run
        work.mkdir(parents=True, exist_ok=True)
        bad = planted(sampler, world, args.spike_at, args.epochs)
        (work / "planted.json").write_text(json.dumps({"step": args.spike_at, "indices": bad}))
    dist.barrier()
    bad = set(json.loads((work / "planted.json").read_text())["indices"])
    loader = DataLoader(Corrupt(data, bad), batch_sampler=sampler)
    model = DistributedDataParallel(nn.Linear(16, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    step = 0
    if args.resume:
        spike = work / "spike.json"
        at = json.loads(spike.read_text())["resume"] if spike.exists() else None
        if at is None:  # no spike recorded: the latest checkpoint
            at = max((int(p.stem.split("-")[1]) for p in (work / "ckpt").glob("step-*.pt")), default=None)
        if at is None:
            raise SystemExit(f"--resume: no checkpoint in {work / 'ckpt'}")
        ckpt = torch.load(work / "ckpt" / f"step-{at}.pt", weights_only=False)
        model.module.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        sampler.load_state_dict(ckpt["sampler"])
        step = ckpt["step"]
        if rank == 0:
            print(f"resumed at step {step} (epoch {sampler.epoch}, world {world})", flush=True)
    losses: list[float] = []
    try:
        for epoch in range(sampler.epoch, args.epochs):
            sampler.set_epoch(epoch)
            for x, y, idx in loader:
                if args.log_steps:
                    with open(work / f"steps-r{rank}.jsonl", "a") as log:
                        log.write(json.dumps({"generation": sampler.generation, "step": step + 1,
                                              "indices": idx.tolist()}) + "\n")
                optim.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                optim.step()
                step += 1
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                value = mean.item() / world
                if len(losses) >= 5 and value > 10 * statistics.median(losses[-8:]) + 1.0:
                    _spike(args, sampler, step, value, losses, rank)
                    return
                losses.append(value)
                if step % args.every == 0 and rank == 0:  # every rank's sampler state is the job's: one copy
                    _save(work / "ckpt" / f"step-{step}.pt", model.module, optim, sampler.state_dict(step=step), step)
            if rank == 0:
                print(f"epoch {epoch} done at step {step}, loss {losses[-1]:.4f}", flush=True)
        if rank == 0:
            _save(work / "ckpt" / f"step-{step}.pt", model.module, optim, sampler.state_dict(step=step), step)
            print(f"trained to step {step}: no loss spike", flush=True)
    finally:
        sampler.close()


def _spike(args: argparse.Namespace, sampler: DistributedBatchSampler, step: int, value: float, losses: list[float],
           rank: int) -> None:
    """Records the spike step at the coordinator (its samples become a question the ledger answers) and says what next."""
    work = pathlib.Path(args.workdir)
    if rank == 0:
        sampler.state_dict(step=step)
        before = max((int(p.stem.split("-")[1]) for p in (work / "ckpt").glob("step-*.pt")
                      if int(p.stem.split("-")[1]) < step), default=None)
        (work / "spike.json").write_text(json.dumps({"step": step, "loss": value, "resume": before}))
        cli = f"croupier {{}} {args.job} --address {args.address}"
        if before is None:
            print(f"loss spike at step {step}: {value:.1f}, before the first checkpoint: start again", flush=True)
        else:
            print(f"loss spike at step {step}: {value:.1f} (the steps before: {statistics.median(losses[-8:]):.3f}); "
                  f"the checkpoint before it is step {before}. Next:\n"
                  f"  {cli.format('provenance')} --steps {max(1, step - 2)}:{step}\n"
                  f"  {cli.format('provenance')} --step {step} --json > {work}/step-{step}.json\n"
                  f"  {cli.format('skip')} --from {work}/step-{step}.json\n"
                  f"  torchrun --standalone --nproc-per-node N {__file__} --workdir {work} --address {args.address} "
                  "--resume", flush=True)
    dist.barrier()


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
