"""One rank of a launcher test (tests/e2e/test_launchers.py): a training loop fed by croupier's sampler.

Started as a real process, the way a launcher starts it:

    --launch env     Kubeflow PyTorchJob / torchrun style: RANK, WORLD_SIZE, MASTER_ADDR and
                     MASTER_PORT in the environment, ``init_process_group("gloo")``.
    --launch spawn   ``torch.multiprocessing.spawn`` of --world processes, each of which calls
                     ``init_process_group("gloo", rank=i, world_size=W)`` (MASTER_ADDR/PORT set here).
    --launch slurm   SLURM_NTASKS / SLURM_PROCID in the environment, no WORLD_SIZE / RANK:
                     ``init_process_group("gloo", rank, world_size, init_method="tcp://...")``.
    --launch solo    one plain process, no process group at all.

The sampler's data-parallel world is --layout ``flat`` (the whole job), ``mesh`` (the "dp"
dimension of a --dp x --tp ``DeviceMesh``) or ``group`` (a ``dist.new_group`` per tensor-parallel
coordinate). Every process writes LOGDIR/TAG-g{global rank}.jsonl: a ``meta`` record, one
record per step with the indices its loop received, and at step --save-at a ``ckpt`` record
with its own ``state_dict()`` and rank 0's (broadcast); rank 0 also writes rank 0's state to
--save. --load resumes from such a file; --stop-after ends the loop early (without it the loop
runs to the end of the epoch). No coordinator address is given: rank 0 hosts the embedded one.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

from croupier.client import DistributedSampler


def parse(argv: list[str]) -> argparse.Namespace:
    """The worker's options."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--launch", choices=["env", "spawn", "slurm", "solo"], required=True)
    ap.add_argument("--layout", choices=["flat", "mesh", "group"], default="flat")
    ap.add_argument("--dp", type=int, default=0, help="data-parallel size (mesh, group)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (mesh, group)")
    ap.add_argument("--world", type=int, default=0, help="processes to spawn (spawn)")
    ap.add_argument("--port", type=int, default=0, help="rendezvous port (spawn, slurm)")
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--job", default=None, help="job name (default: resolved by the sampler)")
    ap.add_argument("--save-at", type=int, default=0)
    ap.add_argument("--save", default=None)
    ap.add_argument("--stop-after", type=int, default=0)
    ap.add_argument("--load", default=None)
    ap.add_argument("--logdir", required=True)
    ap.add_argument("--tag", required=True)
    return ap.parse_args(argv)


def _sampler_kwargs(args: argparse.Namespace, me: int) -> tuple[dict[str, Any], int]:
    """The sampler's data-parallel keyword arguments for the layout, and this process's dp coordinate."""
    if args.layout == "flat":
        return {}, me
    if dist.get_world_size() != args.dp * args.tp:
        raise SystemExit(f"world {dist.get_world_size()} is not dp {args.dp} x tp {args.tp}")
    if args.layout == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
        return {"device_mesh": mesh, "mesh_dim": "dp"}, int(mesh.get_local_rank("dp"))
    # One data-parallel group per tensor-parallel coordinate; every rank creates every group.
    mine = None
    for t in range(args.tp):
        ranks = [d * args.tp + t for d in range(args.dp)]
        group = dist.new_group(ranks)
        if me in ranks:
            mine = group
    return {"process_group": mine}, me // args.tp


def train(args: argparse.Namespace) -> None:
    """The training loop: one epoch (or --stop-after steps), logging what it receives."""
    distributed = dist.is_initialized()
    me = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    kwargs, dp_rank = _sampler_kwargs(args, me)
    sampler = DistributedSampler(args.n, seed=args.seed, job=args.job, **kwargs)
    if args.load:
        sampler.load_state_dict(json.loads(pathlib.Path(args.load).read_text()))
    dataset: list[int] = list(range(args.n))
    loader: DataLoader[int] = DataLoader(dataset, batch_size=args.batch, sampler=sampler)  # type: ignore[arg-type]
    logdir = pathlib.Path(args.logdir)
    with open(logdir / f"{args.tag}-g{me}.jsonl", "w", buffering=1) as log:

        def record(**rec: Any) -> None:
            log.write(json.dumps(rec) + "\n")

        record(kind="meta", rank=me, world=world, dp_rank=dp_rank, num_replicas=sampler.num_replicas,
               sampler_rank=sampler.rank, job=sampler.job)
        steps = 0
        for step, batch in enumerate(loader, 1):
            steps = step
            record(kind="step", step=step, indices=batch.tolist())
            if step == args.save_at:
                own = sampler.state_dict()
                shared: list[Any] = [own]
                if distributed:
                    dist.broadcast_object_list(shared, src=0)
                record(kind="ckpt", step=step, own=own, rank0=shared[0])
                if me == 0 and args.save:
                    tmp = pathlib.Path(args.save + ".tmp")
                    tmp.write_text(json.dumps(shared[0]))
                    tmp.replace(args.save)
            if step == args.stop_after:
                break
        record(kind="end", steps=steps, epoch=sampler.epoch)
    sampler.close()
    if distributed:
        dist.barrier()  # rank 0 hosts the coordinator: it leaves last
        dist.destroy_process_group()


def _spawned(index: int, args: argparse.Namespace) -> None:
    """One process of ``mp.spawn``: the recipe's own ``init_process_group`` with rank and world size."""
    dist.init_process_group("gloo", rank=index, world_size=args.world)
    train(args)


def main(argv: list[str]) -> None:
    """Starts the rank(s) the way --launch says."""
    args = parse(argv)
    if args.launch == "spawn":
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(args.port)
        mp.spawn(_spawned, args=(args,), nprocs=args.world, join=True)
    elif args.launch == "env":
        dist.init_process_group("gloo")
        train(args)
    elif args.launch == "slurm":
        rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{args.port}")
        train(args)
    else:
        train(args)


if __name__ == "__main__":
    main(sys.argv[1:])
