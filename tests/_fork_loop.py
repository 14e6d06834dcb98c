"""A training loop as the README writes it, against a coordinator at ADDRESS (``embedded``: none given, the
process starts its own): ``DistributedSampler`` + ``Loader`` +
``DataLoader`` with forked workers, and every --every steps a validation ``DataLoader`` whose workers are forked
while the training sampler's prefetch thread is leasing.

Usage: python _fork_loop.py ADDRESS JOB [--epochs E] [--n N] [--every K]

Prints ``batches B forks F`` at the end: the batches the loop took and the worker processes forked.
"""

from __future__ import annotations

import argparse

from torch.utils.data import DataLoader

from croupier.client import DistributedSampler, Loader

BATCH, WORKERS = 16, 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("address")
    ap.add_argument("job")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--every", type=int, default=10)
    a = ap.parse_args()
    # a lease of one batch: the prefetch thread asks the coordinator for a grant at every batch the loop takes
    sampler = DistributedSampler(a.n, 1, 0, address=None if a.address == "embedded" else a.address, job=a.job, incarnation="loop", lease_ahead=BATCH)
    loader = Loader(DataLoader(list(range(a.n)), batch_size=BATCH, sampler=sampler, num_workers=WORKERS,
                               multiprocessing_context="fork"))
    val = DataLoader(list(range(8)), batch_size=8, num_workers=WORKERS, multiprocessing_context="fork")
    batches = forks = 0
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        forks += WORKERS
        for _ in loader:
            batches += 1
            if batches % a.every == 0:
                forks += WORKERS
                for _ in val:
                    pass
    sampler.close()
    print(f"batches {batches} forks {forks}", flush=True)


if __name__ == "__main__":
    main()
