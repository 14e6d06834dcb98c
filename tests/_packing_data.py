"""Packing runs for the tests: documents of given lengths, every rank of a world in a thread, and the token audit."""

from __future__ import annotations

import multiprocessing
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch
from _ranks import on_ranks
from torch.utils.data import DataLoader

from croupier.client import DistributedSampler, Indexed, PackedLoader

#: DataLoader workers start from a fork server that imported torch once: a fork from a test
#: process whose ranks run in threads could inherit a lock another thread held (CPython gh-112275),
#: and spawning imports torch again for every worker.
CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "_packing_data"])


class Docs:
    """Document i is ``lengths[i]`` tokens, its token t being ``i * 10_000 + t`` (so a token names its place)."""

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = list(lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.arange(self.lengths[i], dtype=torch.int64) + i * 10_000


class ThreadGather:
    """A collective for ranks that are threads of one process: each gives its object, all get everyone's."""

    def __init__(self, world: int) -> None:
        self._slots: list[Any] = [None] * world
        self._barrier = threading.Barrier(world)

    def for_rank(self, rank: int) -> Callable[[dict[str, Any]], list[dict[str, Any]]]:
        def gather(obj: dict[str, Any]) -> list[dict[str, Any]]:
            self._slots[rank] = obj
            self._barrier.wait(timeout=60)
            out = list(self._slots)
            self._barrier.wait(timeout=60)
            return out

        return gather


Trained = list[tuple[int, int, int]]


def run_world(address: str, job: str, docs: Docs, world: int, workers: int, seq_len: int, steps: int | None,
              state: dict[str, Any] | None, stateful: bool = False, lockstep: bool = False,
              sampler_args: dict[str, Any] | None = None, **packing: Any) -> tuple[list[Trained], list[dict[str, Any]]]:
    """Every rank of a world (threads) trains `steps` batches (None: to the end of the epoch) from `state`,
    then checkpoints (every rank); each rank's pieces trained and its state. `stateful`: through
    torchdata's ``StatefulDataLoader`` (its own state unused) instead of torch's ``DataLoader``.
    `lockstep`: the ranks wait for each other after every batch, as DDP's gradient all-reduce makes them
    (each must then have `steps` batches), and a sampler's join waits 30 s at most. `sampler_args`: more
    of the sampler's arguments (dealing, weights, ...)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    make = StatefulDataLoader if stateful else DataLoader
    g = ThreadGather(world)
    step = threading.Barrier(world)
    incarnation = uuid.uuid4().hex

    def rank(r: int) -> tuple[Trained, dict[str, Any]]:
        s = DistributedSampler(len(docs), num_replicas=world, rank=r, address=address, job=job, seed=3, tail="uneven",
                               incarnation=incarnation, join_timeout=30 if lockstep else None,
                               **(sampler_args or {}))
        ctx = {"multiprocessing_context": CONTEXT} if workers else {}
        dl = make(Indexed(docs), batch_size=None, sampler=s, num_workers=workers, **ctx)  # type: ignore[arg-type]
        pl = PackedLoader(dl, s, seq_len, gather=g.for_rank(r), **packing)
        if state is not None:
            pl.load_state_dict(state)
            s.set_epoch(state["epoch"])  # as torch's loop does: the rest of the state's epoch
        trained: Trained = []
        it = iter(pl)
        assert isinstance(it, Generator)
        try:
            k = 0
            while steps is None or k < steps:  # a batch taken is a batch trained
                batch = next(it, None)
                if batch is None:
                    break
                trained += [p for row in batch.pieces for p in row]
                k += 1
                if lockstep:
                    step.wait(timeout=60)
            return trained, pl.state_dict()
        finally:
            it.close()
            s.close()

    out = on_ranks(world, rank)
    return [t for t, _ in out], [st for _, st in out]


def token_audit(lengths: Sequence[int], trained: Sequence[tuple[int, int, int]], limit: int | None) -> Counter[str]:
    """What went wrong with the tokens `trained` (pieces): 'missing', 'repeated' and 'foreign' tokens
    against every token of every document (its first `limit`, if truncated) once; empty when exact."""
    seen: Counter[tuple[int, int]] = Counter()
    for i, o, n in trained:
        for t in range(o, o + n):
            seen[(i, t)] += 1
    want = {(i, t) for i, n in enumerate(lengths) for t in range(n if limit is None else min(n, limit))}
    bad: Counter[str] = Counter()
    bad["missing"] = len(want - set(seen))
    bad["repeated"] = sum(c - 1 for c in seen.values() if c > 1)
    bad["foreign"] = len(set(seen) - want)
    return +bad
