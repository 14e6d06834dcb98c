"""One rank of the peers' packing pipeline in a process of its own: torchdata's StatefulDataLoader over a packing
IterableDataset as people write it, with a filter in the workers, checkpoints and a preemption (kill -9).

Usage: python _peer_rank.py RANK WORLD OUT LENGTHS_JSON REJECT_JSON STATES_DIR
           [--workers N] [--every K] [--kill-after S] [--resume-from DIR]

Each row trained appends ``{"step": s, "pieces": [...]}`` to OUT; every `--every` steps the rank saves its
``StatefulDataLoader.state_dict()`` (with the step) to STATES_DIR/rRANK.pt. With --resume-from, a rank of
the same world and worker count loads its own state; otherwise (the state cannot be mapped to another
world or worker count) it does what a user does: adds up the documents every old worker counted as
consumed and starts the global order after that many, sharded for the new world.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

SEQ_LEN = 16


class PackingStream(IterableDataset[dict[str, Any]]):
    """The global order (a seeded shuffle) from `start`, strided by rank then by worker, filtered and packed
    greedily in the worker; its state counts the documents taken into the buffer (or filtered out)."""

    def __init__(self, lengths: list[int], reject: set[int], rank: int, world: int, start: int = 0) -> None:
        self.lengths, self.reject, self.rank, self.world, self.start = lengths, reject, rank, world, start
        self.consumed = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        order = np.random.default_rng(0).permutation(len(self.lengths))[self.start:][self.rank::self.world][wid::nw]
        row: list[tuple[int, int, int]] = []
        used = 0
        for i in order[self.consumed:].tolist():
            self.consumed += 1  # NOTE: the peers' count: in the buffer (or filtered), not yet in a trained row
            if i in self.reject:
                continue
            for a in range(0, self.lengths[i], SEQ_LEN):
                n = min(SEQ_LEN, self.lengths[i] - a)
                if used + n > SEQ_LEN:
                    yield {"pieces": row}
                    row, used = [], 0
                row.append((i, a, n))
                used += n
        if row:
            yield {"pieces": row}

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed, "start": self.start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed, self.start = state["consumed"], state["start"]


def main() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    ap = argparse.ArgumentParser()
    for name in ("rank", "world", "out", "lengths", "reject", "states"):
        ap.add_argument(name)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--every", type=int)
    ap.add_argument("--kill-after", type=int)
    ap.add_argument("--resume-from")
    a = ap.parse_args()
    rank, world = int(a.rank), int(a.world)
    lengths, reject = json.loads(a.lengths), set(json.loads(a.reject))
    start, mine = 0, None
    if a.resume_from:
        saved = {p.name: torch.load(p, weights_only=False) for p in Path(a.resume_from).glob("r*.pt")}
        old = saved[f"r{rank}.pt"]["loader"] if f"r{rank}.pt" in saved else None
        snaps = [s["loader"]["_snapshot"] for s in saved.values()]
        same = len(saved) == world and all(s["_main_snapshot"]["_num_workers"] == a.workers for s in snaps)
        if same:
            mine = old
        else:  # the state does not fit this world: start the global order after every document counted consumed
            workers = [w["dataset_state"] for s in snaps for w in s["_worker_snapshots"].values()]
            start = workers[0]["start"] + sum(w["consumed"] for w in workers)
    dl = StatefulDataLoader(PackingStream(lengths, reject, rank, world, start), batch_size=None, num_workers=a.workers)
    if mine is not None:
        dl.load_state_dict(mine)
    Path(a.states).mkdir(parents=True, exist_ok=True)
    with open(a.out, "a") as out:
        for step, row in enumerate(dl, 1):
            out.write(json.dumps({"step": step, "pieces": row["pieces"]}) + "\n")
            out.flush()
            if a.every and step % a.every == 0:
                tmp = Path(a.states) / f".r{rank}.tmp"
                torch.save({"step": step, "loader": dl.state_dict()}, tmp)
                os.replace(tmp, Path(a.states) / f"r{rank}.pt")
            if a.kill_after is not None and step >= a.kill_after:
                os.kill(os.getpid(), signal.SIGKILL)  # preempted: no cleanup, nothing more written


if __name__ == "__main__":
    main()
