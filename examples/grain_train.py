"""croupier under JAX and Grain: several JAX processes, a checkpoint mid-epoch, a resume on another process count.

Each process runs this script (a JAX multi-process job on the CPU: ``jax.distributed`` with its
coordinator on 127.0.0.1)::

    python examples/grain_train.py --num-processes 2 --process-id 0 --port 4711 --out /tmp/g --save-at 3 --stop-at 5 &
    python examples/grain_train.py --num-processes 2 --process-id 1 --port 4711 --out /tmp/g --save-at 3 --stop-at 5
    # resumed on 3 processes from the checkpoint the 2 saved at step 3 (ids 0, 1, 2):
    python examples/grain_train.py --num-processes 3 --process-id 0 --port 4712 --out /tmp/g --resume /tmp/g/ckpt/step_3 &
    ...

The data is the dataset index itself; a ``RandomMap`` draws one number per record from the
record's ``rng`` (croupier's per-sample seed), as an augmentation would. Every process logs what
its "model" received, step by step, to ``OUT/trained/<run>-process<k>.jsonl``
(``{"step", "keys", "draws"}``): the test audits those logs, each epoch against the dataset.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import numpy as np


class _Draw:
    """A RandomMap: (index, a number drawn from the record's rng), as an augmentation would draw."""

    def random_map(self, element: Any, rng: np.random.Generator) -> Any:
        return np.array([int(element), int(rng.integers(2**62))], dtype=np.int64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--port", type=int, required=True, help="jax.distributed's coordinator port on 127.0.0.1")
    ap.add_argument("--out", required=True, help="checkpoints under OUT/ckpt, the model's logs under OUT/trained")
    ap.add_argument("--records", type=int, default=36)
    ap.add_argument("--batch-size", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2, help="Grain's worker processes per JAX process")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--save-at", type=int, default=0, help="save the iterator's state after this step")
    ap.add_argument("--stop-at", type=int, default=0, help="stop after this step, as if preempted")
    ap.add_argument("--resume", default=None, help="a checkpoint directory to resume from")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.num_processes,
                               process_id=args.process_id, initialization_timeout=120)
    from absl import flags

    flags.FLAGS(sys.argv[:1])  # Grain's worker processes read absl flags: mark them parsed
    import grain

    from croupier.integrations import grain as croupier_grain

    draw = type("Draw", (_Draw, grain.transforms.RandomMap), {})()
    sampler = croupier_grain.CroupierSampler(args.records, shard_options=grain.sharding.ShardByJaxProcess(),
                                             seed=args.seed, num_epochs=args.epochs)
    loader = croupier_grain.DataLoader(data_source=np.arange(args.records), sampler=sampler, worker_count=args.workers,
                                       operations=[draw, grain.transforms.Batch(args.batch_size, drop_remainder=False)])
    it = iter(loader)
    run = "resume" if args.resume else "first"
    if args.resume:
        assert croupier_grain.restore(it, args.resume), f"no checkpoint in {args.resume}"
    out = pathlib.Path(args.out)
    (out / "trained").mkdir(parents=True, exist_ok=True)
    log = (out / "trained" / f"{run}-process{jax.process_index()}.jsonl").open("w")
    step = 0
    for batch in it:
        step += 1
        x = jnp.asarray(batch[:, 0], dtype=jnp.float32)
        float(jnp.mean(x))  # the "model"
        log.write(json.dumps({"step": step, "keys": batch[:, 0].tolist(), "draws": batch[:, 1].tolist()}) + "\n")
        log.flush()
        if step == args.save_at:
            croupier_grain.save(it, out / "ckpt" / f"step_{step}")
        if step == args.stop_at:
            print(f"process {jax.process_index()} preempted after step {step}", flush=True)
            break
    else:
        print(f"process {jax.process_index()} of {jax.process_count()}: training done at step {step}", flush=True)
    log.close()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
