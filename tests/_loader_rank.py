"""One rank of a plain DataLoader's job through `Loader`, in a process of its own with the torchrun environment.

Usage: python _loader_rank.py ADDRESS JOB INCARNATION RUN_DIR AUDIT_DIR [--n N] [--batch-size B] [--workers W]
           [--epochs E] [--every K] [--park-after S] [--state FILE] [--own-state]

RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE come from the environment, as torchrun sets them; the
ranks meet through RUN_DIR/init (gloo). Each batch the loop takes appends ``{"epoch", "step", "idx"}`` to
RUN_DIR/log-r{RANK}.jsonl (flushed) and the ranks step in lockstep (a barrier). Every --every steps rank 0
writes ``{"step", "state"}`` to RUN_DIR/ckpt.json atomically with ``Loader.state_dict()``, and with --own-state
the sampler's own ``state_dict()`` (what it handed out, the workers' read-ahead included) to RUN_DIR/own.json. After step
--park-after a rank prints "parked" and waits to be killed. --state resumes from such a checkpoint file.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader

from croupier.client import DistributedSampler, Loader

#: Workers forked from a server that imported torch once: a spawn per worker would import it again each time.
CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch"])


def save(path: Path, checkpoint: dict[str, Any]) -> None:
    """Writes `checkpoint` to `path` atomically: a kill -9 leaves the previous one whole."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(checkpoint))
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("address", "job", "incarnation", "run", "audit"):
        ap.add_argument(name)
    ap.add_argument("--n", type=int, default=240)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--every", type=int)
    ap.add_argument("--park-after", type=int)
    ap.add_argument("--state")
    ap.add_argument("--own-state", action="store_true", help="also save the sampler's own state (RUN_DIR/own.json)")
    a = ap.parse_args()
    run = Path(a.run)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{run / 'init'}", rank=rank, world_size=world)
    sampler = DistributedSampler(a.n, seed=11, address=a.address, job=a.job, incarnation=a.incarnation,
                                 tail="uneven", audit_dir=a.audit)  # rank and world from the process group
    ctx = {"multiprocessing_context": CONTEXT} if a.workers else {}
    loader = Loader(DataLoader(list(range(a.n)), batch_size=a.batch_size, sampler=sampler, num_workers=a.workers,
                               **ctx))
    epoch = step = 0
    if a.state:
        saved = json.loads(Path(a.state).read_text())
        loader.load_state_dict(saved["state"])
        epoch, step = saved["state"]["epoch"], saved["step"]
    with open(run / f"log-r{rank}.jsonl", "a") as log:
        for e in range(epoch, a.epochs):
            sampler.set_epoch(e)
            for batch in loader:
                step += 1
                log.write(json.dumps({"epoch": e, "step": step, "idx": batch.tolist()}) + "\n")
                log.flush()
                dist.barrier()  # lockstep, as a data-parallel step is: every rank trained this step
                if a.every and step % a.every == 0:
                    state = loader.state_dict(step=step)
                    if rank == 0:
                        save(run / "ckpt.json", {"step": step, "state": state})
                        if a.own_state:  # beside it, what the sampler handed out (read-ahead included)
                            save(run / "own.json", {"step": step, "state": sampler.state_dict()})
                if step == a.park_after:
                    print("parked", flush=True)
                    signal.pause()  # until the test kills the rank and its workers with SIGKILL
    loader.close()
    sampler.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
