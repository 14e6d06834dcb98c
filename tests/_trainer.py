"""A torchrun training loop for the resume tests: gloo, StatefulDataLoader, croupier's sampler.

Every rank appends what its loop receives to LOGDIR/log-{tag}-r{rank}.jsonl. At step --save-at
it saves the loader's state (torch.save) to LOGDIR/ckpt/r{rank}.pt with the epoch. After
--park-after steps of the run it prints "parked" and waits to be killed; without it, it runs
to the end of the epoch and exits. With --by-step the checkpoint holds no sampler or loader
state, only the step: every rank records its state at the coordinator with
``state_dict(step=...)``, and a resume finds it there with ``resume_from_step``.

Environment: CROUPIER_JOB names the job; no CROUPIER_ADDRESS, so rank 0 hosts the embedded
coordinator and the others find it through torchrun's store.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import sys
import time

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

from croupier.client import DistributedSampler, worker_options


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--logdir", required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--n", type=int, default=240)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--save-at", type=int, default=-1)
    ap.add_argument("--park-after", type=int, default=-1)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--by-step", action="store_true")
    ap.add_argument("--step-ms", type=float, default=0.0)  # simulated compute per step
    ap.add_argument("--mark-at", type=int, default=-1)  # rank 0 prints "marked" after this step
    ap.add_argument("--lease-ahead", type=int, default=0)
    # Options come in TRAINER_ARGS: torchrun would take "--n" and the like for abbreviations of its own.
    args = ap.parse_args(os.environ["TRAINER_ARGS"].split())

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logdir = pathlib.Path(args.logdir)
    extra = {"lease_ahead": args.lease_ahead} if args.lease_ahead else {}
    sampler = DistributedSampler(args.n, seed=7, **extra)  # address, job, rank and world all resolved
    loader = StatefulDataLoader(list(range(args.n)), batch_size=args.batch_size, sampler=sampler,
                                **worker_options(args.workers))
    epoch = 0
    if args.resume:
        # Ranks that existed before load their own state; ranks added by a scale-up have none
        # and adopt the others' resume point. The epoch comes from the checkpoint's metadata.
        meta = json.loads((logdir / "ckpt" / "meta.json").read_text())
        epoch = meta["epoch"]
        mine = logdir / "ckpt" / f"r{rank}.pt"
        if args.by_step:
            sampler.resume_from_step(meta["step"])
        elif mine.exists():
            loader.load_state_dict(torch.load(mine, weights_only=False))
    log = open(logdir / f"log-{args.tag}-r{rank}.jsonl", "a", buffering=1)
    step = 0
    sampler.set_epoch(epoch)
    for batch in loader:
        step += 1
        if args.step_ms:
            time.sleep(args.step_ms / 1000)  # stands in for a model's forward and backward pass
        log.write(json.dumps({"epoch": epoch, "step": step, "world": world, "t": time.time(),
                              "indices": batch.tolist()}) + "\n")
        if step == args.mark_at and rank == 0:
            print("marked", flush=True)
        dist.barrier()  # lockstep, as a data-parallel step is
        if step == args.save_at:
            (logdir / "ckpt").mkdir(exist_ok=True)
            if args.by_step:  # the loader may have read ahead: say what the loop took
                sampler.state_dict(consumed=step * args.batch_size, step=step)
            else:
                torch.save(loader.state_dict(), logdir / "ckpt" / f"r{rank}.pt")
            if rank == 0:
                (logdir / "ckpt" / "meta.json").write_text(json.dumps({"epoch": epoch, "step": step, "run": args.tag}))
            dist.barrier()
        if step == args.park_after:
            (logdir / f"pid-{args.tag}-r{rank}").write_text(str(os.getpid()))
            print("parked", flush=True)
            signal.pause()  # until the test kills every rank with SIGKILL
    log.write(json.dumps({"epoch": epoch, "end": True, "world": world}) + "\n")
    log.close()
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
