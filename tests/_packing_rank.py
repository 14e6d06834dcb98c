"""One rank of a packed loader's world in a process of its own, with torch.distributed (gloo): `state_dict()`'s
default collective.

Usage: python _packing_rank.py ADDRESS JOB RANK WORLD INIT_FILE OUT LENGTHS_JSON STEPS
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist
from _packing_data import Docs
from torch.utils.data import DataLoader

from croupier.client import DistributedSampler, Indexed, PackedLoader


def main() -> None:
    address, job, rank, world, init, out, lengths, steps = sys.argv[1:9]
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=int(rank), world_size=int(world))
    docs = Docs(json.loads(lengths))
    s = DistributedSampler(len(docs), address=address, job=job, seed=3, tail="uneven", incarnation=job)
    pl = PackedLoader(DataLoader(Indexed(docs), batch_size=None, sampler=s), s, 16, pack="best_fit", buffer=4)
    trained = []
    it = iter(pl)
    for _ in range(int(steps)):
        trained += [list(p) for row in next(it).pieces for p in row]
    state = pl.state_dict(step=int(steps))
    with open(out, "w") as f:
        json.dump({"trained": trained, "state": state}, f)
    s.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
