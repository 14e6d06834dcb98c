"""How a DataLoader's worker processes should start in a job that runs collectives."""

from __future__ import annotations

import sys
from typing import Any

from croupier.core.checks import check_int

#: The first CPython whose forked child cannot inherit the interpreter's thread-state lock held by
#: another thread of its parent (CPython issue gh-112275).
FIXED_IN = (3, 12)


def worker_options(num_workers: int) -> dict[str, Any]:
    """Keyword arguments for ``DataLoader(...)`` with `num_workers` workers that start safely.

    With no workers, or on CPython 3.12 and newer: ``{"num_workers": num_workers}`` (workers are
    forked, the default on Linux).

    On older CPython a fork can leave the child stuck for good before it runs a line of Python
    (CPython issue gh-112275): the child waits for the interpreter's thread-state lock, which
    another thread of the parent held at the fork. torch's collective threads take that lock when
    they release a tensor after a collective, so a DataLoader that forks its workers just after
    one (Lightning, Accelerate and most torchrun loops run one before an epoch) can hang its rank,
    and every other rank at the next collective, with nothing printed. There the workers are
    started with ``spawn`` instead, and kept for the whole run (``persistent_workers``) so that the
    start, which imports the training script again, is paid once. The script needs the
    ``if __name__ == "__main__":`` guard and the dataset must pickle, as for any spawned worker.

    Raises:
        TypeError: `num_workers` is not an int.
        ValueError: `num_workers` is below 0.

    Example::

        loader = DataLoader(dataset, batch_size=32, sampler=sampler, **worker_options(4))
    """
    num_workers = check_int("num_workers", num_workers, 0)
    if num_workers == 0 or sys.version_info >= FIXED_IN:
        return {"num_workers": num_workers}
    return {"num_workers": num_workers, "multiprocessing_context": "spawn", "persistent_workers": True}
