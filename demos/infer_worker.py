"""One worker of `croupier infer-demo`: batch "inference" over the batches the coordinator deals it.

Run as ``python -m croupier.demos.infer_worker --n N --batch B --outputs DIR``, with the launcher's
environment: ``RANK``, ``WORLD_SIZE``, ``CROUPIER_ADDRESS``, ``CROUPIER_JOB`` and
``CROUPIER_INCARNATION`` (new for every generation, the same on its ranks).

The worker resumes the job's latest record (``resume_latest``: the union of every rank's
commits) and exits 0 at once when it is past epoch 0 (the job is done). Otherwise, for each batch
it is dealt, it computes one output per sample (:func:`infer`), appends one JSON line per sample
``{"seq", "index", "output"}`` to ``DIR/{incarnation}-r{rank}.jsonl`` (``seq``: the batch's number in
this rank's sequence of the generation, from 0), makes the lines durable, and only then commits
the batch. It exits 0 when the coordinator has nothing left to deal it.

Commits ride through a coordinator restart: ``commit()`` raises ``RuntimeError`` while the
coordinator does not answer, and the worker asks again (a repeated commit is idempotent).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from croupier.core import settings

#: How long a commit keeps being retried while the coordinator does not answer.
COMMIT_PATIENCE_S = 120.0


def infer(index: int) -> str:
    """The "model" output of sample `index`: a deterministic function of the index (checked by the audit)."""
    return hashlib.blake2b(str(index).encode(), digest_size=6).hexdigest()


def _commit(sampler: Any, rank: int) -> int:
    """Commits `sampler`'s progress, retrying while the coordinator does not answer; returns the retries made."""
    give_up = time.monotonic() + COMMIT_PATIENCE_S
    delay, retries = 0.05, 0
    while True:
        try:
            sampler.commit()
            return retries
        except RuntimeError as e:  # the coordinator did not answer (see DistributedBatchSampler._dealt_state)
            if time.monotonic() >= give_up:
                raise
            if retries == 0:
                print(f"rank {rank}: commit not answered, retrying: {e}", file=sys.stderr, flush=True)
            retries += 1
            time.sleep(delay)  # backoff between retries of a call, not synchronisation
            delay = min(2 * delay, 0.5)


def parse(argv: list[str]) -> argparse.Namespace:
    """The worker's options."""
    ap = argparse.ArgumentParser(prog="croupier.demos.infer_worker", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, required=True, help="samples in the dataset")
    ap.add_argument("--batch", type=int, required=True, help="samples per batch")
    ap.add_argument("--outputs", required=True, help="directory of the output files")
    ap.add_argument("--batch-ms", type=float, default=5.0, help="simulated model time per batch, in ms (default 5)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Runs the worker; returns its exit status."""
    args = parse(sys.argv[1:] if argv is None else argv)
    from croupier.client import DistributedBatchSampler

    rank, incarnation = int(os.environ["RANK"]), settings.get("CROUPIER_INCARNATION")
    sampler = DistributedBatchSampler(args.n, args.batch, dealing="dynamic", lockstep=False, lease_ahead=2, prefetch=1)
    resumed = sampler.resume_latest()
    if sampler.epoch > 0:
        print(f"rank {rank}: the job is done (its latest record is at epoch {sampler.epoch})", flush=True)
        sampler.close()
        return 0
    path = Path(args.outputs) / f"{incarnation}-r{rank}.jsonl"
    seq = retries = 0
    began = time.monotonic()
    with open(path, "a", encoding="utf-8") as out:
        for batch in sampler:
            lines = [json.dumps({"seq": seq, "index": i, "output": infer(i)}) for i in batch]
            time.sleep(args.batch_ms / 1000)  # simulated work: the model's time on one batch
            out.write("\n".join(lines) + "\n")
            out.flush()
            os.fsync(out.fileno())
            retries += _commit(sampler, rank)
            seq += 1
    sampler.close()
    print(f"rank {rank}: {seq} batches in {time.monotonic() - began:.1f} s (resumed: {resumed}, "
          f"commit retries: {retries})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
