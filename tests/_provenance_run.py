"""A job trained step by step through a real coordinator by in-process batch samplers, for the provenance tests."""

from __future__ import annotations

import io
from collections.abc import Sequence
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

from _ranks import Ranks

from croupier.client import DistributedBatchSampler
from croupier.core.schedule import Schedule
from croupier.tools import cli


def generation(address: str, job: str, incarnation: str, world: int, steps: int, *, dataset: int | Sequence[int],
               batch: int = 4, resume: dict[str, Any] | None = None, save_at: Sequence[int] = (),
               **kw: Any) -> dict[int, dict[str, Any]]:
    """`world` ranks of one generation take `steps` optimizer steps and stop (as if preempted).

    Args:
        dataset: N, or each source's size (a mixture with equal weights).
        resume: A state to load first (every rank loads the same), or None for a fresh start.
        save_at: Steps after which rank 0 takes ``state_dict(step=t)`` (the coordinator records it).
        kw: The samplers' other arguments (``global_batch``, ``rampup``, ``max_tokens``, ...).

    Returns:
        The states saved, by step.
    """
    if isinstance(dataset, int):
        n, mix = dataset, {}
    else:
        n, mix = sum(dataset), {"weights": [1.0] * len(dataset), "sources": list(dataset)}
    size = None if "max_tokens" in kw else batch
    samplers = [DistributedBatchSampler(n, size, num_replicas=world, rank=r, address=address, job=job,
                                        incarnation=incarnation, seed=3, **mix, **kw) for r in range(world)]
    first = 0
    if resume is not None:
        for s in samplers:
            s.load_state_dict(resume)
        first = int(resume["step"])
    schedule = Schedule(kw.get("global_batch") or 0, tuple(kw["rampup"]) if kw.get("rampup") else None)
    spec = samplers[0].spec
    ranks = Ranks(samplers)
    saved: dict[int, dict[str, Any]] = {}
    try:
        for t in range(first + 1, first + steps + 1):
            got = [ranks.next(r) for _ in range(schedule.at(spec, world, t)) for r in range(world)]
            assert any(b is not None for b in got), f"step {t}: the epoch ended"
            if t in save_at:
                saved[t] = samplers[0].state_dict(step=t)
    finally:
        ranks.close()
    return saved


def run_cli(*argv: str) -> tuple[int, str, str]:
    """`croupier ARGV` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(out):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()
