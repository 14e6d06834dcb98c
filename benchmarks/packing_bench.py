"""Benchmark: padding of greedy and best-fit packing beside pad-to-longest batches, and the exact packing stage's cost."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from croupier.client import DistributedSampler, Indexed, PackedLoader
from croupier.client._packing import assemble, make_planner, pieces_of
from croupier.server._service import Server

#: Document lengths: a log-normal whose mean is C4.en's (365M documents, 156B tokens: 427 tokens a
#: document; Dodge et al. 2021, "Documenting Large Webtext Corpora", table 1). Web text's lengths
#: have a long right tail; SIGMA = 1.0 (median 259, 1 % of documents over 2,650 tokens) is our
#: assumption, not a published figure: the table shows 0.7 and 1.3 beside it.
MEAN = 156e9 / 365e6
SIGMAS = (0.7, 1.0, 1.3)
SEQ_LEN = 2048
BUFFERS = (16, 64, 256)
PAD_BATCH = 8  # documents per pad-to-longest batch: about SEQ_LEN tokens of documents, as the packed rows hold
WORKERS = 4


def lengths(n: int, sigma: float, seed: int = 0) -> np.ndarray:
    """n log-normal document lengths of mean MEAN and shape `sigma`, at least 1 token."""
    mu = np.log(MEAN) - sigma**2 / 2
    return np.maximum(1, np.random.default_rng(seed).lognormal(mu, sigma, n).round()).astype(np.int64)


def packed_padding(lens: np.ndarray, pack: str, buffer: int) -> tuple[int, float]:
    """Rows and padding fraction (pad tokens / row tokens) of `pack` over `lens` (long documents split)."""
    p = make_planner(pack, SEQ_LEN, buffer)
    rows = 0
    for i, n in enumerate(lens.tolist()):
        for piece in pieces_of(i, n, SEQ_LEN, "split"):
            rows += len(p.add(piece))
    rows += len(p.flush())
    return rows, 1 - int(lens.sum()) / (rows * SEQ_LEN)


def pad_to_longest(lens: np.ndarray) -> tuple[int, float]:
    """Batches and padding fraction of PAD_BATCH documents each padded to its longest (truncated at SEQ_LEN)."""
    t = np.minimum(lens, SEQ_LEN)
    cut = len(t) - len(t) % PAD_BATCH
    b = t[:cut].reshape(-1, PAD_BATCH)  # (batches, PAD_BATCH)
    padded = int(b.max(axis=1).sum()) * PAD_BATCH
    return len(b), 1 - int(b.sum()) / padded


def padding_table(n: int) -> None:
    print(f"## Padding: {n:,} documents, rows of {SEQ_LEN} tokens, log-normal lengths of mean {MEAN:.0f} (C4.en)\n")
    print("| sigma | median | batching | rows or batches | padding | tokens dropped |")
    print("|---|---|---|---|---|---|")
    for sigma in SIGMAS:
        lens = lengths(n, sigma)
        med = int(np.median(lens))
        batches, frac = pad_to_longest(lens)
        dropped = 1 - int(np.minimum(lens, SEQ_LEN).sum()) / int(lens.sum())
        print(f"| {sigma} | {med} | pad to longest, {PAD_BATCH} documents | {batches:,} | {frac:.1%} | {dropped:.2%} |")
        rows, frac = packed_padding(lens, "greedy", 1)
        print(f"| {sigma} | {med} | packed, greedy | {rows:,} | {frac:.1%} | 0 |")
        for b in BUFFERS:
            rows, frac = packed_padding(lens, "best_fit", b)
            print(f"| {sigma} | {med} | packed, best-fit, buffer {b} | {rows:,} | {frac:.1%} | 0 |")
    print()


class Tokenized:
    """Document i: `lens[i]` pseudo-random tokens, made in the worker as a tokenizer's output would be."""

    def __init__(self, lens: np.ndarray) -> None:
        self.lens = lens.tolist()

    def __len__(self) -> int:
        return len(self.lens)

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 50_000, (self.lens[i],), generator=g)


