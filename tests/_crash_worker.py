"""A training job for the crash test: lockstep ranks, checkpoints, restarts and resizes, over gRPC.

Usage: python _crash_worker.py ADDRESS JOB SEED EPOCHS

Prints JSON lines: {"ack": ...} after each acknowledged join, {"step": ...} after each training
step, and at the end {"done": JOB, "epochs": {epoch: trained indices}} with the epochs that the
final timeline (after every rollback to a checkpoint) completed.
"""

from __future__ import annotations

import json
import random
import sys

from croupier.client._rpc import CoordinatorClient
from croupier.core.api import JoinRequest
from croupier.core.checkpoint import from_state, to_state
from croupier.core.registry import plan_epoch
from croupier.core.spec import Spec


def say(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def main() -> None:
    address, job, seed, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(seed)
    spec = Spec(n=rng.randint(50, 400), seed=seed, batch_size=rng.randint(1, 4), tail="uneven",
                partition=rng.choice(["strided", "chunked"]))
    c = CoordinatorClient(address, retry_for=120.0)
    log: list[tuple[int, list[int]]] = []  # (epoch, batch) the model trained on
    completed: dict[int, list[int]] = {}  # epochs the model finished, and what it trained on in each
    checkpoints: list[tuple[dict, list[tuple[int, list[int]]], dict[int, list[int]]]] = []
    state: dict = {}
    number = 0  # of the incarnation
    rpcs = 0
    finished = 0
    while finished < epochs:
        number += 1
        world = rng.randint(1, 4)
        incarnation = f"{job}-{number}"
        cursor = from_state(job, spec, state)
        result = None
        for r in rng.sample(range(world), world):
            result = c.join(JoinRequest(job, spec, incarnation, world, r, cursor), wait_s=0.0)
            rpcs += 1
            say(ack="join", job=job, incarnation=incarnation, rank=r, generation=result.generation)
        assert result is not None and result.start is not None, result
        gen, start = result.generation, result.start
        epoch, j = start.epoch, 0
        for _ in range(rng.randint(3, 25)):  # steps before this incarnation is preempted
            p = plan_epoch(spec, start, world, epoch)
            got = []
            for r in range(world):
                lease = c.lease(job, gen, r, epoch, j, 1)
                rpcs += 1
                got.append(lease.batches[0].tolist() if lease.batches else None)
            if all(b is None for b in got):
                completed[epoch] = [i for e, b in log if e == epoch for i in b]
                finished = len(completed)
                epoch, j = epoch + 1, 0
                if finished >= epochs:
                    break
                continue
            log.extend((epoch, b) for b in got if b is not None)
            j += 1
            say(step=j, job=job, epoch=epoch)
            if rng.random() < 0.4:
                assert p is not None
                checkpoints.append((to_state(job, spec, p.advance(j)), list(log), dict(completed)))
        if finished >= epochs:
            break
        # Preempted: restart from the latest checkpoint, or now and then from an older one.
        if checkpoints:
            k = len(checkpoints) - 1 if rng.random() < 0.7 else rng.randrange(len(checkpoints))
            state, log, completed = checkpoints[k][0], list(checkpoints[k][1]), dict(checkpoints[k][2])
            checkpoints = checkpoints[: k + 1]
            finished = len(completed)
        else:
            state, log, completed, finished = {}, [], {}, 0
    say(done=job, n=spec.n, epochs=completed, rpcs=rpcs, retries=c.retries)
    c.close()


if __name__ == "__main__":
    main()
