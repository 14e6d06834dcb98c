"""The HF ``Trainer`` over croupier's sampler: checkpointed mid-epoch, preempted, resumed with another world size.

:class:`croupier.integrations.transformers.CroupierTrainer` is the ``Trainer`` with croupier's
sampler (not re-sharded by Accelerate), the sampler's state in every ``checkpoint-<step>`` folder
and an exact resume. The model is a small ``nn.Module`` that returns ``{"loss": ...}``; the data
is synthetic; no download.

    # train, checkpoint at global step 11 (mid-epoch) and stop there, as if preempted:
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer_train.py --output-dir out/hf --stop-after-steps 11
    # resume from it with another world size and train to the end of the epochs:
    torchrun --standalone --nproc-per-node 1 examples/hf_trainer_train.py --output-dir out/hf --resume out/hf/checkpoint-11

With ``CROUPIER_AUDIT_DIR=<dir>`` set for both runs, ``croupier audit <dir>`` then checks that every
epoch was trained exactly once across the two. ``--trained-log DIR`` makes each rank also write the
dataset indices the model's forward received (``DIR/<run>-rank<r>.jsonl``), counted after the
loader. ``--plain-trainer`` uses the plain ``Trainer`` with croupier's ``DistributedSampler`` as its
train sampler (no integration), to show what is refused: Accelerate would re-shard it and each rank
train half of its share, so the sampler raises an error naming ``CroupierTrainer`` instead.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
from typing import IO, Any

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from croupier.client import DistributedBatchSampler, DistributedSampler
from croupier.integrations.transformers import CroupierTrainer


class Synthetic(Dataset[dict[str, Any]]):
    """`n` samples of a noisy linear target, the same in every process; each sample carries its index."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 16, generator=g)
        self.y = self.x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i], "idx": i}


class Recorder(TrainerCallback):
    """Writes the indices the model's forward received, by the Trainer's epoch (the loader's pass)."""

    def __init__(self, out: IO[str] | None) -> None:
        self.out = out
        self.loader: Any = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       train_dataloader: Any = None, **kwargs: Any) -> None:
        self.loader = train_dataloader

    def record(self, idx: torch.Tensor) -> None:
        if self.out is not None and self.loader is not None:
            self.out.write(json.dumps({"epoch": self.loader.iteration, "idx": idx.tolist()}) + "\n")
            self.out.flush()


class Regressor(nn.Module):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.recorder = recorder

    def forward(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training:
            self.recorder.record(idx)
        return {"loss": nn.functional.mse_loss(self.net(x), y)}


class StopAt(TrainerCallback):
    """Stops training right after the checkpoint of global step `step` (a simulated preemption)."""

    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if self.step is not None and state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True


class PlainTrainer(Trainer):
    """What one would try without the integration: croupier's sampler as the Trainer's train sampler."""

    def __init__(self, *args: Any, job: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.job = job

    def _get_train_sampler(self, train_dataset: Any = None) -> DistributedSampler:
        return DistributedSampler(self.train_dataset, shuffle=True, seed=self.args.seed, job=self.job)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4, help="per rank (per_device_train_batch_size)")
    ap.add_argument("--sampler", choices=["index", "batch"], default="index",
                    help="croupier's DistributedSampler, or the integration's default DistributedBatchSampler")
    ap.add_argument("--job", default="hf-trainer-train", help="croupier job name")
    ap.add_argument("--output-dir", required=True, help="the Trainer's output_dir (checkpoint-N folders)")
    ap.add_argument("--stop-after-steps", type=int, default=None,
                    help="checkpoint at this global step and stop (a simulated preemption)")
    ap.add_argument("--resume", default=None, help="a checkpoint-N folder to resume from")
    ap.add_argument("--trained-log", default=None, help="each rank writes the indices its model trained on under DIR")
    ap.add_argument("--plain-trainer", action="store_true",
                    help="the plain Trainer with croupier's sampler (refused: Accelerate would re-shard it)")
    args = ap.parse_args(argv)

    targs = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size, num_train_epochs=args.epochs,
        learning_rate=1e-2, seed=7, save_strategy="no" if args.stop_after_steps is None else "steps",
        save_steps=args.stop_after_steps or 500, logging_strategy="epoch", report_to=[], use_cpu=True,
        ddp_backend="gloo", ddp_find_unused_parameters=False, disable_tqdm=True, dataloader_num_workers=0,
    )
    rank, world = targs.process_index, targs.world_size

    out = None
    if args.trained_log:
        pathlib.Path(args.trained_log).mkdir(parents=True, exist_ok=True)
        run = "resume" if args.resume else "first"
        out = open(pathlib.Path(args.trained_log) / f"{run}-w{world}-rank{rank}.jsonl", "a")
    recorder = Recorder(out)
    torch.manual_seed(0)
    model = Regressor(recorder)
    dataset = Synthetic(args.samples)
    callbacks: list[TrainerCallback] = [recorder, StopAt(args.stop_after_steps)]
    trainer: Trainer
    if args.plain_trainer:
        trainer = PlainTrainer(model=model, args=targs, train_dataset=dataset, callbacks=callbacks, job=args.job)
    else:
        sampler: DistributedSampler | DistributedBatchSampler | None = None
        if args.sampler == "index":
            sampler = DistributedSampler(dataset, shuffle=True, seed=7, job=args.job)
        trainer = CroupierTrainer(model=model, args=targs, train_dataset=dataset, callbacks=callbacks,
                                  croupier_sampler=sampler, croupier_sampler_kwargs={"job": args.job})
    try:
        result = trainer.train(resume_from_checkpoint=args.resume)
        if rank == 0:
            if args.stop_after_steps is not None and result.global_step == args.stop_after_steps:
                print(f"saved {args.output_dir}/checkpoint-{result.global_step}; stopping (preempted)", flush=True)
            else:
                print(f"training done at step {result.global_step}, world {world}", flush=True)
        return 0
    finally:
        if out is not None:
            out.close()
        sampler_in_use = getattr(trainer, "croupier_sampler", None)
        if sampler_in_use is not None:
            sampler_in_use.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
