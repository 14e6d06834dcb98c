"""croupier under Ray Train: a TorchTrainer whose worker is killed mid-epoch, then a restart on another worker count.

The driver starts a local Ray cluster and one ``TorchTrainer`` run; croupier's sampler lives in
``train_loop_per_worker`` and its state goes into Ray's checkpoints
(:mod:`croupier.integrations.ray`)::

    # 2 workers, a checkpoint every 3 steps; worker 1 is killed (SIGKILL) at step 7, Ray restarts the
    # group from the step-6 checkpoint; the run stops at step 11, as if preempted:
    python examples/ray_train.py --workers 2 --out /tmp/ray --kill-at 7 --stop-at 11
    # a new run of 3 workers from the last checkpoint the first one reported:
    python examples/ray_train.py --workers 3 --out /tmp/ray --resume-latest
    croupier audit /tmp/ray/audit                      # every epoch exactly once

rank 0 of each worker group hosts croupier's embedded coordinator, its store under
``OUT/coordinator``. Every worker logs the indices its model received, with the step, to
``OUT/trained/<attempt>-rank<r>.jsonl``, and each attempt writes the step it resumed from, so a
test can drop what an attempt trained after the checkpoint the next one resumed from.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import signal
import time
import uuid
from typing import Any


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import ray.train
    import torch
    import torch.distributed as dist
    from ray.train.torch import prepare_model
    from torch.utils.data import DataLoader, TensorDataset

    from croupier.client import DistributedSampler
    from croupier.integrations import ray as croupier_ray

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    n = config["samples"]
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 8, generator=g)
    dataset = TensorDataset(x, x.sum(dim=1, keepdim=True), torch.arange(n))
    sampler = DistributedSampler(dataset, seed=7, job=config["job"])
    checkpoint = croupier_ray.load(sampler, config.get("resume"))
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(8, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            saved = torch.load(pathlib.Path(d) / "model.pt", weights_only=True)
            model.load_state_dict(saved["model"])
            step = int(saved["step"])
    loader = croupier_ray.prepare_data_loader(DataLoader(dataset, batch_size=config["batch_size"], sampler=sampler))
    out = pathlib.Path(config["out"])
    name = [f"{time.time_ns()}-{uuid.uuid4().hex[:6]}"]
    dist.broadcast_object_list(name, src=0)  # one name for this worker group's attempt
    attempt = name[0]
    log = (out / "trained" / f"{attempt}-rank{rank}.jsonl").open("w")
    log.write(json.dumps({"resumed_from": step, "world": world}) + "\n")
    log.flush()
    for epoch in range(sampler.epoch, config["epochs"]):
        sampler.set_epoch(epoch)
        for xb, yb, idx in loader:
            optim.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            optim.step()
            step += 1
            log.write(json.dumps({"step": step, "epoch": epoch, "idx": idx.tolist()}) + "\n")
            log.flush()
            killed = out / "killed"
            if config.get("kill_at") == step and rank == world - 1 and not killed.exists():
                killed.write_text(str(step))
                os.kill(os.getpid(), signal.SIGKILL)  # a worker lost mid-epoch: Ray restarts the group
            if step % config["every"] == 0 or step == config.get("stop_at"):
                buf = io.BytesIO()
                torch.save({"model": model.state_dict(), "step": step}, buf)
                croupier_ray.report({"step": step, "loss": float(loss)}, loader, step=step,
                                    files={"model.pt": buf.getvalue()})
            if step == config.get("stop_at"):
                if rank == 0:
                    print(f"preempted after step {step}", flush=True)
                log.close()
                sampler.close()
                return
    log.close()
    sampler.close()
    dist.barrier()
    if rank == 0:
        print(f"training done at step {step}, world {world}", flush=True)


def latest(out: pathlib.Path) -> str | None:
    """The newest checkpoint directory of the runs under OUT/ray (by the step it holds)."""
    found = []
    for path in (out / "ray").glob("*/checkpoint_*"):
        model = path / "model.pt"
        if model.exists():
            import torch

            found.append((int(torch.load(model, weights_only=True)["step"]), str(path)))
    return max(found)[1] if found else None


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--every", type=int, default=3, help="report a checkpoint every this many steps")
    ap.add_argument("--kill-at", type=int, default=None, help="SIGKILL the last worker at this step (once)")
    ap.add_argument("--stop-at", type=int, default=None, help="stop every worker after this step (preempted)")
    ap.add_argument("--resume-latest", action="store_true", help="start from the newest checkpoint under OUT/ray")
    ap.add_argument("--job", default="ray-train")
    args = ap.parse_args()

    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = pathlib.Path(args.out).resolve()
    (out / "trained").mkdir(parents=True, exist_ok=True)
    env = {"CROUPIER_STATE_DIR": str(out / "coordinator"), "CROUPIER_AUDIT_DIR": str(out / "audit"),
           "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    ray.init(num_cpus=args.workers + 1, include_dashboard=False, runtime_env={"env_vars": env},
             logging_level="WARNING")
    resume = latest(out) if args.resume_latest else None
    if args.resume_latest:
        assert resume is not None, f"no checkpoint under {out / 'ray'}"
        print(f"resuming from {resume} on {args.workers} workers", flush=True)
    config = {"samples": args.samples, "batch_size": args.batch_size, "epochs": args.epochs, "every": args.every,
              "kill_at": args.kill_at, "stop_at": args.stop_at, "resume": resume, "job": args.job, "out": str(out)}
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
        run_config=RunConfig(name=f"run-{uuid.uuid4().hex[:8]}", storage_path=str(out / "ray"),
                             failure_config=FailureConfig(max_failures=1),
                             checkpoint_config=CheckpointConfig(num_to_keep=None)),
    )
    result = trainer.fit()
    print(f"ray run finished: {result.metrics}", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