def plain_loop(loader: Iterable[Any], pack: str, buffer: int) -> Iterator[Any]:
    """A packing loop as people write it: the same planner and tensors, no count, no state."""
    p = make_planner(pack, SEQ_LEN, buffer)
    for batch in loader:
        for index, doc in batch:
            for piece in pieces_of(index, doc, SEQ_LEN, "split"):
                for row in p.add(piece):
                    yield assemble([row], SEQ_LEN, 0)
    for row in p.flush():
        yield assemble([row], SEQ_LEN, 0)


def _time(address: str, ds: Tokenized, exact: bool, pack: str, buffer: int) -> tuple[float, float, int]:
    """Wall and main-process CPU seconds from the first batch to the last (the workers' start is not
    timed), and the tokens packed."""
    s = DistributedSampler(len(ds), num_replicas=1, rank=0, address=address, job=uuid.uuid4().hex, tail="uneven")
    dl = DataLoader(Indexed(ds), batch_size=64, sampler=s, collate_fn=list, num_workers=WORKERS, prefetch_factor=4)
    it = iter(PackedLoader(dl, s, SEQ_LEN, pack=pack, buffer=buffer) if exact else plain_loop(dl, pack, buffer))
    first = next(it)
    t, c = time.perf_counter(), time.process_time()
    tokens = int(first.tokens.numel()) - first.padding + sum(int(b.tokens.numel()) - b.padding for b in it)
    elapsed, cpu = time.perf_counter() - t, time.process_time() - c
    s.close()
    return elapsed, cpu, tokens


def throughput_table(n: int, repeats: int) -> None:
    lens = lengths(n, 1.0)
    ds = Tokenized(lens)
    print(f"## Throughput: {n:,} documents through a DataLoader with {WORKERS} workers (batches of 64 documents, "
          f"collate_fn=list), rows of {SEQ_LEN}; {repeats} pairs of runs (every other one the other way round), "
          "each pair's ratio taken (the load of a shared machine changes between pairs more than within one)\n")
    print("| pack | plain loop (tokens/s, median) | exact PackedLoader (tokens/s, median) | exact / plain wall time "
          "(median of pairs) | exact / plain main-process CPU (median of pairs) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        server = Server(f"sqlite:///{d}/coordinator.db").start()
        try:
            for pack, buffer in (("greedy", 1), ("best_fit", 64)):
                plain, exact, wall, cpu = [], [], [], []
                for k in range(repeats):
                    if k % 2:  # every other pair the other way round: neither loop always runs first
                        te, ce, t2 = _time(server.address, ds, True, pack, buffer)
                        tp, cp, tokens = _time(server.address, ds, False, pack, buffer)
                    else:
                        tp, cp, tokens = _time(server.address, ds, False, pack, buffer)
                        te, ce, t2 = _time(server.address, ds, True, pack, buffer)
                    assert t2 == tokens == int(lens.sum()), (t2, tokens)
                    plain.append(tokens / tp)
                    exact.append(tokens / te)
                    wall.append(te / tp)
                    cpu.append(ce / cp)
                print(f"| {pack} | {statistics.median(plain):,.0f} | {statistics.median(exact):,.0f} | "
                      f"**{statistics.median(wall):.3f}x** | {statistics.median(cpu):.3f}x |")
        finally:
            server.stop(grace=0.5)
    print("\nTarget: the exact stage at most 5% slower (a ratio of 1.05x or less).")


def main() -> None:
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # 4 workers on 2 cores: on purpose
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a small run, to check the program works")
    args = ap.parse_args()
    n_pad, n_run, repeats = (20_000, 1_000, 2) if args.quick else (1_000_000, 5_000, 16)
    print(f"croupier packing benchmark ({'quick' if args.quick else 'full'} run)")
    print(f"python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} before\n")
    padding_table(n_pad)
    throughput_table(n_run, repeats)
    print(f"\nload average {os.getloadavg()[0]:.2f} after")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
