"""One rank of a packed loader's world in a process of its own, with torch.distributed (gloo): `state_dict()`'s
default collective, checkpoints every few steps, and a preemption (the process kills itself).

Usage: python _packing_rank.py ADDRESS JOB RANK WORLD INIT_FILE OUT LENGTHS_JSON
           [--steps S] [--every K] [--kill-after S] [--state FILE] [--workers N] [--reject JSON] [--audit DIR]

Each batch trained appends ``{"step": s, "pieces": [...]}`` to OUT (a JSON line, flushed); every
`--every` steps the ranks checkpoint and rank 0 writes ``{"step": s, "state": ...}`` to OUT.state.
Without --every, the state after --steps (or the epoch) is appended to OUT as ``{"state": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch.distributed as dist
from _filter_data import FilteringDocs
from torch.utils.data import DataLoader

from croupier.client import DistributedSampler, Indexed, PackedLoader


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("address", "job", "rank", "world", "init", "out", "lengths"):
        ap.add_argument(name)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--every", type=int)
    ap.add_argument("--kill-after", type=int)
    ap.add_argument("--state")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--reject", default="[]", help="indices the dataset rejects (raises Filtered)")
    ap.add_argument("--audit", help="the samplers' audit log directory")
    a = ap.parse_args()
    rank = int(a.rank)
    dist.init_process_group("gloo", init_method=f"file://{a.init}", rank=rank, world_size=int(a.world))
    docs = FilteringDocs(json.loads(a.lengths), json.loads(a.reject))
    s = DistributedSampler(len(docs), address=a.address, job=a.job, seed=3, tail="uneven", incarnation=a.init,
                           audit_dir=a.audit)
    dl = DataLoader(Indexed(docs), batch_size=None, sampler=s, num_workers=a.workers)
    pl = PackedLoader(dl, s, 16, pack="best_fit", buffer=4)
    if a.state:
        with open(a.state) as f:
            state = json.load(f)["state"]
        pl.load_state_dict(state)
        s.set_epoch(state["epoch"])
    with open(a.out, "a") as out:
        step = 0
        for batch in pl:
            step += 1
            out.write(json.dumps({"step": step, "pieces": [p for row in batch.pieces for p in row]}) + "\n")
            out.flush()
            if a.every and step % a.every == 0:
                state = pl.state_dict(step=step)
                if rank == 0:
                    with open(a.out + ".tmp", "w") as f:
                        json.dump({"step": step, "state": state}, f)
                    os.replace(a.out + ".tmp", a.out + ".state")
            if a.kill_after is not None and step >= a.kill_after:
                os.kill(os.getpid(), signal.SIGKILL)  # preempted: no cleanup, nothing more written
            if a.steps is not None and step >= a.steps:
                break
        if not a.every:
            out.write(json.dumps({"state": pl.state_dict()}) + "\n")  # the ranks took different numbers of steps
    s.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
